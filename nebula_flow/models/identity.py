"""Which model a checkpoint folder holds, told apart cheaply (no torch: the broker asks too).

Every verify must run the broker's target, or the output is no longer the target's own: a target
worker started with another checkpoint (a draft's folder, another fine-tune) was registered and
verified rounds. A worker sends its target's fingerprint when it registers; the broker refuses one
that differs from its own target's (``broker/admission.py``).

The fingerprint is two hashes: of ``config.json`` (parsed, without the keys that name where it
came from), and of the weight files: each one's name, size, and first and last MiB. That reads a
few MiB however large the model, and two different trainings of one shape differ there. The
weights are compared only where both sides have them (a broker may hold the tokenizer and config
alone).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLE_BYTES = 1 << 20  # read from each end of each weight file
UNRELATED_KEYS = ("transformers_version",)  # (and every "_..." key: where the file was written from)


def fingerprint(folder: str | Path) -> dict[str, str | None]:
    """``{"config": HEX, "weights": HEX or None}`` for a checkpoint folder."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    kept = {k: v for k, v in raw.items() if not k.startswith("_") and k not in UNRELATED_KEYS}
    config = hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        return {"config": config, "weights": None}
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES))
            digest.update(f.read(SAMPLE_BYTES))
    return {"config": config, "weights": digest.hexdigest()[:16]}


def differences(ours: dict[str, str | None], theirs: object) -> list[str]:
    """What differs between two fingerprints (``[]``: the same model as far as both can tell);
    ``theirs`` as a peer sent it, so of any shape (one that is not a fingerprint: ``["fingerprint"]``)."""
    if not isinstance(theirs, dict) or not all(isinstance(theirs.get(k), str | None) for k in ("config", "weights")):
        return ["fingerprint"]
    out = ["config"] if ours["config"] != theirs["config"] else []
    if ours["weights"] is not None and theirs["weights"] is not None and ours["weights"] != theirs["weights"]:
        out.append("weights")
    return out
