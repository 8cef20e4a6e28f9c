"""Decode steps and verify blocks replayed from CUDA graphs.

On a GPU a step of a small model is bound by the host: every op of the forward is a kernel launch
from Python, and a draft step of a 0.6B model launches about as many kernels as a target's verify.
A CUDA graph replays a recorded step's kernels with one launch. Graphs hold the steps whose shape
repeats: every sequence adds at most ``MAX_WIDTH`` rows (one for a decode step, k + 1 and any token
tree's for a verify block, what it committed for a round's first draft step), those with fewer
padded to the widest, and all attend in one call over one arena chunk (``models.batch``; the
model not batch-invariant). That is every draft step, a target's decoding and its verify blocks,
whatever each request's k. Prefills wider than ``MAX_WIDTH`` run eagerly.

A graph is recorded per (arena chunk, batch size, widest rows per sequence, key bucket), each
rounded up to a few buckets so that few graphs cover the steps a deployment meets, as vLLM's capture
sizes do: batch sizes to a power of two up to 8, then to a multiple of 8 (``batch_bucket``), the
extra sequences attending over a scratch range of their own that no request uses; rows per
sequence to a power of two (``width_bucket``). Its inputs are
fixed tensors (token ids, positions, the slots the new KV goes to, the slots each sequence's keys
come from, padded to the bucket, and the masks, a token tree's included), filled from the host
before each replay without waiting for the device. Keys are padded to a power of two from
``MIN_KEYS`` and masked, so one graph serves a range of lengths. Where the model attends through
FlashAttention (``models.flash``), a step without token trees holds its fixed plan instead:
slots, where each sequence's keys start and how many it has (``StaticFlashPlan``); the key
bucket then only bounds the keys the kernel plans for. A worker records the shapes of
short contexts at start (``StepGraphs.capture``), so its first requests do not pay for recording;
other shapes are recorded on first use. Recording is a warm-up on a side stream, the capture, then
one replay checked bit for bit against the same step run eagerly; a graph that fails to record or
to match turns graphs off for the model with a warning, and every step runs eagerly as before.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from nebula_flow.kv.cache import KVCache
from nebula_flow.models import flash, staging
from nebula_flow.models.batch import TreeRows

log = logging.getLogger("nebula_flow.models")

MIN_KEYS = 256  # the smallest key bucket (a step attends to this many key slots or a power of two more)
MAX_GRAPHS = 128  # recorded graphs per model (they share one memory pool); steps of further shapes run eagerly
MAX_WIDTH = 16  # the most new rows per sequence a graph holds (a verify block with a token tree; not a prefill)
WIDTHS = (1, 2, 4, 8, 16)  # the rows per sequence graphs are recorded for (``width_bucket``)


def key_bucket(keys: int) -> int:
    """The key slots a graph for steps with ``keys`` keys per sequence attends over."""
    return max(MIN_KEYS, 1 << (keys - 1).bit_length())


def width_bucket(rows: int) -> int:
    """The rows per sequence of the graph that holds steps whose widest sequence adds ``rows``."""
    return 1 << (rows - 1).bit_length()


def batch_bucket(size: int) -> int:
    """The sequences of the graph that holds steps of ``size`` sequences: a power of two up to 8,
    then a multiple of 8 (at most 7 sequences' rows of waste, cheap next to a step's weights)."""
    return 1 << (size - 1).bit_length() if size <= 8 else -(-size // 8) * 8


def padded(caches: list[KVCache], size: int, scratch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached positions and first slots of ``caches``, then of the pad sequences up to ``size``
    (empty caches at ``scratch``)."""
    pads = size - len(caches)
    return (torch.tensor([c.length for c in caches] + [0] * pads),
            torch.tensor([c.lease.base for c in caches] + [scratch] * pads))


