"""A deployment's start on the bundled config in a given dtype and mode: seconds from spawn to every
worker registered, then two greedy requests of 40 tokens, then stop (what ``tests/test_bundled.py``'s
either-dtype test runs three times). Compare kernel probes kept and not:

    NEBULA_FLOW_PROBE_CACHE=0 PYTHONPATH=. .venv/bin/python tools/bench_start.py bfloat16 elastic
    PYTHONPATH=. .venv/bin/python tools/bench_start.py bfloat16 elastic
"""

from __future__ import annotations

import sys
import time

from nebula_flow.bundled import target_dir
from nebula_flow.client import Client
from nebula_flow.config import load_config
from nebula_flow.deploy import Deployment

PROMPTS = ["def merge_sorted(a, b):\n", "class LRUCache:\n    def __init__(self, capacity):\n"]


def main() -> None:
    dtype, mode = sys.argv[1], sys.argv[2]
    cfg = load_config("configs/default.toml")
    cfg.target.dtype = cfg.draft.dtype = dtype
    cfg.mode, cfg.target.model = mode, str(target_dir())
    cfg.broker.client_port = cfg.broker.worker_port = 0
    cfg.broker.policy = cfg.broker.policy.replace(measure_costs=False)
    t0 = time.monotonic()
    with Deployment(cfg) as dep, Client(dep.address) as client:
        t1 = time.monotonic()
        for prompt in PROMPTS:
            client.generate(prompt, max_new_tokens=40, ignore_eos=True)
        t2 = time.monotonic()
    print(f"{mode} {dtype}: start {t1 - t0:.1f} s, requests {t2 - t1:.1f} s, stop {time.monotonic() - t2:.1f} s")


if __name__ == "__main__":
    main()
