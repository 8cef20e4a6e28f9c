"""The broker's own work per request-round with its caches warm: the figure a broker that never
idles (one saturated on a big host, issue 29's case) pays, apart from this machine's cold wake-ups.

A real ``Broker`` on real sockets, with zero-cost workers (``bench_broker.answer``) and one
client in the same thread, turn by turn and never sleeping; what is timed is the broker's
handlers and its step (its thread's CPU time), so ZeroMQ's I/O thread is not in it.
``nebula-flow bench-broker`` measures the broker process as deployed (every thread, every wake-up):
on a 2-core virtual machine a broker that waits between messages runs its code cold, several
times slower (``tools/bench_codec.py --idle-ms 20``), so both figures are worth having.
``--calls`` also counts the Python and C function calls the broker makes per round (a
deterministic measure of its work, where this machine's timings wander by tens of percent).

    PYTHONPATH=. .venv/bin/python tools/bench_broker_hot.py [--modes pooled,colocated] [--repeats 3] [--calls] [--capacity 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

import zmq

from nebula_flow import protocol
from nebula_flow.bench_broker import FIXED_POLICY, ZERO_FACTS, answer, worker_roles
from nebula_flow.cli.common import ensure_tiny_pair, with_settings
from nebula_flow.client import build_submit
from nebula_flow.deploy import free_port
from nebula_flow.options import BrokerOptions
from nebula_flow.policy import PolicyConfig
from nebula_flow.protocol import Done, Pull, Register, Result, Tasks, Welcome
from nebula_flow_broker.server import Broker


class Calls:
    """Counts function calls (Python and C) while on, by function."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total, self.by_function = 0, Counter()

    def __call__(self, frame, event: str, arg) -> None:  # noqa: ANN001
        if event == "call":
            self.total += 1
            self.by_function[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            self.total += 1
            self.by_function[f"C {getattr(arg, '__qualname__', arg)}"] += 1


def run(mode: str, workers: int, concurrency: int, requests: int, max_new_tokens: int,
        calls: Calls | None, capacity: int = 32) -> tuple[int, float]:
    """One run: the request-rounds the broker ended and its thread's CPU seconds in its handlers."""
    opts = BrokerOptions(mode=mode, client_port=free_port(), worker_port=free_port(), model=str(ensure_tiny_pair() / "target"),
                         policy=with_settings(PolicyConfig(), FIXED_POLICY), liveness_s=60)
    broker = Broker(opts)
    broker.bind()
    ctx = zmq.Context.instance()
    socks = []
    for i, role in enumerate(worker_roles(mode, workers)):
        sock = ctx.socket(zmq.DEALER)
        sock.connect(opts.worker_address)
        sock.send_multipart(protocol.encode(Register(role, f"zero-{i}", capacity, ZERO_FACTS, pid=os.getpid())))
        socks.append(sock)
    client = ctx.socket(zmq.DEALER)
    client.connect(opts.client_address)
    cpu = 0.0

    def broker_turn() -> None:
        nonlocal cpu
        if calls is not None:
            sys.setprofile(calls)
        start, now = time.thread_time(), time.monotonic()
        broker.receive([broker.peers, broker.clients], now)
        broker.step(now)
        cpu += time.thread_time() - start
        sys.setprofile(None)

    def workers_turn() -> None:
        for sock in socks:
            while True:
                try:
                    msg = protocol.decode(sock.recv_multipart(flags=zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
                if isinstance(msg, Tasks):
                    sock.send_multipart(protocol.encode(Result([answer(t) for t in msg.tasks])))
                if isinstance(msg, Welcome | Tasks):
                    sock.send_multipart(protocol.encode(Pull(capacity, True)))

    deadline = time.monotonic() + 10
    while len(broker.workers) < len(socks):
        if time.monotonic() > deadline:
            raise RuntimeError("the zero-cost workers did not register")
        broker_turn()
        workers_turn()
    cpu, rounds0, sent, done = 0.0, broker.counters["rounds"], 0, 0
    if calls is not None:
        calls.reset()  # (the warm-up's calls are not the rounds')
    while done < requests:
        while True:
            try:
                done += isinstance(protocol.decode(client.recv_multipart(flags=zmq.NOBLOCK, copy=False)), Done)
            except zmq.Again:
                break
        while sent < requests and sent - done < concurrency:
            client.send_multipart(protocol.encode(build_submit(
                f"hot-{sent}", None, [5, 6, 7, 8, sent % 50 + 10], False, session="s" * 32,
                max_new_tokens=max_new_tokens, ignore_eos=True)))
            sent += 1
        broker_turn()
        workers_turn()
    for sock in (*socks, client, broker.clients, broker.peers):
        sock.close(linger=0)
    broker.prompts.close()
    return broker.counters["rounds"] - rounds0, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="pooled,colocated")
    ap.add_argument("--workers", type=int, default=4, help="zero-cost workers per stage")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=32,
                    help="each zero-cost worker's batch capacity (the broker's cost per round falls as batches grow)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", action="store_true", help="also count function calls per round (one more run)")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        per_round = []
        for _ in range(args.repeats):
            rounds, cpu = run(mode, args.workers, args.concurrency, args.requests, args.max_new_tokens, None, args.capacity)
            per_round.append(cpu / rounds * 1e6)
        line = (f"{mode:<12} broker CPU, caches warm: {statistics.median(per_round):6.1f} us per request-round "
                f"(median of {args.repeats}: {', '.join(f'{t:.1f}' for t in per_round)})")
        if args.calls:
            calls = Calls()
            rounds, _ = run(mode, args.workers, args.concurrency, args.requests, args.max_new_tokens, calls, args.capacity)
            line += f"; {calls.total / rounds:.1f} function calls per round"
        print(line, flush=True)
        if args.calls:
            for name, n in calls.by_function.most_common(15):
                print(f"    {n / rounds:6.2f} {name}")


if __name__ == "__main__":
    main()
