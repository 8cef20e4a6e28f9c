"""KV rows a model's arena holds per position its caches hold, on a trace's lengths.

Every request of the trace's first ``--requests`` gets a cache, all alive at once, made as
``KVStore`` makes one (room for its prompt and a quarter) and grown to its prompt plus its output
(``KVCache.reserve``). What it prints depends only on the allocator and the lengths (no timing).

    PYTHONPATH=. .venv/bin/python tools/kv_rows.py [--trace ../shared/traces/AzureLLMInferenceTrace_code.csv] [--requests 512]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from nebula_flow.kv.arena import KVArena
from nebula_flow.kv.cache import KVCache
from nebula_flow.kv.store import first_capacity

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"))
    ap.add_argument("--requests", type=int, default=512)
    args = ap.parse_args()
    with open(args.trace, newline="") as f:
        lengths = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)][:args.requests]
    arena = KVArena((1, 2, 1, 4), torch.float16, "cpu", chunk_bytes=1 << 30)  # (a row's shape does not matter here)
    caches, held = [], 0
    for prompt, out in lengths:
        cache = KVCache(1, 1, 4, dtype=torch.float16, capacity=first_capacity(prompt), arena=arena)
        cache.reserve(prompt + out)
        caches.append(cache)
        held += prompt + out
    print(f"{len(caches)} requests, {held} positions held, {arena.leased_rows} rows leased: "
          f"{arena.leased_rows / held:.3f} rows per position")


if __name__ == "__main__":
    main()
