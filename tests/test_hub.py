"""Models by name: a hub id in a config is served from a pre-filled hub cache, offline."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from nebula_flow import hub

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """The hub cache's layout for ``repo_id`` at revision main, holding ``folder``'s files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / SNAPSHOT
    shutil.copytree(folder, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snap


def test_hub_ids_resolve_from_the_cache_offline(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from huggingface_hub import constants

    snap = fill_cache(tmp_path, "tinyorg/tiny-target", tiny_pair / "target")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.is_hub_id("tinyorg/tiny-target") and not hub.is_hub_id(str(tiny_pair / "target"))
    assert not hub.is_hub_id("ngram") and not hub.is_hub_id("./a/b/c")
    assert Path(hub.resolve("tinyorg/tiny-target")) == snap
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE"):
        hub.resolve("tinyorg/not-cached")


@pytest.mark.slow
def test_serve_a_hub_id_offline_and_list_it_by_that_name(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    fill_cache(tmp_path / "hub", "tinyorg/tiny-target", tiny_pair / "target")
    config = tmp_path / "hub.toml"
    config.write_text(f'mode = "pooled"\n[draft]\nmodel = "{tiny_pair / "draft"}"\nthreads = 1\n'
                      '[target]\nmodel = "tinyorg/tiny-target"\nthreads = 1\n')
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "serve", "--config", str(config), "--port", "0",
                             "--http-port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)
    try:
        url, seen, deadline = None, [], time.monotonic() + 120
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stderr], [], [], 1.0)[0]:
                line = proc.stderr.readline()
                seen.append(line)
                if line.startswith("HTTP API"):
                    url = line.split(" on ")[1].split("/v1")[0]
        assert url is not None, "".join(seen)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tinyorg/tiny-target"]
        out = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tinyorg/tiny-target", "prompt": "def f(x):", "max_tokens": 5, "temperature": 0}).json()
        assert out["usage"]["completion_tokens"] == 5
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
