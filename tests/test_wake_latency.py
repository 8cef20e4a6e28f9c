"""The CPU wake-up latency request a deployment may hold (``cpu_wake_latency_us``): checked in the
config, written as the kernel reads it, held exactly while the deployment runs, and a host that
refuses it is logged, not fatal."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import pytest

from nebula_flow import wake_latency
from nebula_flow.client import Client
from nebula_flow.config import ConfigError, load_config
from nebula_flow.deploy import Deployment
from tests.conftest import deploy_config, hf_greedy


def _open_fds_on(path: Path) -> int:
    """How many of this process's file descriptors are open on ``path``."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


def test_the_config_takes_whole_microseconds_or_nothing(tmp_path: Path) -> None:
    pair = '[draft]\nmodel = "d"\n[target]\nmodel = "t"\n'
    path = tmp_path / "c.toml"
    path.write_text(pair)
    assert load_config(path).cpu_wake_latency_us is None  # (off unless asked)
    path.write_text("cpu_wake_latency_us = 0\n" + pair)
    cfg = load_config(path)
    cfg.validate()
    assert cfg.cpu_wake_latency_us == 0
    for bad in ("-1", "1.5", "true", '"0"', "3000000"):
        path.write_text(f"cpu_wake_latency_us = {bad}\n" + pair)
        with pytest.raises(ConfigError, match="cpu_wake_latency_us must be a whole number of microseconds"):
            load_config(path).validate()


def test_the_request_is_the_kernels_int32_and_lasts_while_held(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    device = tmp_path / "cpu_dma_latency"  # (a plain file in the device's place: what was written, and when closed)
    device.write_bytes(b"")
    monkeypatch.setattr(wake_latency, "PM_QOS_DEVICE", str(device))
    with wake_latency.held(25) as held:
        assert held and _open_fds_on(device) == 1
        assert struct.unpack("=i", device.read_bytes()) == (25,)
    assert _open_fds_on(device) == 0  # (closing it is what ends the request)
    with wake_latency.held(None) as held:  # nothing asked: nothing opened
        assert not held and _open_fds_on(device) == 0


def test_a_host_that_refuses_is_logged_not_fatal(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.WARNING, "nebula_flow.wake_latency"), wake_latency.held(0, str(tmp_path / "none")) as held:
        assert not held
    assert "cannot ask for a CPU wake-up latency of 0 us" in caplog.text and "No such file" in caplog.text


@pytest.mark.skipif(not os.access(wake_latency.PM_QOS_DEVICE, os.W_OK), reason="no writable /dev/cpu_dma_latency here")
def test_the_kernel_applies_the_request() -> None:
    def current() -> int:  # (reading the device gives the bound in force: the least of every request held)
        with open(wake_latency.PM_QOS_DEVICE, "rb") as f:
            return struct.unpack("=i", f.read(4))[0]

    with wake_latency.held(7) as held:
        assert held and current() <= 7


def test_a_deployment_holds_the_request_while_it_runs(tiny_pair: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    monkeypatch.setattr(wake_latency, "PM_QOS_DEVICE", str(device))
    cfg = deploy_config(tiny_pair, "autoregressive", 0, 1)
    cfg.cpu_wake_latency_us = 0
    prompt = [5, 6, 7, 8]
    with Deployment(cfg) as dep, Client(dep.address) as client:
        assert _open_fds_on(device) == 1 and struct.unpack("=i", device.read_bytes()) == (0,)
        assert client.generate(token_ids=prompt, max_new_tokens=8).token_ids == hf_greedy(tiny_pair / "target", prompt, 8)
    assert _open_fds_on(device) == 0
