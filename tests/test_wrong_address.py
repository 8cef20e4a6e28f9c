"""A process given the broker's other address is told which one it wants, at once. A worker started
with the client port logged "REGISTER is not a client message", then "HEARTBEAT is not a client
message" every second, for ever; a client at the worker port got "unknown_worker: register first"
for a request, and `status` (and a gateway's /health) waited out its timeout."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq
from click.testing import CliRunner

from nebula_flow.broker_link import Link
from nebula_flow.cli import main
from nebula_flow.client import AsyncClient, Client, RequestError
from nebula_flow.deploy import Deployment, free_port
from tests.conftest import deploy_config, gateway_health


@pytest.fixture(scope="module")
def dep(tiny_pair):  # noqa: ANN001, ANN201
    with Deployment(deploy_config(tiny_pair, "colocated", 0, 1)) as d:
        d.start_api("127.0.0.1", 0, model_name="tiny")
        yield d


def test_a_client_at_the_worker_address_is_told_the_client_address(dep) -> None:  # noqa: ANN001
    workers_at, told = dep.shards[0].worker_address, f"clients connect to its client address, {dep.address}"
    started = time.monotonic()
    with Client(workers_at, timeout_s=30) as c:
        for ask in (lambda: c.generate("def f(x):", max_new_tokens=4), c.status):
            with pytest.raises(RequestError, match=told) as err:
                ask()
            assert err.value.code == "wrong_address"

    async def through_asyncio() -> None:
        c = AsyncClient(workers_at, timeout_s=30)
        try:
            for ask in (lambda: c.generate("def f(x):", max_new_tokens=4), c.status):
                with pytest.raises(RequestError, match=told):
                    await ask()
        finally:
            await c.close()

    asyncio.run(through_asyncio())
    assert time.monotonic() - started < 15  # (answered, not waited out: each timeout is 30 s)
    with Client(dep.address) as c:  # (and the broker serves on)
        assert len(c.generate("def f(x):", max_new_tokens=4, ignore_eos=True).token_ids) == 4


def test_a_worker_at_the_client_address_stops_saying_so(dep, tiny_pair) -> None:  # noqa: ANN001
    res = subprocess.run([sys.executable, "-m", "nebula_flow.cli", "worker", "--broker", dep.address, "--role", "target",
                          "--model", str(tiny_pair / "target"), "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert f"workers connect to its worker address, {dep.shards[0].worker_address}" in res.stderr
    assert "HEARTBEAT" not in res.stderr


def test_the_cli_at_the_http_apis_port_says_it_is_no_broker(dep) -> None:  # noqa: ANN001
    """It waited 10 s (generate) or 5 s (status) and said nothing reached or answered."""
    http_port = dep.http_url.rsplit(":", 1)[1]
    for args in (["generate", "hi"], ["status"]):
        started = time.monotonic()
        res = CliRunner().invoke(main, [*args, "--broker", f"tcp://127.0.0.1:{http_port}"])
        assert res.exit_code == 1 and "its ZeroMQ handshake failed: " in res.output
        assert "(an HTTP port, such as the HTTP API's? HTTP clients go there)" in res.output
        assert time.monotonic() - started < 4, res.output  # (told at the first handshake, not after the wait)
    res = CliRunner().invoke(main, ["status", "--broker", f"tcp://127.0.0.1:{http_port}", "--ready"])
    assert res.exit_code == 1


def test_a_handshake_that_succeeds_later_clears_the_refusal() -> None:
    """ZeroMQ retries a failed handshake: once one succeeds (the broker restarted with the keys this
    client has, say), nothing is refused any more."""
    def event(kind: int) -> list[bytes]:
        return [struct.pack("=HI", kind, 0), b"tcp://127.0.0.1:1"]

    link = Link()
    assert link.event(event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)) is False
    assert link.refused == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not link.up
    link.event(event(zmq.EVENT_DISCONNECTED))
    assert link.event(event(zmq.EVENT_HANDSHAKE_SUCCEEDED)) is True  # (made again: what is in flight goes again)
    assert link.up and link.refused is None


def _first_reconnect(broker: str, tiny_pair: Path) -> str:
    """The line a worker pointed at ``broker`` logs when it first reconnects (after ~10 s of silence)."""
    worker = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "worker", "--broker", broker,
                               "--role", "target", "--model", str(tiny_pair / "target"), "--threads", "1"],
                              stderr=subprocess.PIPE, text=True)
    try:
        return next(line for line in worker.stderr if "no word from the broker" in line)
    finally:
        worker.kill()
        worker.wait(30)


def test_a_worker_at_an_http_port_says_why_it_hears_nothing(dep, tiny_pair) -> None:  # noqa: ANN001
    """It logged "no word from the broker ... reconnecting" every time, the same whatever was there."""
    line = _first_reconnect(f"tcp://127.0.0.1:{dep.http_url.rsplit(':', 1)[1]}", tiny_pair)
    assert "(it answers, but its ZeroMQ handshake failed: a broker that uses CURVE keys (give the worker its key " \
           "folder" in line and "an HTTP port, such as the HTTP API's?" in line, line


def test_a_worker_where_nothing_listens_says_so(tiny_pair) -> None:  # noqa: ANN001
    """A worker started before its broker, or given a wrong port, logged only "no word from the
    broker ... reconnecting": the same words as for a broker that went silent."""
    line = _first_reconnect(f"tcp://127.0.0.1:{free_port()}", tiny_pair)
    assert "(nothing accepts connections there: no broker runs at that address yet" in line, line


def test_a_gateway_whose_broker_is_not_there_answers_its_probes_at_once() -> None:
    """/health asked the broker and waited 5 s for nothing, each time: longer than a load balancer's probe waits."""
    nobody = f"tcp://127.0.0.1:{free_port()}"
    with gateway_health(nobody) as (port, first):
        assert first.status_code == 503
        started = time.monotonic()
        res = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert time.monotonic() - started < 2 and res.status_code == 503
        assert f"{nobody}: not connected for " in res.json()["error"]["message"]
