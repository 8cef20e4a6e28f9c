"""The per-request KV buffer, and the one place its layout is defined.

Layout: one contiguous range of rows per request per role,

    buf[position, layer, kv (0 = K, 1 = V), kv_head, head_dim]

Position-major on purpose: the KV of positions ``a..b`` (all layers) is the single
contiguous slice ``buf[a:b]``, so rolling back is a length change and handing positions to
another worker is one transfer, not one per layer. Attention gathers a layer's keys from
these rows (one gather for the batch, ``models.batch``), which costs a copy per forward but
nothing on the wire.

A model's caches are ranges of one pool of rows (``kv/arena.py``), so a forward can read a
whole batch's KV through one slot index; a cache made without an arena (or moved into a shared
file, ``share``) has a tensor of its own, and the forward reads it apart.

Each cache also records the token ids whose KV it holds, so a worker can find by itself how
much of a task's token sequence it already has (the longest common prefix) and roll back the
rest: KV at position i depends only on tokens 0..i.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

from nebula_flow.kv.arena import KVArena

log = logging.getLogger("nebula_flow.kv")

# A position whose KV a forward computed from a token still on the device (a draft step's pick),
# until the host learns it (``KVCache.settle``); no token id is negative, so no prefix matches it.
PENDING = -1


class KVCache:
    """KV of one request for one model; grows by doubling, rolls back by length."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, *,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", capacity: int = 64,
        arena: KVArena | None = None,
    ) -> None:
        self.row_shape = (num_layers, 2, num_kv_heads, head_dim)
        self.ready = None  # a GPU cache: the event of a copy into it still in flight (``kv/device_copy.py``)
        self.arena, self.lease = arena, None  # the pool its rows are a range of (None: a tensor of its own)
        self._finalizer = None
        if arena is not None:
            self._take_lease(capacity)
        else:
            self.buf = torch.empty((capacity, *self.row_shape), dtype=dtype, device=device)
        self._row_bytes = self.buf.element_size() * int(np.prod(self.row_shape))
        self.tokens: list[int] = []
        self.salt: str | None = None  # its request's cache_salt: only caches of the same salt share prefixes (kv/store.py)
        # its request's prompt length, where the worker knows it: a batch-invariant model that has no
        # runs computes positions before it in blocks (``models.rows.BlockCall``; 0: every row alone)
        self.prompt_len = 0
        self.shared = None  # kv/shm.py SharedRows when peers on this host read this cache directly
        self.shared_path = None
        self.owner = 0  # the request id its shared file names
        self.pool = None  # kv/shm.py FilePool its shared file comes from and goes back to
        self._served_at = float("-inf")

    @property
    def served_at(self) -> float:
        """When a network peer was last sent rows from it (monotonic): its memory is not reused
        for a while after (``FilePool``, ``KVArena``)."""
        return self._served_at

    @served_at.setter
    def served_at(self, when: float) -> None:
        if self.lease is not None:
            self.lease.served_at = when
        self._served_at = when

    def _take_lease(self, rows: int) -> None:
        """Move into a fresh range of the arena of at least ``rows`` rows (the valid prefix copied)."""
        lease = self.arena.lease(rows)
        with torch.inference_mode():  # (inside a forward or not: the chunk itself is a normal tensor)
            rows_view = self.arena.rows(lease)
            if self.lease is not None:
                rows_view[: self.length] = self.buf[: self.length]
        self._drop_lease()
        self.buf, self.lease = rows_view, lease
        # (a cache dropped without release, e.g. an evicted fork, still gives its range back)
        self._finalizer = weakref.finalize(self, self.arena.give, lease)

    def await_rows(self) -> None:
        """Order the current stream after a copy into this cache still in flight (a GPU pull,
        ``kv/device_copy.py``): before a forward reads it or its range is handed on."""
        if self.ready is not None:
            torch.cuda.current_stream(self.buf.device).wait_event(self.ready)
            self.ready = None

    def _drop_lease(self) -> None:
        self.await_rows()
        if self._finalizer is not None:
            self._finalizer()  # (gives the range back, once)
            self._finalizer = self.lease = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def row_bytes(self) -> int:
        """Bytes of one position (all layers, K and V)."""
        return self._row_bytes

    @property
    def allocated_bytes(self) -> int:
        return self.buf.element_size() * self.buf.numel()

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions, keeping the valid prefix."""
        cap = self.buf.shape[0]
        if total <= cap:
            return
        while cap < total:
            cap *= 2
        self.await_rows()  # (the valid prefix is copied over on this stream)
        if self.shared_path is not None and self._share_rows(cap):
            return
        if self.lease is not None:
            if self.arena.extend(self.lease, cap):  # (the rows after it were free: no copy)
                with torch.inference_mode():
                    self.buf = self.arena.rows(self.lease)
            else:
                self._take_lease(cap)
            return
        grown = torch.empty((cap, *self.row_shape), dtype=self.buf.dtype, device=self.buf.device)
        grown[: self.length] = self.buf[: self.length]
        self.buf = grown

    def share(self, path, owner: int, pool=None, least: int | None = None) -> None:  # noqa: ANN001 - a pathlib.Path, a kv/shm.py FilePool
        """Keep this cache (of request ``owner``) in a file at ``path`` that peers on this host
        map (kv/shm.py): a file from ``pool`` with room for ``least`` positions or more when it
        has one (a new file gets this cache's capacity)."""
        if self.buf.device.type != "cpu":
            raise ValueError("shared-memory KV is for CPU workers")
        self.shared_path, self.owner, self.pool = path, owner, pool
        self._share_rows(self.buf.shape[0], least)

    def _share_rows(self, capacity: int, least: int | None = None) -> bool:
        """Move this cache into a shared file of ``capacity`` rows (a pooled one of ``least`` to
        twice ``capacity``). If the shared-memory folder is full, stop sharing instead (peers then
        recompute this request) and return False."""
        from nebula_flow.kv.shm import SharedMemoryFull, SharedRows

        rows = None
        if self.pool is not None:
            least = max(least or capacity, self.length)
            rows = self.pool.take(self.shared_path, self.owner, least, max(2 * capacity, capacity + 256))
        try:
            if rows is None:
                rows = SharedRows(self.shared_path, capacity, self.row_shape, self.buf.dtype, self.owner)
        except SharedMemoryFull as exc:
            if self.pool is not None and self.pool.entries:
                self.pool.clear()  # finished requests' files give their memory back first
                return self._share_rows(capacity, least)
            log.warning("%s; keeping this request's KV private", exc)
            self.unshare()  # a stale, shorter file must not be read, mapped or not
            return False
        rows.rows[: self.length] = self.buf[: self.length]
        rows.publish(self.tokens)
        rows.install()
        if self.shared is not None:
            self.shared.retire()  # readers that kept the old file mapped move to the new one
        self._drop_lease()  # (a shared cache lives in its file, not in the arena)
        self.buf, self.shared = rows.rows, rows
        return True

    def unshare(self) -> None:
        """Stop sharing this cache: peers that kept its file mapped let go of it (and its
        memory), and the path goes. The rows stay readable here."""
        if self.shared is not None:
            self.shared.retire()
        if self.shared_path is not None:
            self.shared_path.unlink(missing_ok=True)
        self.shared_path = self.shared = None

    def release(self) -> None:
        """This worker is done with the request: its shared file goes back to the pool (or is
        deleted). The cache is empty afterwards; its rows may soon hold another request's KV."""
        if self.shared is not None and self.pool is not None:
            self.pool.put(self.shared, self.served_at)
            self.shared_path = self.shared = None
            self.buf = self.buf[:0]
            self.tokens = []
        elif self.lease is not None:
            self._drop_lease()
            self.buf = self.buf[:0]
            self.tokens = []
        else:
            self.unshare()

    def prefault(self, positions: int) -> None:
        """Have the pages of the first ``positions`` rows in before rows are copied into them
        (shared caches: a new file's pages otherwise fault in one at a time, during the copy)."""
        if self.shared is not None:
            from nebula_flow.kv.shm import populate

            populate(self.buf.data_ptr(), min(positions, self.buf.shape[0]) * self.row_bytes)

    def publish(self) -> None:
        """Let peers see the positions held now (shared caches only)."""
        if self.shared is not None:
            self.shared.publish(self.tokens)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def settle(self, position: int, tokens: list[int]) -> None:
        """The tokens at ``position``, ``position + 1``, ..., fed to a forward from the device
        (``PENDING`` until now), as the host learned them."""
        self.tokens[position:position + len(tokens)] = tokens

    def adopt(self, slots: list[int], position: int) -> None:
        """Keep one path of a token tree (``CausalLM.forward``'s ``parents``): the tokens computed
        at ``slots`` (increasing, each at or after its place) become positions ``position``,
        ``position + 1``, ...; everything after them is dropped."""
        with torch.inference_mode():  # a buffer grown inside a forward is an inference tensor
            for j, slot in enumerate(slots):
                if slot != position + j:
                    self.buf[position + j] = self.buf[slot]
                    self.tokens[position + j] = self.tokens[slot]
        del self.tokens[position + len(slots):]

    def copy_rows(self, source: KVCache, start: int, end: int) -> None:
        """Positions ``start..end`` of ``source`` (another cache of the same model) into this
        cache's rows, which must have room for them (``reserve``)."""
        with torch.inference_mode():  # (a buffer grown inside a forward is an inference tensor)
            self.buf[start:end] = source.buf[start:end]

    def common_prefix(self, tokens: np.ndarray) -> int:
        """How many leading positions of ``tokens`` this cache already holds."""
        n = min(len(tokens), self.length)
        if n == 0:
            return 0
        if self.tokens[:n] == tokens[:n].tolist():  # the usual case; a list compare is cheapest between batches
            return n
        held = np.asarray(self.tokens[:n], dtype=np.int64)
        diff = np.nonzero(held != tokens[:n])[0]
        return int(diff[0]) if len(diff) else n

    def layer_kv(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for positions ``0..end``, shaped [kv_heads, end, head_dim]."""
        rows = self.buf[:end, layer]
        return rows[:, 0].transpose(0, 1), rows[:, 1].transpose(0, 1)

    def export(self, start: int, end: int) -> torch.Tensor:
        """Positions ``start..end`` as one contiguous tensor (for a peer transfer)."""
        if self.ready is not None:  # (rows pulled a moment ago, still landing: wait for that copy alone)
            self.ready.synchronize()
        return self.buf[start:end]
