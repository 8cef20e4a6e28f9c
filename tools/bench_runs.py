"""A batch-invariant model's forwards by shape, this checkout against another in turns: prefills of
512 and 2,048 tokens, decodes and 5-row verifies of 1 and 8 sequences at 200, 400 and 1,000 cached
positions (``models.ops.forward_ops``), one thread.

    PYTHONPATH=. .venv/bin/python tools/bench_runs.py --against DIR [--turns 3] [--model DIR]

``DIR``: another checkout (e.g. ``git worktree add /tmp/base <commit>``), whose ``nebula_flow`` the
other turns import. Each turn is a process of its own (model load, then every shape, each the
median of ``--repeats`` forwards); printed: per shape, the median over turns of each checkout and
their ratio (this / other). ``--one`` (internal): one turn of this process's checkout, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PREFILLS = (512, 2048)
BATCHES = ((1, 1), (8, 1), (1, 5), (8, 5))  # (sequences, new rows each)
CONTEXTS = (200, 400, 1000)


def one_turn(model_dir: str, repeats: int) -> dict[str, float]:
    import torch

    from nebula_flow.models.loader import load_model
    from nebula_flow.models.ops import forward_ops

    torch.set_num_threads(1)
    model = load_model(model_dir, dtype="auto", batch_invariant=True)
    out = {}
    with torch.inference_mode():
        for n in PREFILLS:
            times = []
            for _ in range(repeats):
                cache = model.new_cache(n + 1)
                start = time.perf_counter()
                model([cache], [[7] * n], [1])
                times.append(time.perf_counter() - start)
                cache.release()
            out[f"prefill {n}"] = statistics.median(times)
    for context in CONTEXTS:
        for seqs, rows in BATCHES:
            name = f"{'decode' if rows == 1 else f'verify {rows}'} x{seqs} @{context}"
            out[name] = forward_ops(model, seqs, rows, context=context, repeats=repeats)["seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="the other checkout's root")
    ap.add_argument("--model", default=str(Path.home() / ".cache/nebula-flow/smollm2-135m-instruct"))
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_turn(args.model, args.repeats)))
        return
    if not args.against:
        ap.error("--against DIR: the checkout to compare with")
    here = str(Path(__file__).resolve().parent.parent)
    roots = {"this": here, "other": str(Path(args.against).resolve())}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in roots}
    for turn in range(args.turns):  # (in turns: this machine's speed drifts)
        for name, root in roots.items():
            cmd = [sys.executable, __file__, "--one", "--model", args.model, "--repeats", str(args.repeats)]
            env = dict(os.environ, PYTHONPATH=root)
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"turn {turn + 1}/{args.turns}: {name} done", file=sys.stderr, flush=True)
    print(f"{'shape':<22} {'this (ms)':>10} {'other (ms)':>10} {'this/other':>10}")
    for shape in runs["this"][0]:
        a, b = (statistics.median(r[shape] for r in runs[k]) * 1e3 for k in ("this", "other"))
        print(f"{shape:<22} {a:>10.1f} {b:>10.1f} {a / b:>10.2f}")


if __name__ == "__main__":
    main()
