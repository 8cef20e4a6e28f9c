"""Decode steps replayed from CUDA graphs.

On a GPU a decode step of a small model is bound by the host: every op of the forward is a kernel
launch from Python, and a draft step of a 0.6B model launches about as many kernels as a target's
verify. A CUDA graph replays a recorded step's kernels with one launch. As in nano-vllm, graphs
hold decode steps only: every sequence adds one token and wants its logits, and all attend in one
call over one arena chunk (``models.batch``; the model not batch-invariant). That is every draft
step after a round's first, and a target's decoding.

A graph is recorded per (arena chunk, batch size, key bucket): its inputs are fixed tensors (token
ids, positions, the slots the new KV goes to, the slots each sequence's keys come from, padded to
the bucket, and the masks), filled from the host before each replay without waiting for the
device. Keys are padded to a power of two from ``MIN_KEYS`` and masked, so one graph serves a
range of lengths. A graph is recorded on first use (warm-up on a side stream, capture, then one
replay checked bit for bit against the same step run eagerly); a graph that fails to record or
to match turns graphs off for the model with a warning, and every step runs eagerly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from nebula_flow.kv.cache import KVCache
from nebula_flow.models import staging

log = logging.getLogger("nebula_flow.models")

MIN_KEYS = 256  # the smallest key bucket (a step attends to this many key slots or a power of two more)
MAX_GRAPHS = 64  # recorded graphs per model; steps of further shapes run eagerly


def key_bucket(keys: int) -> int:
    """The key slots a graph for steps with ``keys`` keys per sequence attends over."""
    return max(MIN_KEYS, 1 << (keys - 1).bit_length())


class StaticPlan:
    """A decode step's ``GroupPlan`` in fixed tensors (``Attention._grouped`` reads either):
    ``size`` sequences of one new row, ``keys`` key slots each, the padding masked."""

    width = 1
    padded = real = rows = None

    def __init__(self, chunk: torch.Tensor, size: int, keys: int, windows: set[int | None], dtype: torch.dtype) -> None:
        self.chunk, self.size, self.keys = chunk, size, keys
        device = chunk.device
        self.write = torch.zeros(size, dtype=torch.long, device=device)
        self.gather = torch.zeros(size * keys, dtype=torch.long, device=device)
        self.masks = {w: torch.zeros(size, 1, 1, keys, dtype=dtype, device=device) for w in windows}

    def mask(self, window: int | None) -> torch.Tensor:
        return self.masks[window]

    def fill(self, caches: list[KVCache]) -> None:
        """Point the plan at ``caches``' slots for their next position (made on the host, copied in)."""
        past = torch.tensor([c.length for c in caches])[:, None]
        base = torch.tensor([c.lease.base for c in caches])[:, None]
        key = torch.arange(self.keys)[None, :]
        seen = key <= past  # (the new row's own slot, ``past``, is written before the keys are read)
        staging.copy_into(self.write, (base + past)[:, 0])
        staging.copy_into(self.gather, (base + torch.where(seen, key, 0)).flatten())
        for window, mask in self.masks.items():
            allowed = seen if window is None else seen & (past - key < window)
            staging.copy_into(mask, torch.zeros(allowed.shape, dtype=mask.dtype).masked_fill_(~allowed, float("-inf"))[:, None, None])


class _PlanOnly:
    """What ``DecoderLayer`` reads of a ``Batch`` when every sequence attends through one plan."""

    rows = None
    apart: list[int] = []

    def __init__(self, plan: StaticPlan) -> None:
        self.plan = plan


class DecodeStep:
    """One shape's fixed inputs and the step over them (``run``: eagerly; a graph replays it)."""

    def __init__(self, model: Any, chunk: torch.Tensor, size: int, keys: int) -> None:  # noqa: ANN401 - a CausalLM
        device = chunk.device
        self.model = model
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.float32, device=device)
        self.plan = StaticPlan(chunk, size, keys, model.windows, chunk.dtype)
        self.replay: Callable[[], None] | None = None  # the recorded graph's replay, once recorded
        self.graph = None  # (the graph, kept alive with its step)
        self.out: torch.Tensor | None = None  # where a replay leaves the logits

    def fill(self, caches: list[KVCache], new_tokens: list[list[int]] | torch.Tensor) -> None:
        if isinstance(new_tokens, torch.Tensor):
            self.ids.copy_(new_tokens)
        else:
            staging.copy_into(self.ids, torch.tensor([seq[0] for seq in new_tokens]))
        staging.copy_into(self.positions, torch.tensor([c.length for c in caches], dtype=torch.float32))
        self.plan.fill(caches)

    def run(self) -> torch.Tensor:
        return self.model.compute(self.ids, self.positions, _PlanOnly(self.plan), None)


def record(step: DecodeStep, pool: Any) -> Any:  # noqa: ANN401 - a CUDA graph memory pool handle
    """Record ``step`` into a CUDA graph (its inputs filled); returns the graph's memory pool."""
    side = torch.cuda.Stream(step.ids.device)
    side.wait_stream(torch.cuda.current_stream(step.ids.device))
    with torch.cuda.stream(side):  # (warm-up off the capture: lazy initialisations happen here)
        for _ in range(2):
            step.run()
    torch.cuda.current_stream(step.ids.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step.out = step.run()
    step.graph, step.replay = graph, graph.replay
    return graph.pool()


class DecodeGraphs:
    """A model's recorded decode steps; ``step`` runs a forward from one when it qualifies."""

    def __init__(self, model: Any, recorder: Callable[[DecodeStep, Any], Any] = record) -> None:  # noqa: ANN401
        self.model, self.recorder = model, recorder
        self.steps: dict[tuple[int, int, int], DecodeStep] = {}
        self.pool = None
        self.enabled = True
        self.replays = 0

    def step(self, caches: list[KVCache], lengths: list[int], logit_rows: list[int],
             new_tokens: list[list[int]] | torch.Tensor) -> torch.Tensor | None:
        """The logits of this forward from a graph ([sequences, vocab]), or None where it does not
        qualify (the caller runs it eagerly). The caches must have room for the new token."""
        if not self.enabled or self.model.batch_invariant or any(n != 1 for n in lengths) or any(r != 1 for r in logit_rows):
            return None
        lease = caches[0].lease
        if lease is None or any(c.lease is None or c.arena is not caches[0].arena or c.lease.chunk != lease.chunk
                                for c in caches):
            return None
        shape = (lease.chunk, len(caches), key_bucket(max(c.length for c in caches) + 1))
        step = self.steps.get(shape)
        if step is None:
            if len(self.steps) >= MAX_GRAPHS:
                return None
            step = self.steps[shape] = DecodeStep(self.model, caches[0].arena.chunk(lease), *shape[1:])
        step.fill(caches, new_tokens)
        if step.replay is None and not self._record(step):
            return None
        step.replay()
        self.replays += 1
        return step.out.clone()  # (the next replay overwrites ``out``)

    def _record(self, step: DecodeStep) -> bool:
        """Record ``step``'s graph and check one replay against the eager step, bit for bit."""
        try:
            self.pool = self.recorder(step, self.pool)
            step.replay()
            replayed = step.out.clone()
            eager = step.run()  # (writes the same KV to the same slots again)
            if torch.equal(replayed, eager):
                return True
            reason = "a replay's logits differ from the eager step's"
        except Exception as exc:  # noqa: BLE001 - any failure to record leaves eager steps, which always work
            reason = repr(exc)
        log.warning("CUDA graphs off for this model: %s; decode steps run eagerly", reason)
        self.enabled = False
        self.steps.clear()
        return False
