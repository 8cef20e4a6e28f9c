"""What binding requests to workers costs the broker's policy under a backlog (colocated mode: the
same code binds paired and elastic requests): a worker registering while N requests wait unbound,
then N more requests admitted into the pool of N. Run it from two checkouts to compare them.

    PYTHONPATH=. .venv/bin/python tools/bench_binding.py [--requests 20000]
"""

from __future__ import annotations

import argparse
import time

from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.request import Request
from nebula_flow.scheduler import Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    n = parser.parse_args().requests
    s = Scheduler("colocated", PolicyConfig(k=2))
    for rid in range(n):
        s.admit(Request(rid, str(rid), [1, 2, 3], SamplingParams(max_new_tokens=16), seed=rid))
    t = time.perf_counter()
    s.register(1, "colocated", 8)
    registered = time.perf_counter() - t
    s.register(2, "colocated", 8)
    t = time.perf_counter()
    for rid in range(n, 2 * n):
        s.admit(Request(rid, str(rid), [1, 2, 3], SamplingParams(max_new_tokens=16), seed=rid))
    admitted = time.perf_counter() - t
    print(f"a worker registering under {n:,} unbound requests: {registered:.3f} s; "
          f"{n:,} more admitted into that pool: {admitted:.2f} s ({admitted / n * 1e6:.0f} us each)")


if __name__ == "__main__":
    main()
