"""Where a decode step's device time goes on a GPU: a Qwen3-0.6B-shaped bf16 model (random
weights), one sequence and sixteen, steady-state step times replayed from CUDA graphs and eager
(50 steps each after a warm-up, so the clocks are up), and the kernels one eager step launches
(torch's profiler with CUDA activity): their count and the costliest. JSON on stdout (progress on
stderr).

    python tools/gpu_kernels.py [--context 128] [--top 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from nebula_flow.models.ops import QWEN3_0_6B, random_model


def steady(model, caches, context: int, steps: int = 50) -> float:  # noqa: ANN001
    """Median seconds of one decode step over ``steps`` back-to-back steps (device time included)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(caches, [[2] for _ in caches], [1] * len(caches))
        for cache in caches:
            cache.truncate(context)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    model = random_model(QWEN3_0_6B, torch.bfloat16, device="cuda")
    report: dict = {"device": torch.cuda.get_device_name(), "context": args.context}
    for size in (1, 16):
        caches = [model.new_cache(capacity=args.context + 2) for _ in range(size)]
        model(caches, [[1] * args.context for _ in caches], [0] * size)
        graphs = model.step_graphs
        steady(model, caches, args.context, 5)
        report[f"graph_decode_{size}_ms"] = round(1e3 * steady(model, caches, args.context), 3)
        model.step_graphs = None
        steady(model, caches, args.context, 5)
        report[f"eager_decode_{size}_ms"] = round(1e3 * steady(model, caches, args.context), 3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            steady(model, caches, args.context, 1)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        report[f"decode_{size}"] = {
            "kernels": len(kernels), "kernel_us": round(sum(e.time_range.elapsed_us() for e in kernels), 1),
            "top": [(name[:90], len(ts), round(sum(ts), 1)) for name, ts in
                    sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]]}
        model.step_graphs = graphs
        print(json.dumps({k: v for k, v in report.items() if not k.startswith("decode_")}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
