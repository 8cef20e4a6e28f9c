"""Batch-invariant attention in few calls: every query row solves the same attention problem
whatever it is batched with, and rows that solve problems of one size share a call.

Batch invariance (``models.invariant``) needs a position's attention output to have the same
bits in a decode step, a verify block, a prefill and any batch. Each row is therefore posed as a
problem of its own: one query row against its keys (its cached prefix and, in a token tree, its
path's rows, in that order) padded with masked keys up to a multiple of ``BUCKET``. That problem
depends on the row alone. Rows whose padded key counts are equal are then stacked as the batch
dimension of one attention call: the CPU kernel computes each (row, head) of a batch on its own,
with the same code whatever the batch's size or thread count (checked bit for bit by
``tests/test_batch_invariant.py``), so stacking changes no bit.

On a CPU, attention runs in the model's dtype where the probe (:func:`attention_rules`) finds that
its kernel keeps these rules there (bf16 on CPUs: ~2.3x faster than fp32 in a prefill's calls, and
faster for decode rows too, where each row's query block is its heads that share a KV head), else
in fp32. bf16's rounding of the output hides most sums made in another order, so in bf16 the
probe also poses problems whose sums cancel, where such a sum shows.

Runs: a prefill's or a verify block's rows (one sequence's rows whose keys run from its first
slot) attend as matrix products, in calls of up to ``RUN_ROWS`` query rows against the keys of the
call's last row (padded), masked per row. Posed one row at a time, a 2,048-token prefill's
attention was ~6x HF's time on a CPU (GEMV shaped, at a few GFLOP/s). A row keeps its bits in a
run because of what torch's CPU kernel does with shapes (measured with torch 2.13 on AVX-512):

* it gives a row the same bits in any query block of at least 3 rows (6 for 128-wide heads);
  blocks of 1 or 2 rows, and the 256-row blocks of a call of 768 rows or more, round otherwise;
* masked keys past a row's own add nothing, except that the kernel takes keys in blocks of 512
  and sums a block of more than 384 keys in two halves (where they meet depends on the block's
  size).

So every call gives each row a query block of at least ``block`` rows (a row alone, with the heads
that share its KV head, is padded with zero queries where they are fewer; a call's last short
block too), and run calls are cut where a row's own problem would sum its last block otherwise
(``_next_cut``): a row whose last key is in the first 384 of a 512-key block is in a call whose
keys end there too (one pass, as in its problem); a row past them is in a call of its own
``BUCKET`` of keys (the same block size, so the same halves) or one that fills its block (two
halves of 256, as in its problem, which fills it too). :func:`run_block` finds the block size for
the model's shapes at load and checks all of this; where no size keeps the bits, runs attend row
by row (``RowPlan(block=None)``).

Rows of one sequence whose keys start at its first slot read one view of its cache (no copy; the
padding past the sequence's end is zeroed once per forward so masked keys are finite); the other
rows of a size (a batch of decodes, token trees, sliding windows) gather their keys into one call
through one slot index.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.nn.functional as F

from nebula_flow.kv.cache import KVCache
from nebula_flow.models import staging

BUCKET = 32  # a row's keys are padded to a multiple of this (its problem's size)
RUN_ROWS = 256  # query rows per call of a run (measured: fewer masked keys than with 512, as fast as 128)
BLOCKS = range(2, 9)  # the query block sizes ``run_block`` tries (torch blocks a call's rows by 32 or 64)
KEY_BLOCK = 512  # torch's kernel takes keys in blocks of this many
WHOLE = 384  # the most keys of a block it sums in one pass (more: in two halves)
OWN_DTYPES = (torch.bfloat16,)  # attended in their own dtype where the probe allows (measured faster than fp32 on CPUs)


def padded(keys: int) -> int:
    return -(-keys // BUCKET) * BUCKET


def _next_cut(position: int) -> int:
    """The first position after ``position`` where a run's call must end: the end of a block's
    first ``WHOLE`` keys, then each ``BUCKET`` of keys after them, up to the next block's ``WHOLE``."""
    base, into = divmod(position, KEY_BLOCK)
    if into < WHOLE:
        return base * KEY_BLOCK + WHOLE
    nxt = (into // BUCKET + 1) * BUCKET
    return base * KEY_BLOCK + (nxt if nxt < KEY_BLOCK else KEY_BLOCK + WHOLE)


def _short_block(rows: int, block: int) -> int:
    """Zero query rows to add so a call of ``rows`` rows has no query block under ``block`` rows."""
    left = rows % BUCKET
    return block - left if 0 < left < block else 0


def _mask(sees: torch.Tensor, keys: int) -> torch.Tensor:
    """An additive mask over ``keys`` keys: row i sees its first ``sees[i]`` keys."""
    seen = torch.arange(keys)[None, :] < sees[:, None]
    return torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))


