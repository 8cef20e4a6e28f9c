"""A GPU worker's model warmed up before its first request, as vLLM's engine does at start.

On CUDA the first forward of each shape pays for what later ones do not: the kernels it picks are
loaded into the context on first use, and a step that replays a CUDA graph must first record it
(``models.graphs``). So a worker, before it registers, runs a few eager prefills of the sizes
requests bring and records the graphs of short contexts; what it took goes to the log. Measured on
an H200 with the tiny pair (2026-12-04, docs/benchmarks.md, "Graph buckets, warm-up at start"):
8 requests at once, the first ones' time to first token went from 0.99 s to 0.12 s (later ones:
0.015 s). Each new prompt length's first prefill was still slow (20-48 ms against 2.5-4 ms), which
warming up other lengths did not cure: cuDNN attention's plan per shape, 43-46 ms a new shape
(measured since; SDPA now skips cuDNN, ``flash.skip_cudnn_attention``).

First of all, where the model attends through FlashAttention (``models.flash``), a small ragged
batch runs through it and through SDPA: a kernel that fails or disagrees turns it off for the
model, with a warning, before any request depends on it.
"""

from __future__ import annotations

import logging
import time

import torch

from nebula_flow.models.graphs import MAX_WIDTH, batch_bucket
from nebula_flow.models.llama import CausalLM

log = logging.getLogger("nebula_flow.models")

PREFILLS = (17, 32, 64, 128, 256, 512)  # prompt lengths warmed up (one sequence each; then a batch of the shortest)


def warm_up(model: CausalLM, max_batch: int, name: str) -> None:
    """Warm ``model`` up for batches of up to ``max_batch`` sequences where it runs on a GPU: eager
    prefills of ``PREFILLS`` tokens, then its graphs for short contexts (``StepGraphs.capture``)."""
    weight = model.lm_head.weight
    if weight.device.type != "cuda":
        return
    t0 = time.perf_counter()
    if model.uses_flash():
        check_flash(model, name)
    longest = min(PREFILLS[-1], model.cfg.max_position_embeddings)
    for tokens in [[[1] * min(n, longest)] for n in PREFILLS] + [[[1] * PREFILLS[0]] * min(max_batch, 8)]:
        caches = [model.new_cache(capacity=len(t)) for t in tokens]
        model(caches, tokens, [1] * len(tokens))
        for cache in caches:
            cache.release()
    graphs = model.step_graphs
    count = graphs.capture(max_batch) if graphs is not None and graphs.enabled else 0
    torch.cuda.synchronize(weight.device)
    log.info("%s: warmed up in %.1f s: prefills of up to %d tokens, %d CUDA graphs recorded (up to %d sequences "
             "of up to %d rows)%s", name, time.perf_counter() - t0, longest, count, batch_bucket(max_batch), MAX_WIDTH,
             "" if graphs is not None and graphs.enabled else "; CUDA graphs are off")


def check_flash(model: CausalLM, name: str) -> bool:
    """Run prefills and then a decode, a verify block and a longer prefill in one batch through
    FlashAttention and through SDPA; where the kernel fails, or its logits differ from SDPA's by
    more than the dtype's rounding can explain, attend through SDPA from now on (with a warning).
    Returns whether FlashAttention stays on."""
    graphs, model.step_graphs = model.step_graphs, None  # (the eager kernels; graphs are checked as they record)
    try:
        reason = _flash_fault(model)
    finally:
        model.step_graphs = graphs
    if reason is None:
        return True
    log.warning("%s: FlashAttention off for this model, %s; attention runs through SDPA", name, reason)
    model.flash_attention = False
    return False


def _flash_fault(model: CausalLM) -> str | None:
    """What is wrong with ``model``'s FlashAttention forwards against its SDPA ones (None: nothing)."""
    prompts, steps = [[1 + i % 50 for i in range(n)] for n in (9, 30, 3)], [[5], [6, 7, 8, 9], list(range(2, 40))]

    def run(use_flash: bool) -> torch.Tensor:
        model.flash_attention = use_flash
        caches = [model.new_cache(capacity=64) for _ in prompts]
        try:
            model(caches, prompts, [0] * len(prompts))
            return torch.cat(model(caches, steps, [len(s) for s in steps]))
        finally:
            for cache in caches:
                cache.release()

    try:
        got = run(True)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        return f"it failed: {exc!r}"[:300]
    want = run(False)
    model.flash_attention = True
    scale, error = want.abs().max().item(), (got - want).abs().max().item()
    return None if error <= 0.05 * scale else f"its logits differ from SDPA's by {error:.3g} (largest logit {scale:.3g})"