class StaticPlan:
    """A step's ``GroupPlan`` in fixed tensors (``Attention._grouped`` reads either): ``size``
    sequences of ``width`` new rows each, ``keys`` key slots each, the padding masked. A step of
    fewer sequences fills the rest with pad sequences: an empty cache at ``scratch`` (a range of
    ``MAX_WIDTH`` rows of the chunk that only pad sequences write and read)."""

    padded = real = rows = None
    flash = False

    def __init__(self, chunk: torch.Tensor, size: int, width: int, keys: int, windows: set[int | None],
                 dtype: torch.dtype) -> None:
        self.chunk, self.size, self.width, self.keys = chunk, size, width, keys
        device = chunk.device
        self.write = torch.zeros(size * width, dtype=torch.long, device=device)
        self.gather = torch.zeros(size * keys, dtype=torch.long, device=device)
        self.masks = {w: torch.zeros(size, 1, width, keys, dtype=dtype, device=device) for w in windows}

    def mask(self, window: int | None) -> torch.Tensor:
        return self.masks[window]

    def fill(self, caches: list[KVCache], trees: list[TreeRows | None], scratch: int | None) -> torch.Tensor:
        """Point the plan at ``caches``' slots for their next ``width`` positions (made on the host,
        copied in); returns the rows' positions (a tree's rows sit at their depth). A sequence with
        fewer new rows is padded: its pad rows follow its last row as a chain would, their KV goes
        to its own slots past its rows (the caller reserved them; never read as its keys, and
        overwritten when its tokens come), and their logits are not read. Pad sequences (up to
        ``size``) are empty caches at ``scratch``: all alike, so their shared slots get the same KV."""
        trees = trees + [None] * (self.size - len(caches))
        past, base = (t[:, None] for t in padded(caches, self.size, scratch))
        row = torch.arange(self.width)[None, :]
        key = torch.arange(self.keys)[None, None, :]
        staging.copy_into(self.write, (base + past + row).flatten())  # (rows stored in order, as eagerly)
        staging.copy_into(self.gather, (base + torch.where(key[0] < past + self.width, key[0], 0)).flatten())
        depth = torch.stack([row[0] if t is None else torch.cat((torch.tensor(t.depth), row[0, len(t.depth):]))
                             for t in trees])
        pos = (past + depth)[:, :, None]  # [size, width, 1]
        # (causal: a row sees the keys before its slot; a real row never sees a pad row's slot, and
        # every pad row sees some key, so no row's softmax is over nothing)
        causal = key <= (past + row)[:, :, None]
        for window, mask in self.masks.items():
            allowed = causal.clone() if window is None else causal & (pos - key < window)
            for b, (n, tree) in enumerate(zip(past[:, 0].tolist(), trees)):
                if tree is not None:  # (its rows see the cached keys and their own path)
                    m = len(tree.depth)
                    allowed[b, :m] = False
                    allowed[b, :m, :n + m] = tree.mask(n, window, torch.device("cpu"))
            staging.copy_into(mask, torch.zeros(allowed.shape, dtype=mask.dtype).masked_fill_(~allowed, float("-inf"))[:, None])
        return pos.flatten().float()


class StaticFlashPlan:
    """A step's ``flash.FlashPlan`` in fixed tensors (no token trees): ``size`` sequences of
    ``width`` rows each, padded as ``StaticPlan`` pads them; ``keys``, the most any has (the
    kernel reads each sequence's own count from ``used``)."""

    flash = True
    rows = None

    def __init__(self, chunk: torch.Tensor, size: int, width: int, keys: int) -> None:
        device = chunk.device
        self.chunk, self.size, self.width, self.max_q, self.max_k = chunk, size, width, width, keys
        self.write = torch.zeros(size * width, dtype=torch.long, device=device)
        self.cu_q = torch.arange(0, (size + 1) * width, width, dtype=torch.int32, device=device)
        self.starts = torch.zeros(size + 1, dtype=torch.int32, device=device)
        self.used = torch.zeros(size, dtype=torch.int32, device=device)

    def fill(self, caches: list[KVCache], trees: list[TreeRows | None], scratch: int | None) -> torch.Tensor:
        """``StaticPlan.fill`` for chains: every sequence's ``width`` rows are its keys' last."""
        past, base = padded(caches, self.size, scratch)
        write, _, starts, used = flash.indices(base, past, torch.full_like(past, self.width))
        for dest, src in ((self.write, write), (self.starts, starts), (self.used, used)):
            staging.copy_into(dest, src)
        return (past[:, None] + torch.arange(self.width)[None, :]).flatten().float()


class _PlanOnly:
    """What ``DecoderLayer`` reads of a ``Batch`` when every sequence attends through one plan."""

    rows = None
    apart: list[int] = []

    def __init__(self, plan: StaticPlan | StaticFlashPlan) -> None:
        self.plans = [plan]


