"""KV that follows a request on a shared document: what moves when a pooled request changes target
worker. The bundled pair, pooled with one draft and two target workers (each verifying
``--target-batch`` requests at most, so requests move), ``--requests`` questions after the same
~``--document`` tokens of code, six at a time, 48 tokens each. Printed: the workers' KV counters
summed (``pulls``, ``pulled`` positions, ``bytes_pulled``, ``pull_saved``: positions a move did not
pull because a finished request's KV in the new worker's prefix cache held them, ``prefix_pulls``).

    PYTHONPATH=. .venv/bin/python tools/bench_moving_kv.py [--requests 12] [--target-batch 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from nebula_flow.bench import with_context
from nebula_flow.bundled import target_dir
from nebula_flow.client import AsyncClient, Client
from nebula_flow.config import load_config
from nebula_flow.deploy import Deployment

COUNTERS = ("pulls", "pulled", "bytes_pulled", "pull_saved", "prefix_pulls", "prefix_hits")


async def ask_all(address: str, prompts: list[str], at_once: int = 6) -> int:
    """Send ``prompts``, ``at_once`` at a time; the tokens generated."""
    async with AsyncClient(address) as client:
        room = asyncio.Semaphore(at_once)

        async def one(prompt: str) -> int:
            async with room:
                return len((await client.generate(prompt=prompt, max_new_tokens=48, ignore_eos=True)).token_ids)

        return sum(await asyncio.gather(*[one(p) for p in prompts]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--target-batch", type=int, default=1, help="a target worker's most requests a batch")
    ap.add_argument("--document", type=int, default=1500, help="tokens of the shared document")
    args = ap.parse_args()
    cfg = load_config("configs/default.toml")
    cfg.mode, cfg.draft.workers, cfg.target.workers, cfg.target.max_batch = "pooled", 1, 2, args.target_batch
    cfg.broker.client_port = cfg.broker.worker_port = 0
    cfg.broker.policy = cfg.broker.policy.replace(max_forward_tokens=0, disable_by_batch_size=0)
    questions = [f"# question {i}: what does the code above do?\ndef answer_{i}():" for i in range(args.requests)]
    prompts = with_context(questions, args.document, target_dir(), shared=True)
    with Deployment(cfg) as dep:
        start = time.monotonic()
        tokens = asyncio.run(ask_all(dep.address, prompts))
        took = time.monotonic() - start
        with Client(dep.address) as client:
            workers = client.status()["workers"]
    totals = {k: sum((w["kv"] or {}).get(k, 0) for w in workers) for k in COUNTERS}
    print(json.dumps({"seconds": round(took, 1), "tokens_per_s": round(tokens / took, 1), **totals}))


if __name__ == "__main__":
    main()
