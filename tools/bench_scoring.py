"""Scoring prompts through a deployment (``prompt_logprobs``, what the HTTP API's ``echo`` with
``logprobs`` asks) against HF transformers' own forward over the same prompts, side by side.

An evaluation harness scores a continuation by sending context and continuation as one prompt
with ``echo``, ``logprobs`` 1 and ``max_tokens`` 1 (lm-evaluation-harness's ``local-completions``).
This sends ``--prompts`` prompts of ``--tokens`` tokens (cut from the corpus), ``--concurrency`` at
a time, asking for their prompt's log-probabilities, to the deployment of ``--config`` (the bundled
default), and before that scores the same prompts with HF transformers in this process (the
target checkpoint in the deployment's dtype, one prompt a forward, torch's default threads: what a
user scoring with transformers runs). Printed: prompt tokens scored per second each way (medians
over ``--repeats``), their ratio, and how far the two sides' log-probabilities are apart.

    .venv/bin/python tools/bench_scoring.py [--config FILE] [--prompts 16] [--tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from nebula_flow.cli.common import load_deploy, prepare_models
from nebula_flow.client import AsyncClient
from nebula_flow.corpus import corpus_files
from nebula_flow.deploy import Deployment
from nebula_flow.models.loader import resolve_dtype
from nebula_flow.tokenizer import TextCodec


def prompts_of(codec: TextCodec, count: int, tokens: int) -> list[list[int]]:
    """``count`` windows of ``tokens`` tokens, one from each corpus file long enough."""
    out = []
    for path in corpus_files(None):
        ids = codec.encode(path.read_text(errors="replace")[:tokens * 8])
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == count:
            return out
    raise SystemExit(f"the corpus has fewer than {count} files of {tokens} tokens")


def hf_scores(model_dir: str, dtype: str, prompts: list[list[int]], repeats: int) -> tuple[list[float], list]:
    """Prompt tokens scored per second by HF transformers (each repeat), and each prompt's scores."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, "cpu")).eval()
    rates, scores = [], []
    for r in range(repeats + 1):  # (the first: a warm-up)
        t0, scores = time.perf_counter(), []
        with torch.inference_mode():
            for p in prompts:
                logits = model(torch.tensor([p])).logits[0, :-1].float()
                scores.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(p[1:])[:, None])[:, 0])
        if r:
            rates.append(sum(len(p) - 1 for p in prompts) / (time.perf_counter() - t0))
    return rates, scores


async def deployment_scores(address: str, prompts: list[list[int]], concurrency: int, repeats: int
                            ) -> tuple[list[float], list]:
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(address, timeout_s=600) as client:
        async def one(p: list[int]) -> list:
            async with gate:
                return (await client.generate(token_ids=p, max_new_tokens=1, prompt_logprobs=1)).prompt_logprobs

        rates, got = [], []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            got = await asyncio.gather(*(one(p) for p in prompts))
            if r:
                rates.append(sum(len(p) - 1 for p in prompts) / (time.perf_counter() - t0))
    return rates, [torch.tensor([e[2] for e in entries[1:]]) for entries in got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="deployment config (default: the bundled default)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = load_deploy(args.config)
    prepare_models(cfg)
    cfg.broker.client_port = cfg.broker.worker_port = 0
    prompts = prompts_of(TextCodec(cfg.target.model), args.prompts, args.tokens)
    hf_rates, ref = hf_scores(str(cfg.target.model), cfg.target.dtype, prompts, args.repeats)
    with Deployment(cfg) as dep:
        ours_rates, mine = asyncio.run(deployment_scores(dep.address, prompts, args.concurrency, args.repeats))
    diff = torch.cat([(a - b).abs() for a, b in zip(mine, ref)])
    hf, ours = statistics.median(hf_rates), statistics.median(ours_rates)
    print(json.dumps({"prompts": args.prompts, "tokens": args.tokens, "concurrency": args.concurrency,
                      "dtype": cfg.target.dtype, "mode": cfg.mode, "hf_tokens_per_s": round(hf, 1),
                      "deployment_tokens_per_s": round(ours, 1), "ratio": round(ours / hf, 3),
                      "hf_repeats": [round(x, 1) for x in hf_rates], "deployment_repeats": [round(x, 1) for x in ours_rates],
                      "max_abs_diff": round(float(diff.max()), 4), "mean_abs_diff": round(float(diff.mean()), 5)}, indent=1))


if __name__ == "__main__":
    main()
