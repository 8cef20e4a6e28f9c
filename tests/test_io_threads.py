"""Every broker's and worker's ZeroMQ I/O thread on one CPU (``zmq_io_cpu``): checked in the config,
and applied by the real processes of a deployment, which still serve losslessly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nebula_flow.client import Client
from nebula_flow.config import ConfigError, load_config
from nebula_flow.deploy import Deployment
from tests.conftest import deploy_config, hf_greedy


def _io_thread_cpus(pid: int) -> list[set[int]]:
    """The CPUs each ZeroMQ I/O thread of process ``pid`` may run on (libzmq names them ZMQbg/IO/N)."""
    tasks = Path(f"/proc/{pid}/task")
    return [os.sched_getaffinity(int(t.name)) for t in tasks.iterdir()
            if (t / "comm").read_text().strip().startswith("ZMQbg/IO")]


def test_the_config_takes_a_usable_cpu_or_nothing(tmp_path: Path) -> None:
    pair = '[draft]\nmodel = "d"\n[target]\nmodel = "t"\n'
    path = tmp_path / "c.toml"
    path.write_text(pair)
    assert load_config(path).zmq_io_cpu is None  # (off unless asked)
    cpu = min(os.sched_getaffinity(0))
    path.write_text(f"zmq_io_cpu = {cpu}\n" + pair)
    cfg = load_config(path)
    cfg.validate()
    assert cfg.zmq_io_cpu == cpu
    for bad in ("-1", "1.5", "true", '"0"', str(os.cpu_count() + 64)):
        path.write_text(f"zmq_io_cpu = {bad}\n" + pair)
        with pytest.raises(ConfigError, match="zmq_io_cpu must be one of this host's usable CPUs"):
            load_config(path).validate()


def test_a_deployments_processes_run_their_io_threads_on_that_cpu(tiny_pair: Path) -> None:
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.zmq_io_cpu = cpu = max(os.sched_getaffinity(0))
    prompt = [5, 6, 7, 8]
    with Deployment(cfg) as dep, Client(dep.address) as client:
        assert client.generate(token_ids=prompt, max_new_tokens=8).token_ids == hf_greedy(tiny_pair / "target", prompt, 8)
        for name, proc in dep.procs:  # (the broker and both workers)
            cpus = _io_thread_cpus(proc.pid)
            assert cpus and all(c == {cpu} for c in cpus), (name, cpus)
    unpinned = deploy_config(tiny_pair, "autoregressive", 0, 1)
    with Deployment(unpinned) as dep:  # (off: where the kernel puts them)
        assert all(_io_thread_cpus(proc.pid) == [os.sched_getaffinity(0)] for _, proc in dep.procs)
