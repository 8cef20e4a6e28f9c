"""A worker's runners warmed up before it registers: on a GPU (``models/warmup.py`` for the
model), and a target's grammar engine anywhere.

Beside the model's forwards (kernels loaded, CUDA graphs recorded), a request's first round meets
what only a round does: the draft steps' sampling on the device, a verify's acceptance, pinned
staging buffers, the forward clock's events. So each runner drafts and then verifies two requests
of its own, one greedy and one sampled, before the first real one comes; their KV is dropped and
their forward times forgotten (the policy's measured costs must not start with warm-up outliers).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from nebula_flow.models import warmup
from nebula_flow.models.llama import CausalLM
from nebula_flow.params import SamplingParams
from nebula_flow_workers.runner import ModelRunner, Task

log = logging.getLogger("nebula_flow.worker")

RID = 1 << 62  # the warm-up requests' numbers (no broker hands out ids this large)


def warm_up(runner: object, max_batch: int, name: str) -> None:
    """Warm ``runner`` up for batches of up to ``max_batch`` where its model runs on a GPU (an
    n-gram runner, an emulated model and a CPU model need none). On every device a target's
    grammar engine builds its tokenizer on a thread of its own (``Guides.prepare``)."""
    if (guides := getattr(runner, "guides", None)) is not None:
        guides.prepare()
    model = getattr(runner, "model", None)
    if not isinstance(runner, ModelRunner) or not isinstance(model, CausalLM) or model.lm_head.weight.device.type != "cuda":
        return
    warmup.warm_up(model, max_batch, name)
    t0 = time.perf_counter()
    warm_round(runner)
    log.info("%s: a draft and a verify of warm-up requests took %.2f s", name, time.perf_counter() - t0)


def warm_round(runner: ModelRunner) -> None:
    """A draft and then a verify of two requests of its own on ``runner``, greedy and sampled;
    their KV dropped and the forward times forgotten after."""
    kinds = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=1)]
    tasks = [Task(RID + i, "draft", 1, 1, np.arange(1, 40 + i) % runner.model.cfg.vocab_size, 4, params, i)
             for i, params in enumerate(kinds)]
    drafts = runner.draft(tasks)
    runner.verify([replace(t, kind="verify", k=len(d.tokens), draft=d.tokens, q_idx=d.q_idx, q_prob=d.q_prob)
                   for t, d in zip(tasks, drafts)])
    runner.store.free([t.rid for t in tasks], keep=False)
    runner.forget_timings()
