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
import sys

import torch

from nebula_flow.models.ops import QWEN3_0_6B, forward_ops, random_model

STEPS = 50  # timed steps per figure, back to back after a warm-up (the clocks up)


def kernel_table(kernels: list[tuple[str, float]], top: int) -> dict:
    """A step's kernels (``forward_ops(..., kernels=True)``): how many, their time, the costliest."""
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    return {"kernels": len(kernels), "kernel_us": round(sum(us for _, us in kernels), 1),
            "top": [(name[:90], len(ts), round(sum(ts), 1)) for name, ts in
                    sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    model = random_model(QWEN3_0_6B, torch.bfloat16, device="cuda")
    report: dict = {"device": torch.cuda.get_device_name(), "context": args.context}
    for size in (1, 16):
        graphs = model.step_graphs
        graphed = forward_ops(model, size, 1, args.context, STEPS)
        model.step_graphs = None
        eager = forward_ops(model, size, 1, args.context, STEPS, kernels=True)
        model.step_graphs = graphs
        report[f"graph_decode_{size}_ms"] = round(1e3 * graphed["seconds"], 3)
        report[f"eager_decode_{size}_ms"] = round(1e3 * eager["seconds"], 3)
        report[f"decode_{size}"] = kernel_table(eager["kernels"], args.top)
        print(json.dumps({k: v for k, v in report.items() if not k.startswith("decode_")}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
