"""How long a long prompt's tokenization holds up the requests already running (issue 29).

A broker (the tiny pair's tokenizer) under zero-cost workers streams 8 requests; meanwhile a
client submits prompts of ``--chars`` characters (refused once tokenized: longer than the tiny
context, which is fine: the tokenizing is the cost measured). Printed: the longest gap between two
chunks of the running streams, and the same without long prompts, medians over ``--repeats``.

    .venv/bin/python tools/bench_long_prompt.py [--tree DIR]

``--tree``: run the broker from another checkout (e.g. a ``git worktree`` of an older commit) for
a before/after in one sitting; the load generator is this checkout's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import zmq.asyncio

from nebula_flow.bench_broker import FIXED_POLICY, start_broker, zero_worker
from nebula_flow.cli.common import ensure_tiny_pair
from nebula_flow.client import AsyncClient, Chunk, RequestError
from nebula_flow.deploy import free_port


async def _run(address: str, workers: str, chars: int, long_prompts: int) -> float:
    ctx, stop = zmq.asyncio.Context.instance(), asyncio.Event()
    pool = [asyncio.ensure_future(zero_worker(ctx, workers, role, f"zero-{role}", 8, stop)) for role in ("draft", "target")]
    async with AsyncClient(address, timeout_s=60) as client:
        while len((await client.status())["workers"]) < 2:
            await asyncio.sleep(0.05)
        gaps: list[float] = []

        async def stream(i: int) -> None:
            last = None
            async for item in client.stream(token_ids=[5, 6, 7, i], max_new_tokens=900, ignore_eos=True):
                now = time.perf_counter()
                if isinstance(item, Chunk) and last is not None:
                    gaps.append(now - last)
                last = now

        async def long_ones() -> None:
            for _ in range(long_prompts):
                await asyncio.sleep(0.2)
                try:
                    await client.generate("return " * (chars // 7), max_new_tokens=1)
                except RequestError:
                    pass  # (too long for the tiny context: refused once tokenized)

        await asyncio.gather(*(stream(i) for i in range(8)), long_ones())
    stop.set()
    await asyncio.gather(*pool)
    return max(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", help="run the broker from this checkout instead of this one")
    ap.add_argument("--chars", type=int, default=600_000)
    ap.add_argument("--repeats", type=int, default=3)
    opts = ap.parse_args()
    model = str(ensure_tiny_pair() / "target")
    env = dict(os.environ, PYTHONPATH=opts.tree) if opts.tree else None
    out = {}
    for long_prompts in (0, 3):
        worst = []
        for _ in range(opts.repeats):
            cport, wport = free_port(), free_port()
            args = ["--model", model, "--client-port", str(cport), "--worker-port", str(wport), "--k", "4",
                    *(f"--set={s}" for s in FIXED_POLICY)]
            with tempfile.TemporaryFile() as log:
                proc, address = start_broker(args, log, env=env, cwd=opts.tree)
                try:
                    worst.append(asyncio.run(_run(address, f"tcp://127.0.0.1:{wport}", opts.chars, long_prompts)))
                finally:
                    proc.terminate()
                    proc.wait(30)
        out[long_prompts] = statistics.median(worst)
        print(f"{long_prompts} long prompts of {opts.chars} chars: longest gap between chunks "
              f"{out[long_prompts] * 1e3:.1f} ms (median of {opts.repeats}: "
              f"{', '.join(f'{w * 1e3:.1f}' for w in worst)})", flush=True)


if __name__ == "__main__":
    main()
