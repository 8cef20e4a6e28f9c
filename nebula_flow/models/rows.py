"""Batch-invariant attention in few calls: every query row solves the same attention problem
whatever it is batched with, and rows that solve problems of one size share a call.

Batch invariance (``models.invariant``) needs a position's attention output to have the same
bits in a decode step, a verify block, a prefill and any batch. Each row is therefore posed as a
problem of its own: one query row against its keys (its cached prefix and, in a token tree, its
path's rows, in that order) padded with masked keys up to a multiple of ``BUCKET``. That problem
depends on the row alone. Rows whose padded key counts are equal are then stacked as the batch
dimension of one attention call: the CPU kernel computes each (row, head) of a batch on its own,
with the same code whatever the batch's size or thread count (checked bit for bit by
``tests/test_batch_invariant.py``), so stacking changes no bit. Attention runs in fp32 (on CPUs
a one-row fp32 call was ~5x faster than a bf16 one, and it is more exact).

Rows of one sequence whose keys start at its first slot (a verify block's, a prefill's) read one
view of its cache, broadcast over the rows (no copy; the padding past the sequence's end is zeroed
once per forward so masked keys are finite); the other rows of a size (a batch of decodes, token
trees, sliding windows) gather their keys into one call through one slot index.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from nebula_flow.kv.cache import KVCache
from nebula_flow.models import staging

BUCKET = 32  # a row's keys are padded to a multiple of this (its problem's size)


def padded(keys: int) -> int:
    return -(-keys // BUCKET) * BUCKET


class RowGroup:
    """Rows whose problems have ``keys`` padded keys and one source of KV rows, in one call."""

    def __init__(self, rows: list[int], keys: int, source: torch.Tensor, spans: list[tuple[int, int, list[int]]],
                 own: list[int], first: int | None, device: torch.device) -> None:
        self.keys, self.source, self.size = keys, source, len(rows)
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
        seen = torch.arange(keys)[None, :] < torch.tensor(lengths)[:, None]
        self.mask = staging.to_device(torch.zeros(len(rows), 1, 1, keys).masked_fill_(~seen[:, None, None, :], float("-inf")), device)

    def kv(self, layer: int, wide: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        """[rows, keys, 2, kv_heads, head_dim] in fp32: each row's (padded) keys and values (``wide``:
        each (source, start)'s rows this layer's groups read as one view, made fp32 once)."""
        if self.gather is None:
            return wide[id(self.source), self.start][:self.keys][None].expand(self.size, -1, -1, -1, -1)
        rows = self.source[:, layer]
        return rows.index_select(0, self.gather).float().view(self.size, self.keys, *rows.shape[1:])


class RowPlan:
    """A batch-invariant forward's attention: where each sequence's new KV goes and each window's
    row groups (built once per forward)."""

    def __init__(self, caches: list[KVCache], lengths: list[int], trees: list, starts: list[int],
                 windows: set[int | None], device: torch.device) -> None:
        self.device = device
        self._seqs = []
        sources: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for i, (cache, n, tree) in enumerate(zip(caches, lengths, trees)):
            past = cache.length
            reach = padded(past + n)  # (its keys are read up to here: rows past its end must be finite)
            cache.reserve(reach)
            source, base = (cache.arena.chunk(cache.lease), cache.lease.base) if cache.lease is not None else (cache.buf, 0)
            with torch.inference_mode():
                cache.buf[past + n:reach].zero_()
            self._seqs.append((source, base, past, n, tree, starts[i]))
            _, slots, rows = sources.setdefault(id(source), (source, [], []))
            slots.extend(range(base + past, base + past + n))
            rows.extend(range(starts[i], starts[i] + n))
        self.writes = [(source, staging.tensor(slots, device),
                        None if len(sources) == 1 else staging.tensor(rows, device))
                       for source, slots, rows in sources.values()]
        self.total = sum(lengths)
        self.groups = {w: self._groups(w) for w in windows}
        # per window, the rows of each (source, start) its groups read as one view, and how many: made fp32
        # once a layer (a long prefill's groups read ever longer views of one sequence: converting each
        # group's apart copied the prefix again for every 32 rows)
        self.views: dict[int | None, dict[tuple[int, int], tuple[torch.Tensor, int, int]]] = {}
        for w, groups in self.groups.items():
            views = self.views[w] = {}
            for g in groups:
                if g.gather is None:
                    key = (id(g.source), g.start)
                    views[key] = (g.source, g.start, max(g.keys, views.get(key, (None, 0, 0))[2]))

    def _groups(self, window: int | None) -> list[RowGroup]:
        by_size: dict[tuple[int, int], list] = defaultdict(list)
        for source, base, past, n, tree, start in self._seqs:
            for j in range(n):
                pos = past + (tree.depth[j] if tree else j)
                begin = max(0, pos + 1 - window) if window else 0
                if tree is None or tree.sees[j] == list(range(j + 1)):  # its keys: one run of slots
                    span = (base + begin, pos + 1 - begin, [])
                else:  # the cached prefix, then its path's rows
                    span = (base + begin, max(0, past - begin), [base + s for s in tree.path_slots(j, past, begin)])
                by_size[id(source), padded(span[1] + len(span[2]))].append((start + j, span, base + past + j, source, base))
        groups = []
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
                groups.append(RowGroup([m[0] for m in part], keys, part[0][3], [m[1] for m in part],
                                       [m[2] for m in part], bases.pop() if len(bases) == 1 else None, self.device))
        return groups


def attend(plan: RowPlan, layer: int, window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           heads: int, kv_heads: int) -> torch.Tensor:
    """The batch-invariant attention of every row of a forward at ``layer``: the new KV written,
    then one fp32 call per row group. Returns [rows, heads * head_dim] in ``q``'s dtype."""
    new = torch.stack((k, v), 1)
    for source, slots, rows in plan.writes:
        source[:, layer].index_copy_(0, slots, new if rows is None else new.index_select(0, rows))
    q32 = q.float()
    hd = q.shape[-1]
    out = q32.new_empty(plan.total, heads * hd)
    wide = {key: source[start:start + keys, layer].float() for key, (source, start, keys) in plan.views[window].items()}
    for g in plan.groups[window]:
        kv = g.kv(layer, wide)
        o = torch.nn.functional.scaled_dot_product_attention(
            q32.index_select(0, g.rows)[:, :, None], kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2),
            attn_mask=g.mask, enable_gqa=heads != kv_heads)
        out.index_copy_(0, g.rows, o.reshape(g.size, heads * hd))
    return out.to(q.dtype)
