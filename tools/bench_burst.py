"""Questions on a new document that arrive while the first still runs: a first request with a
``--prompt-tokens`` document (random token ids, new each repeat), then ``--later`` more on the same
document, sent once the first has streamed its first tokens. Printed: the later requests' median
time to first token and the prompt tokens each found cached (the prefix cache, on the worker or
pulled from a peer's KV of the running first request).

    nebula-flow serve --port 47300 &   # (any deployment; its prefix cache on, as by default)
    PYTHONPATH=. .venv/bin/python tools/bench_burst.py tcp://127.0.0.1:47300 [--repeats 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from nebula_flow.client import AsyncClient


async def burst(address: str, seed: int, prompt_tokens: int, later: int) -> list[tuple[float, int]]:
    doc = np.random.default_rng(seed).integers(1000, 30000, prompt_tokens).tolist()
    async with AsyncClient(address) as client:
        async def ask(question: list[int]) -> tuple[float, int]:
            start, first, last = time.monotonic(), None, None
            async for item in client.stream(token_ids=doc + question, max_new_tokens=32, ignore_eos=True):
                first, last = first if first is not None else time.monotonic() - start, item
            return first, last.stats["cached_tokens"]  # (the last item: the completion)

        asked: list[asyncio.Task] = []
        async for _ in client.stream(token_ids=doc + [5, 6, 7], max_new_tokens=64, ignore_eos=True):
            if not asked:  # (the first's first tokens are out)
                asked = [asyncio.create_task(ask([8 + i, 9, 10])) for i in range(later)]
        return list(await asyncio.gather(*asked))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="the broker's client address")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--later", type=int, default=2, help="requests sent once the first has streamed")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    got = [r for seed in range(args.repeats) for r in asyncio.run(burst(args.address, seed, args.prompt_tokens, args.later))]
    print(f"later requests: TTFT median {statistics.median(t for t, _ in got) * 1e3:.0f} ms, "
          f"prompt tokens cached {[c for _, c in got]} (of {args.prompt_tokens + 3})")


if __name__ == "__main__":
    main()
