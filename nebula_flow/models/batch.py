"""One forward's batch of sequences, and how its attention runs.

A forward takes a ragged batch: each sequence brings its cache and its new rows (a prefill chunk,
a decode step, a verify block, a token tree). ``Batch`` works out once per forward what every
layer needs: the rows each sequence owns, its token tree (``TreeRows``), and, for the caches that
are ranges of one arena chunk (``kv/arena.py``; a plan per chunk), the plan to attend to all of
them in one call per layer (``GroupPlan``): the slots where the new rows' KV goes, the slots each sequence's keys come
from (padded to the longest), and one mask for the whole batch (causal, tree, window, padding).
On a GPU each layer then costs a fixed handful of kernel launches whatever the batch; per sequence
it cost a dozen per sequence per layer (``nebula-flow profile --ops`` counts them). On CUDA in
bf16/fp16 the sequences of the chunk that are not token trees attend through FlashAttention-2
instead (``models.flash.FlashPlan``): keys read in place, no padding, no mask, prefills included.

Rows that stay apart and attend per sequence: long prefill chunks (padding every sequence to
their length would waste more than the launches cost; FlashAttention takes them) and caches
outside the arena (shared files).
A batch-invariant model (``models.invariant``) attends otherwise: each row as a problem of its own,
rows of one problem size in one call (``models.rows``).
"""

from __future__ import annotations

import torch

from nebula_flow.kv.cache import KVCache
from nebula_flow.models import staging
from nebula_flow.models.flash import FlashPlan
from nebula_flow.models.rows import RowPlan

GROUP_MAX_ROWS = 64  # a sequence with more new rows than this attends apart (a prefill chunk)


class TreeRows:
    """The new rows of one sequence when they form a token tree (``CausalLM.forward``'s
    ``parents``): row i's parent among the new rows (-1: the last cached position), its depth
    (its position is the cache length plus its depth) and the rows it sees, itself included, in
    order of depth (a chain's row i sees rows 0..i)."""

    def __init__(self, parents: list[int]) -> None:
        self.depth: list[int] = []
        self.sees: list[list[int]] = []
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"row {i}'s parent {p} must be an earlier row or -1")
            self.depth.append(0 if p < 0 else self.depth[p] + 1)
            self.sees.append((self.sees[p] if p >= 0 else []) + [i])
        self._masks: dict[tuple, torch.Tensor] = {}  # every layer of one forward uses the same masks

    def path_slots(self, row: int, past: int, begin: int) -> list[int]:
        """The new rows' slots row ``row`` attends to after the cached ones (``begin..past``), in
        order: its path's rows within the window that ``begin`` starts, itself last."""
        return [past + r for r in self.sees[row] if past + self.depth[r] >= begin]

    def mask(self, past: int, window: int | None, device: torch.device) -> torch.Tensor:
        """``attention_mask`` for these rows after ``past`` cached positions, built once."""
        key = (past, window, device)
        if key not in self._masks:
            n = len(self.depth)
            sees = torch.zeros(n, n, dtype=torch.bool)
            for i, rows in enumerate(self.sees):
                sees[i, rows] = True
            allowed = torch.cat((torch.ones(n, past, dtype=torch.bool), sees), dim=1)
            if window is not None:
                depth = torch.tensor(self.depth) + past
                k_pos = torch.cat((torch.arange(past), depth))
                allowed &= depth[:, None] - k_pos[None, :] < window
            self._masks[key] = staging.to_device(allowed, device)
        return self._masks[key]

    @staticmethod
    def of(parents: list[int] | None) -> TreeRows | None:
        """None (a plain chain: the fast paths) unless ``parents`` branch."""
        if parents is None or all(p == i - 1 for i, p in enumerate(parents)):
            return None
        return TreeRows(parents)


def attention_mask(past: int, n: int, window: int | None, device: torch.device,
                    tree: TreeRows | None = None) -> torch.Tensor:
    """Boolean [n, past+n] mask over cache slots: query i sees keys j <= past+i (and within the
    window). With a ``tree`` a new row sees the cached slots and the new rows of its own path
    (``TreeRows.sees``), and positions count by depth."""
    if tree is not None:
        return tree.mask(past, window, device)
    q_slot = torch.arange(past, past + n, device=device)[:, None]
    k_slot = torch.arange(past + n, device=device)[None, :]
    allowed = k_slot <= q_slot
    if window is not None:
        allowed &= q_slot - k_slot < window
    return allowed


