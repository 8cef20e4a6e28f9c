"""Shared fixtures: the project's tiny model pair, HF references, live deployments."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from nebula_flow.config import DeployConfig, PoolConfig
from nebula_flow.deploy import free_port
from nebula_flow.tiny import build_tiny_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per test session; deterministic (seeded) weights and tokenizer."""
    return build_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: HF transformers alone, greedy, stopping at EOS like ``generate`` does."""

    model = _hf_model(str(model_dir))
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


_HF_CACHE: dict[str, object] = {}


def _hf_model(path: str):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path).eval()
    return _HF_CACHE[path]


def deploy_config(pair: Path, mode: str, draft_workers: int = 1, target_workers: int = 1, k: int = 4,
                  max_batch: int = 8) -> DeployConfig:
    cfg = DeployConfig(mode=mode, draft=PoolConfig(str(pair / "draft"), draft_workers, max_batch, threads=1),
                       target=PoolConfig(str(pair / "target"), target_workers, max_batch, threads=1))
    cfg.broker.client_port = cfg.broker.worker_port = 0  # free ports
    cfg.broker.policy = cfg.broker.policy.replace(k=k)
    return cfg


def tiny_config_file(pair: Path, folder: Path, mode: str = "pooled") -> Path:
    """A deployment TOML for the tiny pair in ``mode`` (one thread a worker), written in ``folder``."""
    path = folder / "tiny.toml"
    path.write_text(f'mode = "{mode}"\n[draft]\nmodel = "{pair / "draft"}"\nthreads = 1\n'
                    f'[target]\nmodel = "{pair / "target"}"\nthreads = 1\n')
    return path


# A trace of three requests: a text prompt, token ids sampled with a seed, and a prompt length (cut
# from the tokenizer's corpus, clipped to the context); they generate 6, 5 and 4 tokens.
SAMPLE_TRACE = "\n".join([
    '{"arrival_s": 0.0, "prompt": "def f(x):", "max_new_tokens": 6}',
    '{"arrival_s": 0.1, "prompt_tokens": [1, 2, 3], "max_new_tokens": 5, "temperature": 0.8, "seed": 1}',
    '{"arrival_s": 0.2, "prompt_len": 2000, "max_new_tokens": 4}'])


def workers_lost(state: dict) -> int:
    """Workers the broker dropped as gone: silent past liveness ("dead"), or refusing a send first
    ("unreachable": ZeroMQ already knew the connection was closed)."""
    counters = state["counters"]
    return counters.get("workers_dead", 0) + counters.get("workers_unreachable", 0)


# Many processes share 2 cores in CI: keep torch in each to one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@contextlib.contextmanager
def gateway_health(broker: str, env: dict[str, str] | None = None) -> Iterator[tuple[int, httpx.Response]]:
    """Start `nebula-flow api` in front of ``broker`` (a process of its own, on a free port); yield
    its port and its first ``/health`` answer, whatever it is (e.g. 503: no broker answers); stop it."""
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "api", "--broker", broker, "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:  # (until it listens)
            try:
                first = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline and gateway.poll() is None, "the gateway did not start"
                time.sleep(0.1)
        yield port, first
    finally:
        gateway.terminate()
        gateway.wait(30)
