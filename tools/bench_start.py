"""A deployment's start on the bundled config in a given dtype and mode: seconds from spawn to every
worker registered, then two greedy requests of 40 tokens, then stop (what ``tests/test_bundled.py``'s
either-dtype test runs three times). With ``--restarts N``: then N times, SIGKILL a target worker and
time the supervisor's restart of it (``Deployment.supervise`` as ``serve`` runs it, no backoff) until the
broker lists it registered under its new pid. Compare kernel probes kept and not:

    NEBULA_FLOW_PROBE_CACHE=0 PYTHONPATH=. .venv/bin/python tools/bench_start.py bfloat16 elastic
    PYTHONPATH=. .venv/bin/python tools/bench_start.py bfloat16 elastic [--restarts 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

from nebula_flow.bundled import target_dir
from nebula_flow.client import Client
from nebula_flow.config import load_config
from nebula_flow.deploy import Deployment

PROMPTS = ["def merge_sorted(a, b):\n", "class LRUCache:\n    def __init__(self, capacity):\n"]


def restart_seconds(dep: Deployment, client: Client) -> float:
    """Kill a target worker (of an elastic deployment: any worker); seconds until its successor registered."""
    name, proc = next((n, p) for n, p in dep.procs if n.startswith(("target", "any", "colocated")))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t = time.monotonic()
    while True:
        dep.supervise()
        new = dict(dep.procs)[name]
        if new.pid != proc.pid and any(w.get("pid") == new.pid for w in client.status()["workers"]):
            return time.monotonic() - t
        time.sleep(0.02)  # (polling the broker's status: the time measured, not a synchronisation)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dtype", choices=["bfloat16", "float32"])
    ap.add_argument("mode")
    ap.add_argument("--restarts", type=int, default=0, help="worker kills to time the supervisor's restart of")
    args = ap.parse_args()
    cfg = load_config("configs/default.toml")
    cfg.target.dtype = cfg.draft.dtype = args.dtype
    cfg.mode, cfg.target.model = args.mode, str(target_dir())
    cfg.broker.client_port = cfg.broker.worker_port = 0
    cfg.broker.policy = cfg.broker.policy.replace(measure_costs=False)
    cfg.supervise.backoff_s = 0.0  # (only the restart itself is timed)
    t0 = time.monotonic()
    with Deployment(cfg) as dep, Client(dep.address) as client:
        t1 = time.monotonic()
        for prompt in PROMPTS:
            client.generate(prompt, max_new_tokens=40, ignore_eos=True)
        t2 = time.monotonic()
        restarts = [restart_seconds(dep, client) for _ in range(args.restarts)]
        t3 = time.monotonic()
    line = f"{args.mode} {args.dtype}: start {t1 - t0:.1f} s, requests {t2 - t1:.1f} s, stop {time.monotonic() - t3:.1f} s"
    if restarts:
        line += f", worker restarts {' '.join(f'{s:.2f}' for s in restarts)} s (median {statistics.median(restarts):.2f})"
    print(line)


if __name__ == "__main__":
    main()