class GroupPlan:
    """How the grouped sequences of a batch attend in one call per layer (see the module's doc).

    ``rows``: the grouped sequences' rows among the forward's rows (None: all of them, in order);
    ``padded``: for each of the B x ``width`` query slots, its row among the grouped rows (None:
    every sequence has ``width`` rows); ``real``: the query slots holding real rows, in order."""

    flash = False

    def __init__(self, batch: Batch, seqs: list[int], chunk: torch.Tensor, device: torch.device) -> None:
        self.chunk = chunk  # the arena tensor [slots, layer, 2, kv_heads, head_dim]
        caches = [batch.caches[i] for i in seqs]
        lengths = [batch.lengths[i] for i in seqs]
        trees = [batch.trees[i] for i in seqs]
        pasts = [c.length for c in caches]
        ends = [p + n for p, n in zip(pasts, lengths)]
        self.size, self.width, self.keys = len(seqs), max(lengths), max(ends)
        bases = torch.tensor([c.lease.base for c in caches])
        past_t, end_t, n_t = torch.tensor(pasts), torch.tensor(ends), torch.tensor(lengths)
        j = torch.arange(self.width)
        real = j[None, :] < n_t[:, None]  # [B, width]: which query slots hold a row
        self.write = staging.to_device((bases + past_t)[:, None].add(j[None, :])[real], device)  # new rows' slots, in row order
        key = torch.arange(self.keys)
        self.gather = staging.to_device((bases[:, None] + torch.where(key[None, :] < end_t[:, None], key[None, :], 0)).flatten(), device)
        uniform = all(n == self.width for n in lengths)
        self.padded = None if uniform else staging.to_device(torch.where(real, (n_t.cumsum(0) - n_t)[:, None] + j[None, :], 0).flatten(), device)
        self.real = None if uniform else staging.to_device(real.flatten().nonzero().flatten(), device)
        self.rows = batch.rows_of(seqs, device)
        self._plain = (pasts, lengths, trees, real)
        self._masks: dict[int | None, torch.Tensor | None] = {}
        self.device, self.dtype = device, chunk.dtype

    def mask(self, window: int | None) -> torch.Tensor | None:
        """The [B, 1, width, keys] mask of the layers with ``window`` (built once per forward)."""
        if window not in self._masks:
            self._masks[window] = self._build_mask(window)
        return self._masks[window]

    def _build_mask(self, window: int | None) -> torch.Tensor | None:
        pasts, lengths, trees, real = self._plain
        if self.width == 1 and window is None and all(p + 1 == self.keys for p in pasts):
            return None  # (decode steps at one length: every key is seen)
        key = torch.arange(self.keys)[None, None, :]
        pos = torch.tensor(pasts)[:, None, None] + torch.arange(self.width)[None, :, None]  # [B, width, 1]
        allowed = key <= pos
        if window is not None:
            allowed &= pos - key < window
        for b, (past, n, tree) in enumerate(zip(pasts, lengths, trees)):
            if tree is not None:
                allowed[b, :n] = False
                allowed[b, :n, :past + n] = tree.mask(past, window, torch.device("cpu"))
        allowed[~real] = key[0] == 0  # (a padding query sees one key: no empty softmax)
        # (additive: attention would turn a boolean mask into this in every layer)
        return staging.to_device(torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))[:, None], self.device)


class Batch:
    """One forward's sequences: caches, new-row counts, trees, and the plans by which groups of them
    attend in one call per layer (``plans``; ``apart``: the sequences that attend one by one)."""

    def __init__(self, caches: list[KVCache], lengths: list[int], parents: list[list[int] | None] | None,
                 device: torch.device, group: bool, invariant_windows: set[int | None] | None = None,
                 flash: bool = False, invariant_block: int | None = None,
                 invariant_dtype: torch.dtype = torch.float32) -> None:
        """``invariant_windows``: the model's layers' windows, for a batch-invariant model (every row
        attends as its own problem, ``models.rows``; ``invariant_block``: its runs' query blocks,
        ``invariant_dtype``: the dtype they attend in);
        else ``group``: attend in one call where possible, through FlashAttention (``flash``) where
        it applies."""
        self.caches, self.lengths = caches, lengths
        self.trees = [TreeRows.of(p) for p in parents] if parents else [None] * len(caches)
        self.starts, at = [], 0
        for n in lengths:
            self.starts.append(at)
            at += n
        self.plans: list[GroupPlan | FlashPlan] = []
        self.rows: RowPlan | None = None
        self.apart = list(range(len(caches)))
        if invariant_windows is not None:
            self.rows, self.apart = RowPlan(caches, lengths, self.trees, self.starts, invariant_windows, device,
                                              invariant_block, invariant_dtype), []
        elif group:
            self._group(device, flash)

    def rows_of(self, seqs: list[int], device: torch.device) -> torch.Tensor | None:
        """The rows of sequences ``seqs`` among the forward's (None: all of them, in order)."""
        if len(seqs) == len(self.caches):
            return None
        return staging.tensor([r for i in seqs for r in range(self.starts[i], self.starts[i] + self.lengths[i])], device)

    def _group(self, device: torch.device, flash: bool) -> None:
        """Group the sequences by the arena chunk their caches are in (a worker's KV overflows into
        more chunks when its budget is full): in each, through FlashAttention the chains, through
        one masked call the rest (two or more)."""
        by_chunk: dict[tuple[int, int], list[int]] = {}
        for i, (c, n, tree) in enumerate(zip(self.caches, self.lengths, self.trees)):
            if c.lease is not None and ((flash and tree is None) or n <= GROUP_MAX_ROWS):
                by_chunk.setdefault((id(c.arena), c.lease.chunk), []).append(i)
        grouped: set[int] = set()
        for seqs in by_chunk.values():
            cache = self.caches[seqs[0]]
            tensor = cache.arena.chunk(cache.lease)
            chains = [i for i in seqs if flash and self.trees[i] is None]
            if chains:
                self.plans.append(FlashPlan(tensor, [self.caches[i].lease.base for i in chains],
                                            [self.caches[i].length for i in chains], [self.lengths[i] for i in chains],
                                            self.rows_of(chains, device), device))
                grouped.update(chains)
            masked = [i for i in seqs if i not in grouped and self.lengths[i] <= GROUP_MAX_ROWS]
            if len(masked) >= 2:
                self.plans.append(GroupPlan(self, masked, tensor, device))
                grouped.update(masked)
        self.apart = [i for i in range(len(self.caches)) if i not in grouped]
