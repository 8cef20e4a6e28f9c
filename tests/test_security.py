"""CURVE: off loopback only with keys; without an authorised key nobody connects."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import zmq

from nebula_flow import protocol
from nebula_flow.client import Client, RequestTimeout
from nebula_flow.deploy import Deployment
from nebula_flow.protocol import KvPull, Register
from nebula_flow.security import generate_keys, is_loopback
from tests.conftest import deploy_config


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.4.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example")


def test_broker_refuses_to_bind_off_loopback_without_keys(tiny_pair) -> None:  # noqa: ANN001
    res = subprocess.run([sys.executable, "-m", "nebula_flow.cli", "broker", "--host", "0.0.0.0", "--client-port", "0",
                          "--worker-port", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "requires CURVE keys" in res.stderr


@pytest.mark.slow
def test_only_authorised_keys_connect(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    keys = generate_keys(tmp_path / "keys")
    stranger = generate_keys(tmp_path / "stranger")  # valid keys, but not authorised by this broker
    shutil.copy(keys / "broker.key", stranger / "broker.key")  # it even knows the broker's public key
    monkeypatch.delenv("NEBULA_FLOW_KEYS", raising=False)
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.broker.keys = str(keys)
    cfg.kv_transport = "zmq"
    with Deployment(cfg) as dep:  # the workers joined with the worker key
        with Client(dep.address, keys=str(keys)) as c:
            assert len(c.generate(token_ids=[1, 2], max_new_tokens=5, ignore_eos=True).token_ids) == 5
            state = c.status()
        for folder in (None, str(stranger)):  # no CURVE at all, or an unknown key
            with Client(dep.address, timeout_s=1.5, keys=folder) as c, pytest.raises(RequestTimeout):
                c.generate(token_ids=[1, 2], max_new_tokens=5)
        sock = zmq.Context.instance().socket(zmq.DEALER)  # a worker without keys cannot register
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(dep.cfg.broker.worker_address)
        sock.send_multipart(protocol.encode(Register("draft", "intruder", 1, {})))
        assert not sock.poll(1500)
        sock.close()
        kv = next(w["kv_endpoint"] for w in state["workers"] if w["role"] == "target")
        kv_sock = zmq.Context.instance().socket(zmq.DEALER)  # nor read a worker's KV
        kv_sock.setsockopt(zmq.LINGER, 0)
        kv_sock.connect(kv)
        kv_sock.send_multipart(protocol.encode(KvPull(1, [[1, "target", 0, 1]])))
        assert not kv_sock.poll(1500)
        kv_sock.close()
        with Client(dep.address, keys=str(keys)) as c:
            assert len(c.status()["workers"]) == 2