class FixedStep:
    """One shape's fixed inputs and the step over them (``run``: eagerly; a graph replays it)."""

    def __init__(self, model: Any, chunk: torch.Tensor, size: int, width: int, keys: int,  # noqa: ANN401 - a CausalLM
                 flash_attention: bool = False) -> None:
        device = chunk.device
        self.model = model
        self.ids = torch.zeros(size * width, dtype=torch.long, device=device)
        self.positions = torch.zeros(size * width, dtype=torch.float32, device=device)
        self.picked = torch.zeros(size * width, dtype=torch.long, device=device)  # (a ragged step's logit rows)
        self.plan = StaticFlashPlan(chunk, size, width, keys) if flash_attention else \
            StaticPlan(chunk, size, width, keys, model.windows, chunk.dtype)
        self.replay: Callable[[], None] | None = None  # the recorded graph's replay, once recorded
        self.graph = None  # (the graph, kept alive with its step)
        self.out: torch.Tensor | None = None  # where a replay leaves the logits

    def fill(self, caches: list[KVCache], new_tokens: list[list[int]] | torch.Tensor,
             trees: list[TreeRows | None], scratch: int | None = None) -> None:
        """Fill the inputs for ``caches``' next rows (``StaticPlan.fill``); pad rows feed token 0."""
        if isinstance(new_tokens, torch.Tensor):  # (one token per sequence: ``width`` is 1)
            self.ids[:len(new_tokens)].copy_(new_tokens)
            if len(new_tokens) < self.plan.size:
                self.ids[len(new_tokens):].zero_()
        else:
            width = self.plan.width
            ids = [t for seq in new_tokens for t in (*seq, *[0] * (width - len(seq)))]
            staging.copy_into(self.ids, torch.tensor(ids + [0] * (self.ids.numel() - len(ids))))
        staging.copy_into(self.positions, self.plan.fill(caches, trees, scratch))

    def logits(self, lengths: list[int], logit_rows: list[int]) -> torch.Tensor:
        """The replayed logits each sequence wants (its last ``logit_rows`` real rows), in order."""
        width = self.plan.width
        if len(lengths) == self.plan.size and all(n == width for n in lengths) and all(r == width for r in logit_rows):
            return self.out.clone()  # (the next replay overwrites ``out``)
        rows = [b * width + n - want + r for b, (n, want) in enumerate(zip(lengths, logit_rows)) for r in range(want)]
        picked = self.picked[:len(rows)]
        staging.copy_into(picked, torch.tensor(rows))
        return self.out.index_select(0, picked)

    def run(self) -> torch.Tensor:
        return self.model.compute(self.ids, self.positions, _PlanOnly(self.plan), None)


def record(step: FixedStep, pool: Any) -> Any:  # noqa: ANN401 - a CUDA graph memory pool handle
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