def attend_rows(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, block: int) -> torch.Tensor:
    """Rows as problems of their own: ``q`` [rows, heads, head_dim] against ``kv`` [rows, keys,
    2, kv_heads, head_dim] with ``mask`` [rows, 1, 1, keys] (all in the attention's dtype). A row
    is one query, so the heads that share a KV head see the same keys: they are one query block,
    padded with zero queries to ``block`` rows where fewer. Returns [rows, heads * head_dim]."""
    rows, heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    group = heads // kv_heads
    q = q.view(rows, kv_heads, group, head_dim)
    if group < block:
        q = torch.cat((q, q.new_zeros(rows, kv_heads, block - group, head_dim)), 2)
    o = F.scaled_dot_product_attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2),
                                       attn_mask=mask.expand(-1, -1, q.shape[2], -1))
    return o[:, :, :group].reshape(rows, heads * head_dim)


def attend_run(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A run's call: ``q`` [rows, heads, head_dim], ``kv`` [keys, 2, kv_heads, head_dim], ``mask``
    [1, 1, rows + pad, keys] (``_short_block``'s zero rows after them, which see the last row's keys).
    Returns [rows, heads * head_dim]."""
    rows = q.shape[0]
    pad = mask.shape[2] - rows
    q = q.transpose(0, 1)[None]
    if pad:
        q = torch.cat((q, q.new_zeros(1, q.shape[1], pad, q.shape[3])), 2)
    o = F.scaled_dot_product_attention(q, kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None],
                                       attn_mask=mask, enable_gqa=q.shape[1] != kv.shape[2])
    return o[0, :, :rows].transpose(0, 1).reshape(rows, -1)


def run_calls(past: int, n: int, block: int) -> list[tuple[int, int, torch.Tensor]]:
    """A run of ``n`` new rows after ``past`` cached ones, as calls (first row, rows, mask) whose
    query blocks have ``block`` rows or more, cut at ``_next_cut``."""
    calls, a = [], 0
    while a < n:
        rows = min(RUN_ROWS, n - a, _next_cut(past + a) - past - a)
        sees = past + a + 1 + torch.arange(rows + _short_block(rows, block)).clamp_(max=rows - 1)
        calls.append((a, rows, _mask(sees, padded(past + a + rows))[None, None]))
        a += rows
    return calls


def attention_rules(heads: int, kv_heads: int, head_dim: int, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> tuple[torch.dtype, int | None]:
    """The dtype a batch-invariant model's rows attend in, and its runs' query blocks (``run_block``;
    None: row by row): on a CPU the model's own ``dtype`` where runs keep the rows' bits in it, else
    fp32. (On CUDA fp32, the attention whose invariance was shown on a GPU; bf16 there is untried.)"""
    if dtype in OWN_DTYPES and device == "cpu" and (block := run_block(heads, kv_heads, head_dim, device, dtype)) is not None:
        return dtype, block
    return torch.float32, run_block(heads, kv_heads, head_dim, device)


@functools.cache
def run_block(heads: int, kv_heads: int, head_dim: int, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> int | None:
    """The fewest rows (of ``BLOCKS``) a query block needs for runs to attend as matrix products
    with these shapes in ``dtype`` and every row keeping the bits of its own problem; None: no such
    size. (Measured on AVX-512 with torch 2.13: in fp32 3 rows for 64-wide heads, 6 for 128-wide;
    in bf16 2 for both: the kernel rounds blocks of fewer another way. On a 2-core AMD EPYC with
    AVX2 only: None in both, so there a prefill's rows attend one by one.)"""
    return next((b for b in BLOCKS if runs_keep_row_bits(heads, kv_heads, head_dim, b, device, dtype)), None)


def _probe_inputs(heads: int, kv_heads: int, head_dim: int, n: int, dtype: torch.dtype) -> list[tuple]:
    """(q, kv) pairs for ``runs_keep_row_bits``: random ones; in a reduced dtype, whose rounding of
    the output hides a sum made in another order, also q = 0 (every weight exactly 1) over values
    that cancel, and q = 1 over keys whose dot products cancel, so such a sum shows."""
    gen = torch.Generator().manual_seed(0)
    q = 3 * torch.randn(n, heads, head_dim, generator=gen)
    kv = torch.randn(KEY_BLOCK * 2, 2, kv_heads, head_dim, generator=gen) * torch.tensor([3.0, 1.0])[:, None, None]
    inputs = [(q, kv)]
    if dtype != torch.float32:
        big_value = 2.0 ** (24 if dtype == torch.bfloat16 else 12)  # (adding a small one to it loses bits)
        big = torch.rand(kv.shape[0], kv_heads, head_dim, generator=gen) < 0.1
        sign = torch.where(torch.rand(big.shape, generator=gen) < 0.5, big_value, -big_value)
        values = kv.clone()  # (q = 0: the values' sum, in whatever order the kernel adds them)
        values[:, 1] = torch.where(big, sign, kv[:, 1])
        half = head_dim // 2  # (q = 1: each key's +-big pairs cancel within its dot product)
        keys, pairs, sign = kv.clone(), big[..., :half], sign[..., :half]
        keys[:, 0, ..., :half] = torch.where(pairs, sign, kv[:, 0, ..., :half])
        keys[:, 0, ..., half:2 * half] = torch.where(pairs, -sign, kv[:, 0, ..., half:2 * half])
        inputs += [(torch.zeros_like(q), values), (torch.ones_like(q), keys)]
    return [(q.to(dtype), kv.to(dtype)) for q, kv in inputs]


@torch.inference_mode()
def runs_keep_row_bits(heads: int, kv_heads: int, head_dim: int, block: int, device: str = "cpu",
                       dtype: torch.dtype = torch.float32) -> bool:
    """True when a run's calls (``attend_run``) give every row the bits its own problem
    (``attend_rows``) gives it, in query blocks of at least ``block`` rows, on inputs of these
    shapes in ``dtype`` (``_probe_inputs``): prefills whose calls end in short blocks or cross 512
    keys, verify blocks after a cached prefix."""
    n = KEY_BLOCK + 212  # (calls of RUN_ROWS rows, cut calls, and keys past 512)
    by_keys: dict[int, list[int]] = defaultdict(list)
    for p in range(n):
        by_keys[padded(p + 1)].append(p)
    for q, kv in _probe_inputs(heads, kv_heads, head_dim, n, dtype):
        q, kv = staging.to_device(q, device), staging.to_device(kv, device)
        alone = q.new_empty(n, heads * head_dim)
        for keys, at in by_keys.items():
            at = torch.tensor(at)
            mask = staging.to_device(_mask(at + 1, keys)[:, None, None].to(dtype), device)
            alone[at] = attend_rows(q[at], kv[:keys].expand(len(at), -1, -1, -1, -1), mask, block)
        for past, rows in ((0, n), (0, 2), (0, 33), (0, 34), (0, 35), (37, 5), (600, 67), (90, 200), (300, 150),
                           (n - 300, 300), (n - 9, 9)):
            for a, m, mask in run_calls(past, rows, block):
                got = attend_run(q[past + a:past + a + m], kv[:mask.shape[-1]], staging.to_device(mask.to(dtype), device))
                if not torch.equal(got, alone[past + a:past + a + m]):
                    return False
    return True


def _in_order(tree, j: int) -> bool:  # noqa: ANN001 - a models.batch TreeRows or None
    """Whether row ``j`` of a sequence (of its token ``tree``, if any) sees exactly the rows before it."""
    return tree is None or tree.sees[j] == list(range(j + 1))


class RowGroup:
    """Rows whose problems have ``keys`` padded keys and one source of KV rows, in one call."""

    def __init__(self, rows: list[int], keys: int, source: torch.Tensor, spans: list[tuple[int, int, list[int]]],
                 own: list[int], first: int | None, block: int, device: torch.device, dtype: torch.dtype) -> None:
        self.keys, self.source, self.size, self.block, self.dtype = keys, source, len(rows), block, dtype
        self.rows = staging.tensor(rows, device)
        lengths = [n + len(extra) for _, n, extra in spans]
        starts = {s for s, _, _ in spans}
        # one view when every row's keys run from the same slot, its sequence's first (the rows
        # it pads over, up to ``RowPlan``'s reach, are finite); else a slot index
        self.start = spans[0][0] if starts == {first} and not any(e for _, _, e in spans) else None
        self.gather = None
        if self.start is None:  # (several starts, or a tree's path rows: one slot index)
            index = torch.tensor(own)[:, None].repeat(1, keys)  # (padding: the row's own slot, written)
            for i, (s, n, extra) in enumerate(spans):
                index[i, :n] = torch.arange(s, s + n)
                index[i, n:n + len(extra)] = torch.tensor(extra, dtype=torch.long)
            self.gather = staging.to_device(index.flatten(), device)
        self.mask = staging.to_device(_mask(torch.tensor(lengths), keys)[:, None, None].to(dtype), device)

    def kv(self, layer: int, wide: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        """[rows, keys, 2, kv_heads, head_dim] in the attention's dtype: each row's (padded) keys and
        values (``wide``: each (source, start)'s rows this layer's groups read as one view, in that
        dtype)."""
        if self.gather is None:
            return wide[id(self.source), self.start][:self.keys][None].expand(self.size, -1, -1, -1, -1)
        rows = self.source[:, layer]
        return rows.index_select(0, self.gather).to(self.dtype).view(self.size, self.keys, *rows.shape[1:])

    def __call__(self, q: torch.Tensor, layer: int, wide: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        return attend_rows(q.index_select(0, self.rows), self.kv(layer, wide), self.mask, self.block)


class RunCall:
    """One call of a run (``run_calls``): ``size`` consecutive rows of a forward from ``first``,
    against the first ``keys`` rows of one view."""

    def __init__(self, source: torch.Tensor, base: int, first: int, mask: torch.Tensor, size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.source, self.start, self.first, self.size, self.keys = source, base, first, size, mask.shape[-1]
        self.rows = staging.tensor(range(first, first + size), device)
        self.mask = staging.to_device(mask.to(dtype), device)

    def __call__(self, q: torch.Tensor, layer: int, wide: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        return attend_run(q[self.first:self.first + self.size], wide[id(self.source), self.start][:self.keys], self.mask)


class BlockCall:
    """A prompt's rows of one aligned block of ``BUCKET`` positions (``32j`` to ``32j + 31``) where
    runs keep no row's bits (``RowPlan(block=None)``): a call of exactly that block's query rows
    (rows this forward does not compute are zeros) against keys ``0..32j + 31``, each row masked to
    its own, in the cache's dtype. The call's shape depends on the block alone, and a row's bits on
    its own query and keys, not on the other rows (checked by ``tests/test_prompt_blocks.py``), so a
    prompt position has the same bits whole, in chunks or batched; it is a form of its own, not the
    row's problem alone, which is why only positions before the request's prompt length take it
    (``KVCache.prompt_len``). The rows as matrix products: ~4x faster than 32 problems of one row."""

    def __init__(self, source: torch.Tensor, base: int, block: int, offset: int, first: int, size: int,
                 device: torch.device) -> None:
        self.source, self.start, self.offset, self.first, self.size = source, base, offset, first, size
        self.keys = (block + 1) * BUCKET
        self.rows = staging.tensor(range(first, first + size), device)
        sees = block * BUCKET + 1 + torch.arange(BUCKET)
        self.mask = staging.to_device(_mask(sees, self.keys)[None, None].to(source.dtype), device)

    def __call__(self, q: torch.Tensor, layer: int, wide: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        block = q.new_zeros((BUCKET, *q.shape[1:]), dtype=self.source.dtype)
        block[self.offset:self.offset + self.size] = q[self.first:self.first + self.size]
        kv = self.source[self.start:self.start + self.keys, layer]  # (its own dtype: a view, no copy)
        return attend_run(block, kv, self.mask)[self.offset:self.offset + self.size].to(q.dtype)


class RowPlan:
    """A batch-invariant forward's attention: where each sequence's new KV goes and each window's
    row groups and run calls (built once per forward). ``block``: the fewest rows of a query block
    where runs attend as matrix products; None: row by row; ``dtype``: the attention's (both from
    ``attention_rules`` on the model's shapes)."""

    def __init__(self, caches: list[KVCache], lengths: list[int], trees: list, starts: list[int],
                 windows: set[int | None], device: torch.device, block: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.device, self.block, self.dtype = device, block, dtype
        self._seqs = []
        sources: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for i, (cache, n, tree) in enumerate(zip(caches, lengths, trees)):
            past = cache.length
            reach = padded(past + n)  # (its keys are read up to here: rows past its end must be finite)
            cache.reserve(reach)
            source, base = (cache.arena.chunk(cache.lease), cache.lease.base) if cache.lease is not None else (cache.buf, 0)
            with torch.inference_mode():
                cache.buf[past + n:reach].zero_()
            self._seqs.append((source, base, past, n, tree, starts[i], cache.prompt_len))
            _, slots, rows = sources.setdefault(id(source), (source, [], []))
            slots.extend(range(base + past, base + past + n))
            rows.extend(range(starts[i], starts[i] + n))
        self.writes = [(source, staging.tensor(slots, device),
                        None if len(sources) == 1 else staging.tensor(rows, device))
                       for source, slots, rows in sources.values()]
        self.total = sum(lengths)
        self.groups = {w: self._groups(w) for w in windows}
        # per window, the rows of each (source, start) its groups read as one view, and how many: in the
        # attention's dtype once a layer (a long prefill's groups read ever longer views of one
        # sequence: converting each group's apart copied the prefix again for every 32 rows)
        self.views: dict[int | None, dict[tuple[int, int], tuple[torch.Tensor, int, int]]] = {}
        for w, groups in self.groups.items():
            views = self.views[w] = {}
            for g in groups:
                if isinstance(g, BlockCall):  # (reads its own view, in the cache's dtype)
                    continue
                if isinstance(g, RunCall) or g.gather is None:
                    key = (id(g.source), g.start)
                    views[key] = (g.source, g.start, max(g.keys, views.get(key, (None, 0, 0))[2]))

    def _groups(self, window: int | None) -> list[RowGroup | RunCall]:
        by_size: dict[tuple[int, int], list] = defaultdict(list)
        calls: list[RowGroup | RunCall] = []
        for source, base, past, n, tree, start, prompt_len in self._seqs:
            # its first rows that see exactly the rows before them, from its first slot, are a run (a
            # prompt or a chain; a prompt before a draft's token tree too): the rest attend alone
            run = n if tree is None else next((j for j in range(n) if not _in_order(tree, j)), n)
            run = run if window is None else min(run, window - past)
            if self.block and run > 1:
                calls.extend(RunCall(source, base, start + a, mask, rows, self.device, self.dtype)
                             for a, rows, mask in run_calls(past, run, self.block))
            elif not self.block and window is None and past < prompt_len:  # (no runs here: a prompt in blocks)
                run, a = min(run, prompt_len - past), 0
                while a < run:  # (each block's rows this forward computes)
                    block, offset = divmod(past + a, BUCKET)
                    size = min(run - a, BUCKET - offset)
                    calls.append(BlockCall(source, base, block, offset, start + a, size, self.device))
                    a += size
            else:
                run = 0
            for j in range(run, n):
                pos = past + (tree.depth[j] if tree else j)
                begin = max(0, pos + 1 - window) if window else 0
                if _in_order(tree, j):  # its keys: one run of slots
                    span = (base + begin, pos + 1 - begin, [])
                else:  # the cached prefix, then its path's rows
                    span = (base + begin, max(0, past - begin), [base + s for s in tree.path_slots(j, past, begin)])
                by_size[id(source), padded(span[1] + len(span[2]))].append((start + j, span, base + past + j, source, base))
        block = self.block or 1  # (a row's query block: as in a run's calls, or alone)
        for (_, keys), members in by_size.items():
            # a sequence with several rows of this size that read one run of its slots from its start
            # (a verify block, a prefill chunk) reads one view for them; the other rows (one per
            # sequence, as in a batch of decodes) gather their keys into one call
            runs: dict[int, list] = defaultdict(list)
            for m in members:
                runs[m[4] if m[1][0] == m[4] and not m[1][2] else -1 - len(runs)].append(m)
            rest = [m for base, run in runs.items() if base < 0 or len(run) == 1 for m in run]
            for part in [run for base, run in runs.items() if base >= 0 and len(run) > 1] + ([rest] if rest else []):
                bases = {m[4] for m in part}
                calls.append(RowGroup([m[0] for m in part], keys, part[0][3], [m[1] for m in part],
                                      [m[2] for m in part], bases.pop() if len(bases) == 1 else None, block, self.device,
                                      self.dtype))
        return calls


def attend(plan: RowPlan, layer: int, window: int | None, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> torch.Tensor:
    """The batch-invariant attention of every row of a forward at ``layer`` (``q`` [rows, heads,
    head_dim]; ``k``, ``v`` [rows, kv_heads, head_dim]): the new KV written, then one call per
    row group or run call, in the plan's dtype. Returns [rows, heads * head_dim] in ``q``'s dtype."""
    new = torch.stack((k, v), 1)
    for source, slots, rows in plan.writes:
        source[:, layer].index_copy_(0, slots, new if rows is None else new.index_select(0, rows))
    qa = q.to(plan.dtype)
    out = qa.new_empty(plan.total, q.shape[1] * q.shape[2])
    wide = {key: source[start:start + keys, layer].to(plan.dtype) for key, (source, start, keys) in plan.views[window].items()}
    for g in plan.groups[window]:
        out.index_copy_(0, g.rows, g(qa, layer, wide))
    return out.to(q.dtype)
