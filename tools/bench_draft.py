"""Time a draft batch and a sampled verify on the host (docs/benchmarks.md, "Host round trips"):
``ModelRunner.draft`` on the bundled draft (k = 4, 128 committed tokens, 1 and 8 sequences; greedy,
temperature 0.8, and temperature 0.8 with top-p 0.9), and the host side of one sampled verify (k = 4,
a 49,152-token vocabulary) with every row's target distribution made up front, as before
``specdec.TargetRows``, and with only the rows its walk reads. Prints one JSON line of median
milliseconds.

Run it from two checkouts in turns to compare them; a checkout other than the installed one needs
its worker package on the path too (the editable install maps ``nebula_flow_workers`` to the
installed checkout whatever the current folder):

    mkdir -p /tmp/pkgs && ln -sfn $PWD/workers /tmp/pkgs/nebula_flow_workers
    PYTHONPATH=/tmp/pkgs:. .venv/bin/python tools/bench_draft.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import numpy as np
import torch

from nebula_flow import specdec
from nebula_flow.models.loader import load_model
from nebula_flow.params import SamplingParams
from nebula_flow.tree import TokenTree
from nebula_flow_workers.runner import ModelRunner, Task

KINDS = {"greedy": SamplingParams(max_new_tokens=8), "sampled": SamplingParams(max_new_tokens=8, temperature=0.8),
         "top_p": SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9)}


def _median_ms(run, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 2)


def drafts(model_dir: str, repeats: int) -> dict[str, float]:
    runner = ModelRunner(load_model(model_dir))
    rounds = iter(range(10**9))

    def run(size: int, params: SamplingParams) -> None:
        r = next(rounds)
        runner.draft([Task(rid, "draft", r, 1, np.arange(10 + rid, 138 + rid), 4, params, rid) for rid in range(size)])

    out = {}
    for name, params in KINDS.items():
        for size in (1, 8):
            run(size, params)  # (warm-up)
            out[f"draft_{name}_b{size}"] = _median_ms(partial(run, size, params), repeats)
    return out


def _walk(target: torch.Tensor, params: SamplingParams, tree: TokenTree, q_idx: list, q_prob: list,
          all_rows: bool) -> list[int]:
    """One sampled verify's host side: every row's distribution made up front (as before
    ``TargetRows``), or only the rows the walk reads."""
    rows = specdec.TargetRows(target, params)
    if all_rows:
        rows.made = dict(enumerate(specdec.target_probs(target, params).numpy()))
    return specdec._sample_tree(rows, tree, len(q_idx), q_idx, q_prob, 1, 10)


def sampled_verify(repeats: int) -> dict[str, float]:
    if not hasattr(specdec, "TargetRows"):  # (a checkout from before it)
        return {}
    vocab, k = 49152, 4
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in ("sampled", "top_p"):
        params = KINDS[name]
        target = torch.randn(k + 1, vocab, generator=g) * 3
        draft = target[:k] + 0.3 * torch.randn(k, vocab, generator=g)
        proposals = [specdec.propose(draft[i], params, 1, 10 + i, 16) for i in range(k)]
        tree = TokenTree([[tok for tok, _, _ in proposals]])
        q_idx, q_prob = [idx for _, idx, _ in proposals], [prob for _, _, prob in proposals]
        committed = _walk(target, params, tree, q_idx, q_prob, all_rows=False)
        assert _walk(target, params, tree, q_idx, q_prob, all_rows=True) == committed
        for label, every in (("all_rows", True), ("path_rows", False)):
            out[f"verify_{name}_{label}_commit{len(committed)}"] = _median_ms(
                partial(_walk, target, params, tree, q_idx, q_prob, every), repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="models/smollm2-draft", help="draft checkpoint folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps({**drafts(args.draft, args.repeats), **sampled_verify(args.repeats)}))


if __name__ == "__main__":
    main()
