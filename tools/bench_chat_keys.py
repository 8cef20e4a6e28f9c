"""Chats on a sharded deployment, with and without a ``prompt_cache_key`` per conversation: each
repeat runs ``--chats`` conversations at once, each ``--turns`` turns of token ids (a new
``--prompt-tokens`` document first, then the answers so far and a short question each turn), once
with one key per conversation (its turns go to one shard: ``shards.route``) and once by request
id alone, in turns. Printed per side: the later turns' median time to first token and the share
of their prompt tokens found cached (the prefix cache, on the worker or pulled from a peer), and
the ratio of the medians.

    nebula-flow serve --port 47300 --shards 2 &    # (prints the shards' addresses, comma-separated)
    PYTHONPATH=. .venv/bin/python tools/bench_chat_keys.py tcp://127.0.0.1:47300,tcp://127.0.0.1:47302 [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from nebula_flow.client import AsyncClient


async def chats(address: str, seed: int, n: int, turns: int, prompt_tokens: int, keyed: bool) -> list[tuple[float, float]]:
    """Each later turn's (TTFT seconds, share of its prompt cached)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1000, 30000, prompt_tokens).tolist() for _ in range(n)]
    async with AsyncClient(address) as client:
        async def chat(i: int) -> list[tuple[float, float]]:
            prompt, got = docs[i] + [5, 6, 7], []
            for turn in range(turns):
                start, first, last = time.monotonic(), None, None
                key = {"prompt_cache_key": f"chat-{seed}-{i}"} if keyed else {}
                async for item in client.stream(token_ids=prompt, max_new_tokens=16, ignore_eos=True, **key):
                    first, last = first if first is not None else time.monotonic() - start, item
                if turn:
                    got.append((first, last.stats["cached_tokens"] / len(prompt)))
                prompt = prompt + last.token_ids + [8 + turn, 9, 10]
            return got
        return [x for one in await asyncio.gather(*(chat(i) for i in range(n))) for x in one]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="the shards' client addresses, comma-separated")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="the first repeat's documents (each repeat and side new ones)")
    args = ap.parse_args()
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(args.repeats):
        for keyed in (True, False) if r % 2 == 0 else (False, True):  # (in turns: a noisy machine's drift falls on both)
            seed = args.seed + 2 * r + keyed
            got[keyed] += asyncio.run(chats(args.address, seed, args.chats, args.turns, args.prompt_tokens, keyed))
    ttft = {k: statistics.median(t for t, _ in v) for k, v in got.items()}
    for keyed, name in ((True, "prompt_cache_key per chat"), (False, "by request id")):
        cached = statistics.mean(c for _, c in got[keyed])
        print(f"{name:>26}: later turns' TTFT median {ttft[keyed] * 1e3:.0f} ms, prompt cached {cached * 100:.0f}% "
              f"(mean of {len(got[keyed])} turns)")
    print(f"TTFT, keys / ids: {ttft[True] / ttft[False]:.2f}x")


if __name__ == "__main__":
    main()
