"""KV rows a model's arena holds per position its caches hold, on a trace's lengths.

Every request of the trace's first ``--requests`` gets a cache, all alive at once, made as
``KVStore`` makes one (room for its prompt and a quarter) and grown to its prompt plus its output
(``KVCache.reserve``). What it prints depends only on the allocator and the lengths (no timing).

``--churn STEPS``: instead, ``--live`` requests alive at a time in an arena whose first chunk holds
``--budget`` times their positions; each step a request of the trace arrives (its prompt's cache),
half the steps a random live one grows to its prompt plus its output, and a random one leaves.
Prints the most memory the arena took (its first chunk, and the extra chunks a full or fragmented
one adds) and the median rows per position held. Seeded: the same every run.

    PYTHONPATH=. .venv/bin/python tools/kv_rows.py [--trace ../shared/traces/AzureLLMInferenceTrace_code.csv]
        [--requests 512] [--churn 20000 --live 300 --budget 1.5]
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

import torch

from nebula_flow.kv.arena import KVArena
from nebula_flow.kv.cache import KVCache
from nebula_flow.kv.store import first_capacity

REPO = Path(__file__).resolve().parent.parent
ROW = (1, 2, 1, 4)  # (a row's shape does not matter here: 16 bytes in fp16)


def _cache(arena: KVArena, prompt: int) -> KVCache:
    """A request's cache as the store makes it, holding its prompt."""
    cache = KVCache(ROW[0], ROW[2], ROW[3], dtype=torch.float16, capacity=first_capacity(prompt), arena=arena)
    cache.tokens = [0] * prompt
    return cache


def all_alive(lengths: list[tuple[int, int]]) -> str:
    arena = KVArena(ROW, torch.float16, "cpu", chunk_bytes=1 << 30)
    caches, held = [], 0
    for prompt, out in lengths:
        cache = _cache(arena, prompt)
        cache.reserve(prompt + out)
        caches.append(cache)
        held += prompt + out
    return (f"{len(caches)} requests, {held} positions held, {arena.leased_rows} rows leased: "
            f"{arena.leased_rows / held:.3f} rows per position")


def churn(lengths: list[tuple[int, int]], steps: int, live_n: int, budget: float) -> str:
    rnd = random.Random(1)
    budget_rows = int(sum(p + o for p, o in lengths[:live_n]) * budget)
    arena = KVArena(ROW, torch.float16, "cpu", chunk_bytes=budget_rows * 16)
    live: list[tuple[KVCache, int]] = []
    peak, ratios = 0, []
    for step in range(steps):
        prompt, out = lengths[step % len(lengths)]
        live.append((_cache(arena, prompt), prompt + out))
        if rnd.random() < 0.5:
            cache, full = live[rnd.randrange(len(live))]
            cache.reserve(full)
            cache.tokens = [0] * full
        if len(live) > live_n:
            live.pop(rnd.randrange(len(live)))[0].release()
        peak = max(peak, sum(c.buf.shape[0] for c in arena.chunks if c is not None))
        if step % 100 == 0:
            ratios.append(arena.leased_rows / sum(len(c.tokens) for c, _ in live))
    return (f"{steps} arrivals, {live_n} alive, first chunk {budget_rows} rows ({budget:g}x the first {live_n}'s "
            f"positions): the arena took at most {peak} rows ({peak / budget_rows:.2f}x its first chunk); "
            f"median {sorted(ratios)[len(ratios) // 2]:.3f} rows per position held")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"))
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--churn", type=int, default=0, metavar="STEPS")
    ap.add_argument("--live", type=int, default=300)
    ap.add_argument("--budget", type=float, default=1.5)
    args = ap.parse_args()
    with open(args.trace, newline="") as f:
        lengths = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    print(churn(lengths, args.churn, args.live, args.budget) if args.churn else all_alive(lengths[:args.requests]))


if __name__ == "__main__":
    main()
