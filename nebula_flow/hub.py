"""Models by name, as users write them: a hub id (``Qwen/Qwen3-0.6B``) becomes a local folder.

``huggingface_hub`` owns the cache (``HF_HUB_CACHE``, ``HF_HOME``) and the downloads: a model
already in the cache is used without touching the network (so an offline host with a
pre-filled cache serves it); one that is not is downloaded where there is a network
(``HF_HUB_OFFLINE=1`` forbids it). Only what serving reads is fetched: configs, tokenizer files,
chat templates and safetensors weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

# What serving reads from a checkpoint (no .bin/.pt/.gguf weights, no ONNX or framework copies).
SERVING_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(@[A-Za-z0-9_./-]{1,128})?")


class HubError(ValueError):
    """A hub id that could not be found in the cache nor downloaded; the message says what to do."""


def is_hub_id(spec: str) -> bool:
    """``owner/name`` (optionally ``@revision``) that is not a local path."""
    return bool(HUB_ID.fullmatch(spec)) and not Path(spec).expanduser().exists()


def resolve(spec: str, log: Callable[[str], None] = lambda _m: None) -> str:
    """The local folder of hub id ``spec`` (``owner/name[@revision]``): from the cache, else downloaded."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = spec.partition("@")
    kwargs = {"revision": revision or None, "allow_patterns": SERVING_FILES}
    try:
        return str(snapshot_download(repo_id, local_files_only=True, **kwargs))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    if constants.HF_HUB_OFFLINE:
        raise HubError(f"model {spec!r} is not in the hub cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE "
                       "forbids downloading it: fill the cache, or give a local folder") from None
    log(f"downloading {spec} from the hub into {constants.HF_HUB_CACHE} ...")
    try:
        folder = str(snapshot_download(repo_id, **kwargs))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise HubError(f"model {spec!r} is not a local folder, not in the hub cache ({constants.HF_HUB_CACHE}), "
                       f"and downloading it failed: {exc}") from None
    log(f"{spec}: {folder}")
    return folder


def local_folder(spec: str, log: Callable[[str], None] = lambda _m: None) -> str:
    """Where a model named as a config names it lives, for the commands that take one model
    (``worker --model``, ``broker --model``): a hub id (from the cache, else downloaded),
    ``cache:NAME`` (the nebula-flow cache folder) or a folder, as given."""
    from nebula_flow.config import resolve_model_path

    return resolve(spec, log) if is_hub_id(spec) else resolve_model_path(spec)
