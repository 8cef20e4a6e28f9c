"""How much host work a forward is: the aten ops one forward dispatches (torch's profiler), for a
decode batch and a verify batch, on a model of a real shape with random weights (no download).

On a GPU each op is at least one kernel launch and some host time, so this count bounds how fast
a small model can step whatever the device: `nebula-flow profile --ops` prints it, the figure the
GPU runtime (issue 27) is to cut.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from nebula_flow.models import flash
from nebula_flow.models.config import ModelConfig
from nebula_flow.models.graphs import StepGraphs
from nebula_flow.models.llama import CausalLM

# Qwen3-0.6B's shape (its config.json), the draft model of the deployments the issues measure.
QWEN3_0_6B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": True}
# (name, sequences, new rows each): decode steps alone and in batches, and batches of 5-row verifies
SHAPES = (("decode_1", 1, 1), ("decode_8", 8, 1), ("decode_16", 16, 1), ("verify_8x5", 8, 5), ("verify_16x5", 16, 5))


def random_model(raw: dict[str, Any], dtype: torch.dtype = torch.float32, inference: bool = True,
                 device: str = "cpu") -> CausalLM:
    """A model of ``raw``'s shape with random weights, prepared as the loader prepares one (on
    CUDA with its decode steps and verify blocks replayed from graphs, as there)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(ModelConfig.from_dict(raw)).to(dtype).eval()
    if inference:
        model.fuse_projections()
        model.pack_weights()
    flash.skip_cudnn_attention(torch.device(device))
    if torch.device(device).type == "cuda":
        model.step_graphs = StepGraphs(model)
    return model


@torch.no_grad()
def forward_ops(model: CausalLM, sequences: int, rows: int, context: int = 128, repeats: int = 3,
                kernels: bool = False) -> dict[str, Any]:
    """The aten ops (all, nested included) and the median wall time of one forward of ``sequences``
    sequences of ``context`` cached positions, ``rows`` new rows each; ``kernels``: also the GPU
    kernels the profiled forward ran, (name, microseconds) each (none on a CPU)."""
    caches = [model.new_cache(capacity=context + rows + 1) for _ in range(sequences)]
    model(caches, [[1] * context for _ in caches], [0] * sequences)

    device = model.lm_head.weight.device
    launched: list[float] = []

    def step() -> None:
        t0 = time.perf_counter()
        model(caches, [[2] * rows for _ in caches], [rows] * sequences)
        for cache in caches:
            cache.truncate(context)
        launched.append(time.perf_counter() - t0)
        if device.type == "cuda":  # (the device's time, not the launches')
            torch.cuda.synchronize(device)

    step()  # (warm-up: first-call allocations)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if kernels and device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    # host: until the forward returned (on a GPU, its launches queued); near ``seconds``, the host binds
    out = {"ops": ops, "seconds": statistics.median(times), "host_seconds": statistics.median(launched[1:1 + repeats])}
    if kernels:
        out["kernels"] = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA]
    return out


def count_ops(model: CausalLM, context: int = 128, group: bool = True, graphs: bool = True) -> dict[str, dict[str, Any]]:
    """``forward_ops`` for each of ``SHAPES``, with the batch's attention grouped into one call
    per layer (``models.batch``) or (``group`` False) each sequence attending apart, as every
    forward did before the grouped path; on CUDA with or without CUDA graphs (``graphs``)."""
    kept = model.step_graphs
    model.group_attention = group
    if not (graphs and group):  # (a graph always attends grouped)
        model.step_graphs = None
    try:
        return {name: forward_ops(model, sequences, rows, context) for name, sequences, rows in SHAPES}
    finally:
        del model.group_attention  # (back to the class's default)
        model.step_graphs = kept
