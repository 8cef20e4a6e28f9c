"""What a greedy pick costs on a CPU: torch's argmax of logits rows against ``specdec.argmax``
(numpy's on a CPU), per dtype, warm (back to back) and after a forward-sized sweep of memory
(the cold caches a pick meets right after a forward). Prints medians in microseconds.

    PYTHONPATH=. .venv/bin/python tools/bench_argmax.py [--rows 3] [--vocab 49152] [--repeats 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from nebula_flow import specdec


def median_us(pick: Callable[[], object], repeats: int, flush: np.ndarray | None) -> float:
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.sum()  # (evicts the caches as a forward's weights do)
        t0 = time.perf_counter()
        pick()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    flush = np.ones((64 << 20) // 8)  # 64 MiB
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rows} rows of {args.vocab} logits")
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(args.rows, args.vocab).to(dtype)
        for name, pick in (("torch argmax", lambda x=logits: x.argmax(-1).tolist()),
                           ("specdec.argmax", lambda x=logits: specdec.argmax(x).tolist())):
            warm = median_us(pick, args.repeats, None)
            cold = median_us(pick, max(20, args.repeats // 10), flush)
            print(f"{str(dtype):15s} {name:15s} warm {warm:7.1f} us   cold {cold:7.1f} us")


if __name__ == "__main__":
    main()
