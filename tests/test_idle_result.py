"""A RESULT that leaves its worker with nothing to do says so (``Result.idle``): the broker then
counts the PULL the worker parked while computing as an idle worker's, and the worker sends no
second PULL to say it went idle (one PULL a batch at light load instead of two)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from nebula_flow import protocol
from nebula_flow.bench_broker import FIXED_POLICY, ZERO_FACTS, answer
from nebula_flow.cli.common import with_settings
from nebula_flow.client import Client, build_submit
from nebula_flow.deploy import Deployment, free_port
from nebula_flow.options import BrokerOptions
from nebula_flow.policy import PolicyConfig
from nebula_flow.protocol import Pull, Register, Result, Tasks, Welcome
from nebula_flow_broker.server import Broker
from tests.conftest import deploy_config, hf_greedy


def _received(sock: zmq.Socket, broker: Broker, kind: type, timeout_s: float = 10.0):  # noqa: ANN202
    """Turn the broker's loop until ``sock`` receives a ``kind`` message; returns it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = time.monotonic()
        broker.receive([broker.peers, broker.clients], now)
        broker.step(now)
        if sock.poll(10):
            msg = protocol.decode(sock.recv_multipart(copy=False))
            if isinstance(msg, kind):
                return msg
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s")


def _turn_until(broker: Broker, done, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    """Turn the broker's loop until ``done()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the broker did not get there in time"
        now = time.monotonic()
        broker.receive([broker.peers, broker.clients], now)
        broker.step(now)
        zmq.select([broker.peers], [], [], 0.01)  # (wait for its next message, or 10 ms)


@contextlib.contextmanager
def stand_ins(tiny_pair: Path, **options: object) -> Iterator[tuple[Broker, dict[str, zmq.Socket]]]:
    """A real pooled broker on free ports (rounds of a fixed shape), turned by the test itself, and
    sockets by name: a stand-in draft and target worker, registered, each with an idle PULL of 4
    sent, and a client; all closed afterwards."""
    broker = Broker(BrokerOptions(mode="pooled", client_port=free_port(), worker_port=free_port(),
                                  model=str(tiny_pair / "target"), policy=with_settings(PolicyConfig(), FIXED_POLICY),
                                  liveness_s=60, **options))
    broker.bind()
    ctx, socks = zmq.Context.instance(), {}
    try:
        for role in ("draft", "target"):
            sock = socks[role] = ctx.socket(zmq.DEALER)
            sock.connect(broker.opts.worker_address)
            sock.send_multipart(protocol.encode(Register(role, f"{role}-0", 4, ZERO_FACTS, pid=os.getpid())))
            _received(sock, broker, Welcome)
            sock.send_multipart(protocol.encode(Pull(4, True)))
        socks["client"] = ctx.socket(zmq.DEALER)
        socks["client"].connect(broker.opts.client_address)
        yield broker, socks
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        broker.clients.close(linger=0)
        broker.peers.close(linger=0)
        broker.prompts.close()


@pytest.mark.parametrize("idle", [True, False])
def test_an_idle_result_makes_the_parked_pull_an_idle_workers(tiny_pair: Path, idle: bool) -> None:
    with stand_ins(tiny_pair) as (broker, socks):
        client = socks["client"]
        client.send_multipart(protocol.encode(build_submit("r", None, [5, 6, 7], False, max_new_tokens=16,
                                                           ignore_eos=True)))
        draft = socks["draft"]
        tasks = _received(draft, broker, Tasks)
        state = next(s for s in broker.scheduler.workers.values() if s.role == "draft")
        assert state.pull_credits == 0  # (its PULL brought the task)
        draft.send_multipart(protocol.encode(Pull(4, False)))  # parked while it computes, as a worker does
        _turn_until(broker, lambda: state.pull_credits == 4)
        assert not state.pull_idle
        draft.send_multipart(protocol.encode(Result([answer(t) for t in tasks.tasks], idle=idle)))
        _received(socks["target"], broker, Tasks)  # (the draft's result handled: its verify went out)
        assert state.pull_idle is idle and state.pull_credits == 4  # (told idle: its parked PULL is an idle worker's)


def test_a_worker_at_light_load_sends_one_pull_a_batch(tiny_pair: Path) -> None:
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    prompt, n = [5, 6, 7, 8], 24
    with Deployment(cfg) as dep, Client(dep.address) as client:
        before = client.status()
        out = client.generate(token_ids=prompt, max_new_tokens=n)
        after = client.status()
    assert out.token_ids == hf_greedy(tiny_pair / "target", prompt, n)
    pulls = after["counters"].get("pulls", 0) - before["counters"].get("pulls", 0)
    batches = out.rounds * 2  # (a draft and a verify a round, one at a time)
    # Each batch parks one PULL as it starts (the last ones, as the request ends, may not); its
    # RESULT then says the worker went idle. Before Result.idle every batch cost two (a busy one,
    # then an idle one): ~2 * batches.
    assert batches - 2 <= pulls <= batches + 2, (pulls, batches)
