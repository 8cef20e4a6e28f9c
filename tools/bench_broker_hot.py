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

``--shards 1,2,4``: several brokers, each a shard of the requests, driven turn by turn in the same
thread, each shard's handlers timed apart: what sharding adds to a shard's work per round, without
the preemption of several broker processes on this machine's two cores (``bench-broker --shards``).

    PYTHONPATH=. .venv/bin/python tools/bench_broker_hot.py [--modes pooled,colocated] [--repeats 3] [--calls]
        [--capacity 32] [--shards 1,2,4]
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
from nebula_flow.shards import shard_of
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
        calls: Calls | None, capacity: int = 32, shards: int = 1) -> tuple[list[int], list[float]]:
    """One run: per shard, the request-rounds it ended and its handlers' CPU seconds. With several
    shards every zero-cost worker speaks to each over a socket of its own (as ``workers/link.py``),
    the client sends each request to the shard its id hashes to, and ``concurrency`` and
    ``requests`` are per shard (each carries the load one broker does)."""
    brokers = []
    for shard in range(shards):
        opts = BrokerOptions(mode=mode, client_port=free_port(), worker_port=free_port(),
                             model=str(ensure_tiny_pair() / "target"), policy=with_settings(PolicyConfig(), FIXED_POLICY),
                             liveness_s=60, shard=shard, shards=shards)
        brokers.append(Broker(opts))
        brokers[-1].bind()
    ctx = zmq.Context.instance()
    socks = []
    for i, role in enumerate(worker_roles(mode, workers)):
        for broker in brokers:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(broker.opts.worker_address)
            sock.send_multipart(protocol.encode(Register(role, f"zero-{i}", capacity, ZERO_FACTS, pid=os.getpid())))
            socks.append(sock)
    clients = []
    for broker in brokers:
        clients.append(ctx.socket(zmq.DEALER))
        clients[-1].connect(broker.opts.client_address)
    cpu = [0.0] * shards

    def broker_turn() -> None:
        for i, broker in enumerate(brokers):
            if calls is not None:
                sys.setprofile(calls)
            start, now = time.thread_time(), time.monotonic()
            broker.receive([broker.peers, broker.clients], now)
            broker.step(now)
            cpu[i] += time.thread_time() - start
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
    while sum(len(b.workers) for b in brokers) < len(socks):
        if time.monotonic() > deadline:
            raise RuntimeError("the zero-cost workers did not register")
        broker_turn()
        workers_turn()
    cpu[:] = [0.0] * shards
    rounds0 = [b.counters["rounds"] for b in brokers]
    if calls is not None:
        calls.reset()  # (the warm-up's calls are not the rounds')
    total, sent, done = requests * shards, 0, 0
    while done < total:
        for client in clients:
            while True:
                try:
                    done += isinstance(protocol.decode(client.recv_multipart(flags=zmq.NOBLOCK, copy=False)), Done)
                except zmq.Again:
                    break
        while sent < total and sent - done < concurrency * shards:
            req_id = f"hot-{sent}"
            clients[shard_of(req_id, shards)].send_multipart(protocol.encode(build_submit(
                req_id, None, [5, 6, 7, 8, sent % 50 + 10], False, session="s" * 32,
                max_new_tokens=max_new_tokens, ignore_eos=True)))
            sent += 1
        broker_turn()
        workers_turn()
    for sock in (*socks, *clients, *(b.clients for b in brokers), *(b.peers for b in brokers)):
        sock.close(linger=0)
    for broker in brokers:
        broker.prompts.close()
    return [b.counters["rounds"] - r0 for b, r0 in zip(brokers, rounds0)], cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="pooled,colocated")
    ap.add_argument("--workers", type=int, default=4, help="zero-cost workers per stage")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight (per shard)")
    ap.add_argument("--capacity", type=int, default=32,
                    help="each zero-cost worker's batch capacity (the broker's cost per round falls as batches grow)")
    ap.add_argument("--requests", type=int, default=256, help="requests in all (per shard)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shards", default="1", help="shard counts to measure, comma-separated (e.g. 1,2,4): each "
                    "shard carries the load one broker does, and the counts run in turn within each repeat")
    ap.add_argument("--calls", action="store_true", help="also count function calls per round (one more run)")
    args = ap.parse_args()
    counts = [int(n) for n in args.shards.split(",")]
    for mode in args.modes.split(","):
        per_round: dict[int, list[float]] = {n: [] for n in counts}
        worst: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(args.repeats):
            for n in counts:  # (side by side: this machine drifts between minutes)
                rounds, cpu = run(mode, args.workers, args.concurrency, args.requests, args.max_new_tokens, None,
                                  args.capacity, n)
                per_round[n].append(sum(cpu) / sum(rounds) * 1e6)
                worst[n].append(max(c / r for c, r in zip(cpu, rounds)) * 1e6)
        first = statistics.median(per_round[counts[0]])
        for n in counts:
            med = statistics.median(per_round[n])
            line = (f"{mode:<12} {n} shard{'s' if n > 1 else ' '} broker CPU, caches warm: {med:6.1f} us per request-round "
                    f"(median of {args.repeats}: {', '.join(f'{t:.1f}' for t in per_round[n])}"
                    + (f"; worst shard {statistics.median(worst[n]):.1f}; {med / first:.2f}x {counts[0]} shard)"
                       if n > 1 else ")"))
            if args.calls:
                calls = Calls()
                rounds, _ = run(mode, args.workers, args.concurrency, args.requests, args.max_new_tokens, calls,
                                args.capacity, n)
                line += f"; {calls.total / sum(rounds):.1f} function calls per round"
            print(line, flush=True)
            if args.calls:
                for name, count in calls.by_function.most_common(15):
                    print(f"    {count / sum(rounds):6.2f} {name}")


if __name__ == "__main__":
    main()