class StepGraphs:
    """A model's recorded steps; ``step`` runs a forward from one when it qualifies.

    At most ``MAX_GRAPHS`` are kept. Batch sizes, widths and key buckets make more shapes than
    that over a deployment's life, so once full, a new shape seen a second time takes the place of
    the one used longest ago (a shape seen once runs eagerly: recording costs a few eager steps,
    so a one-off would cost more recorded than run)."""

    def __init__(self, model: Any, recorder: Callable[[FixedStep, Any], Any] = record) -> None:  # noqa: ANN401
        self.model, self.recorder = model, recorder
        self.steps: OrderedDict[tuple[int, int, int, int, bool], FixedStep] = OrderedDict()  # (least recently used first)
        self.waiting: OrderedDict[tuple[int, int, int, int, bool], None] = OrderedDict()  # shapes seen once while full
        self.pool = None
        self.arena = None  # the KV arena the graphs' chunks belong to
        self.scratch: KVCache | None = None  # the pad sequences' range (in the arena's first chunk)
        self.padding = True  # False once the scratch range could not be had there: batches keep their size
        self.enabled = True
        self.replays = self.recorded = self.evicted = self.eager = 0

    def status(self) -> dict[str, Any]:
        """What a worker reports: graphs kept, steps replayed and run eagerly, recordings, evictions."""
        return {"enabled": self.enabled, "graphs": len(self.steps), "replays": self.replays, "eager": self.eager,
                "recorded": self.recorded, "evicted": self.evicted}

    def capture(self, max_batch: int, widths: tuple[int, ...] = WIDTHS) -> int:
        """Record the graphs of steps of up to ``max_batch`` sequences of each of ``widths`` rows
        over short contexts (the smallest key bucket), as a worker starts, so that its first
        requests replay them instead of waiting for recordings; the narrowest first, at most half
        the cap (the rest is left for the longer contexts met later). Returns the graphs recorded."""
        sizes = sorted({batch_bucket(n) for n in range(1, max_batch + 1)})
        shapes = [(size, width) for width in widths for size in sizes][:MAX_GRAPHS // 2]
        caches = [self.model.new_cache(capacity=MAX_WIDTH) for _ in range(max(sizes))]
        before, counts = self.recorded, (self.replays, self.eager)
        with torch.inference_mode():
            for size, width in shapes:
                if not self.enabled:
                    break
                self.step(caches[:size], [width] * size, [1] * size, [[0] * width] * size, None)
        self.replays, self.eager = counts  # (recordings, not steps served)
        for cache in caches:
            cache.release()
        return self.recorded - before

    def step(self, caches: list[KVCache], lengths: list[int], logit_rows: list[int],
             new_tokens: list[list[int]] | torch.Tensor, parents: list[list[int] | None] | None) -> torch.Tensor | None:
        """The logits of this forward from a graph ([rows, vocab]), or None where it does not
        qualify (the caller runs it eagerly). The caches must have room for the new tokens.
        Sequences with fewer new rows than the graph's width are padded to it (``StaticPlan.fill``),
        so a round's first draft step (each request feeds what it committed) and verify blocks of
        mixed k take a graph too; a batch of fewer sequences than the graph's is padded with pad
        sequences."""
        if not self.enabled or self.model.batch_invariant:
            return None
        self.eager += 1  # (until it replays)
        if max(lengths) > MAX_WIDTH or min(lengths) < 1:
            return None
        width = width_bucket(max(lengths))
        if any(n < width for n in lengths):
            for cache in caches:  # (room for the pad rows' KV: past each sequence's own rows)
                cache.reserve(cache.length + width)
        lease = caches[0].lease
        if lease is None or any(c.lease is None or c.arena is not caches[0].arena or c.lease.chunk != lease.chunk
                                for c in caches):
            return None
        if caches[0].arena is not self.arena:  # (a new arena: the graphs read and wrote the old one's chunks)
            self.steps.clear()
            self.waiting.clear()
            self.arena, self.scratch, self.padding = caches[0].arena, None, True
        size = batch_bucket(len(caches))
        scratch = self._scratch(caches[0]) if size > len(caches) and lease.chunk == 0 else None
        if scratch is None:
            size = len(caches)
        trees = [TreeRows.of(p) for p in parents] if parents else [None] * len(caches)
        flash_attention = self.model.uses_flash() and all(t is None for t in trees)
        shape = (lease.chunk, size, width, key_bucket(max(c.length for c in caches) + width), flash_attention)
        step = self.steps.get(shape)
        if step is not None:
            self.steps.move_to_end(shape)
        else:
            if len(self.steps) >= MAX_GRAPHS:
                if shape not in self.waiting:  # (its first sighting while full: eagerly, remembered)
                    self.waiting[shape] = None
                    while len(self.waiting) > MAX_GRAPHS:
                        self.waiting.popitem(last=False)
                    return None
                del self.waiting[shape]
                self.steps.popitem(last=False)  # (the graph it frees goes back to the shared pool)
                self.evicted += 1
            step = self.steps[shape] = FixedStep(self.model, caches[0].arena.chunk(lease), *shape[1:])
        step.fill(caches, new_tokens, trees, scratch)
        if step.replay is None:  # (recording replays it once: its logits are in ``out`` already)
            if not self._record(step):
                return None
            self.recorded += 1
        else:
            step.replay()
        self.replays += 1
        self.eager -= 1
        return step.logits(lengths, logit_rows)

    def _scratch(self, like: KVCache) -> int | None:
        """The first row of the pad sequences' range in the arena's first chunk, leased once (the
        first step comes while the chunk has room); None if it landed elsewhere."""
        if self.scratch is None and self.padding:
            scratch = self.model.new_cache(capacity=MAX_WIDTH)
            if scratch.arena is like.arena and scratch.lease.chunk == 0:
                self.scratch = scratch
            else:  # (the first chunk is full: batches run at their own size)
                scratch.release()
                self.padding = False
        return None if self.scratch is None else self.scratch.lease.base

    def _record(self, step: FixedStep) -> bool:
        """Record ``step``'s graph and check one replay against the eager step, bit for bit. A
        FlashAttention step that fails turns FlashAttention off for the model and graphs stay on
        (their masked steps ran on GPUs before it); any other turns graphs off."""
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
        self.steps.clear()
        if step.plan.flash:
            log.warning("FlashAttention off for this model: %s in a CUDA graph; attention runs through SDPA", reason)
            self.model.flash_attention = False
            return False
        log.warning("CUDA graphs off for this model: %s; decode steps run eagerly", reason)
        self.enabled = False
        return False
