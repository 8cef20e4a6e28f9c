"""A long prompt's prefill: this runtime's forward against HF transformers' on the same checkpoint,
both on one thread in the dtype a deployment picks (bf16 where the CPU has it).

    PYTHONPATH=. .venv/bin/python tools/bench_prefill.py [--model DIR] [--lengths 512,1024,2048] [--repeats 3]

Ours is batch-invariant on a CPU in bf16 (``models/invariant.py``, ``models/rows.py``): every query
row attends as a problem of its own (a prefill's rows in matrix products, in the dtype the kernel
probe allows), so a position's logits have the same bits in a prefill, a verify and a decode.
Prints the median seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from nebula_flow.kv.store import KVStore
from nebula_flow.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache/nebula-flow/smollm2-135m-instruct"))
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-invariant", action="store_true", help="ours without batch invariance (not lossless in bf16)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    ours = load_model(args.model, dtype="auto", batch_invariant=False if args.no_invariant else None)
    dtype = next(ours.parameters()).dtype
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    print(f"{args.model}: {dtype}, batch-invariant {ours.batch_invariant}, 1 thread")
    rng = np.random.default_rng(0)
    for n in map(int, args.lengths.split(",")):
        ids = rng.integers(100, ours.cfg.vocab_size - 1, n)
        times: dict[str, list[float]] = {"ours": [], "hf": []}
        for _ in range(args.repeats):  # (in turns: this machine's speed drifts)
            with torch.inference_mode():
                cache = KVStore(ours).prepare(1, np.append(ids, 5), prompt_len=n)  # (as a worker's task says)
                t = time.perf_counter()
                ours([cache], [ids.tolist()], [1])
                times["ours"].append(time.perf_counter() - t)
                t = time.perf_counter()
                hf(torch.from_numpy(ids)[None], logits_to_keep=1)
                times["hf"].append(time.perf_counter() - t)
        mine, theirs = (statistics.median(times[k]) for k in ("ours", "hf"))
        print(f"{n} tokens: ours {mine:.2f} s, HF {theirs:.2f} s ({mine / theirs:.2f}x HF's time; medians of {args.repeats})")


if __name__ == "__main__":
    main()
