"""Time and count one model's forwards by batch shape (docs/benchmarks.md, "One attention call per
layer"): decodes of 1, 8 and 16 sequences, a 12-row verify (a draft with a token tree), 4 seven-row
verifies and 8 and 16 five-row verifies, 128 cached positions each;
prints one JSON line {shape: [aten ops, median seconds]}.

Run it from two checkouts in turns to compare them (each imports the nebula_flow beside it):

    PYTHONPATH=. .venv/bin/python tools/bench_forward.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json

import torch

from nebula_flow.bundled import target_dir
from nebula_flow.models.loader import load_model
from nebula_flow.models.ops import forward_ops

SHAPES = (("decode_1", 1, 1), ("decode_8", 8, 1), ("decode_16", 16, 1), ("verify_1x12", 1, 12), ("verify_4x7", 4, 7),
          ("verify_8x5", 8, 5), ("verify_16x5", 16, 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled target, made by make run)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model or target_dir(), dtype=args.dtype)
    out = {name: forward_ops(model, seqs, rows, repeats=args.repeats) for name, seqs, rows in SHAPES}
    print(json.dumps({k: [v["ops"], round(v["seconds"], 4)] for k, v in out.items()}))


if __name__ == "__main__":
    main()
