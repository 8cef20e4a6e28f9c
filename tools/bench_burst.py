"""Questions on a new document that arrive while the first still runs: a first request with a
``--prompt-tokens`` document (random token ids, new each repeat), then ``--later`` more on the same
document, sent once the first has streamed its first tokens. Printed: the later requests' median
time to first token and the prompt tokens each found cached (the prefix cache, on the worker or
pulled from a peer's KV of the running first request). ``--together``: all of them sent at once
(a burst on a new document, n choices of one prompt: the broker's ``wait_for_prefix``); printed too,
the median time until the last of a burst ends.

    nebula-flow serve --port 47300 [--set wait_for_prefix=0] &   # (any deployment; prefix cache on, as by default)
    PYTHONPATH=. .venv/bin/python tools/bench_burst.py tcp://127.0.0.1:47300 [--repeats 4] [--together]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from nebula_flow.client import AsyncClient


async def burst(address: str, seed: int, prompt_tokens: int, later: int, together: bool) -> tuple[list[tuple[float, int]], float]:
    """The later requests' (or, ``together``, all requests') TTFT and cached prompt tokens, and the burst's seconds."""
    doc = np.random.default_rng(seed).integers(1000, 30000, prompt_tokens).tolist()
    async with AsyncClient(address) as client:
        async def ask(question: list[int]) -> tuple[float, int]:
            start, first, last = time.monotonic(), None, None
            async for item in client.stream(token_ids=doc + question, max_new_tokens=32, ignore_eos=True):
                first, last = first if first is not None else time.monotonic() - start, item
            return first, last.stats["cached_tokens"]  # (the last item: the completion)

        start = time.monotonic()
        if together:
            got = await asyncio.gather(ask([5, 6, 7]), *(ask([8 + i, 9, 10]) for i in range(later)))
            return list(got), time.monotonic() - start
        asked: list[asyncio.Task] = []
        async for _ in client.stream(token_ids=doc + [5, 6, 7], max_new_tokens=64, ignore_eos=True):
            if not asked:  # (the first's first tokens are out)
                asked = [asyncio.create_task(ask([8 + i, 9, 10])) for i in range(later)]
        return list(await asyncio.gather(*asked)), time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="the broker's client address")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--later", type=int, default=2, help="requests sent once the first has streamed")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--together", action="store_true", help="send the first and the later requests at once")
    ap.add_argument("--seed", type=int, default=0, help="the first repeat's document (each repeat a new one)")
    args = ap.parse_args()
    runs = [asyncio.run(burst(args.address, args.seed + r, args.prompt_tokens, args.later, args.together))
            for r in range(args.repeats)]
    got = [r for requests, _ in runs for r in requests]
    print(f"{'all' if args.together else 'later'} requests: TTFT median {statistics.median(t for t, _ in got) * 1e3:.0f} ms, "
          f"burst median {statistics.median(s for _, s in runs):.2f} s, "
          f"prompt tokens cached {[c for _, c in got]} (of {args.prompt_tokens + 3})")


if __name__ == "__main__":
    main()
