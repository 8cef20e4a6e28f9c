"""One pool of KV rows per model: every request's cache is a range of it.

A worker's requests keep their KV in ranges of one preallocated tensor per model (a chunk the size
of the worker's KV budget; more chunks are added if it is ever full), laid out as ``KVCache`` defines a row. Because every cache of
a batch lives in the same tensor, a forward's attention reads all of them through one slot index
(``models.batch.BatchPlan``): one gather and one attention call per layer for the whole ragged
batch, where per-request tensors needed a call per request per layer. A range stays contiguous,
so a request's positions ``a..b`` are still one slice for the transports (a pull writes into it,
a peer is served a view of it, a rollback is a length change).

Ranges are multiples of ``MIN_ROWS`` rows, the lowest free range that fits first; a range given back
merges with the free ones beside it, and a cache that outgrows its range grows in place where the
rows after it are free (no copy). (A buddy allocator, with ranges of powers of two, held a third
more rows for the same requests: docs/benchmarks.md, "KV rows per position held".) A range
whose rows were sent to a network peer lately is not reused for ``QUARANTINE_S`` (a send may still
read it: the servers send straight from the cache's memory, as ``kv/shm.py``'s ``FilePool``).
Thread-safe: the compute and prefetch threads both make and grow caches.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from nebula_flow.kv.link_fit import MAX_PULL_S

MIN_ROWS = 16  # the smallest range handed out (positions)
# A chunk's size unless the worker's KV budget sets it (``CausalLM.make_kv_arena``): the caches of a
# batch must share a chunk to attend in one call. On a CPU untouched pages cost no memory.
CHUNK_BYTES = 1 << 30
# (as kv/shm.py's POOL_QUARANTINE_S: a send still under way after the longest a puller waits goes to
# a puller that has given up)
QUARANTINE_S = MAX_PULL_S + 1.0


def _rounded(rows: int) -> int:
    """The rows of the smallest range holding ``rows``: a multiple of ``MIN_ROWS``."""
    return max(MIN_ROWS, -(-rows // MIN_ROWS) * MIN_ROWS)


@dataclass
class Lease:
    """A range of ``rows`` rows of one chunk from ``base``, held by one cache (it may grow in place)."""

    chunk: int
    base: int
    rows: int
    served_at: float = float("-inf")  # when a network peer was last sent rows from it (monotonic)


class Chunk:
    """One tensor of ``rows`` rows (a multiple of ``MIN_ROWS``) and its free ranges, each kept by
    where it starts and where it ends, so a range given back merges with the free ranges beside it."""

    def __init__(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        with torch.inference_mode(False):  # (made inside a forward or not: a normal tensor, writable anywhere)
            self.buf = torch.empty((rows, *row_shape), dtype=dtype, device=device)
        self.starts: dict[int, int] = {0: rows}  # free range: base -> rows
        self.ends: dict[int, int] = {rows: 0}  # free range: end -> base
        self.used = 0  # rows handed out

    def _cut(self, base: int, rows: int) -> None:
        """Take the first ``rows`` rows of the free range at ``base``."""
        size = self.starts.pop(base)
        if size > rows:
            self.starts[base + rows] = size - rows
            self.ends[base + size] = base + rows
        else:
            del self.ends[base + size]
        self.used += rows

    def take(self, rows: int) -> int | None:
        """The base of a new range of ``rows`` rows (the lowest that fits: pages already in stay in
        use), or None where no free range is that long."""
        base = min((b for b, size in self.starts.items() if size >= rows), default=None)
        if base is not None:
            self._cut(base, rows)
        return base

    def extend(self, base: int, rows: int, more: int) -> bool:
        """Grow the range ``base``, ``rows`` long, by ``more`` rows in place, if they are free."""
        if self.starts.get(base + rows, 0) < more:
            return False
        self._cut(base + rows, more)
        return True

    def give(self, base: int, rows: int) -> None:
        self.used -= rows
        end = base + rows
        if end in self.starts:  # (merged with the free range after it ...)
            size = self.starts.pop(end)
            del self.ends[end + size]
            end += size
        if base in self.ends:  # (... and the one before it)
            base = self.ends.pop(base)
            del self.starts[base]
        self.starts[base], self.ends[end] = end - base, base


class KVArena:
    """The KV rows of one model on one device: chunks of rows, leased to caches by range."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.row_shape, self.dtype, self.device = row_shape, dtype, torch.device(device)
        row_bytes = torch.empty((), dtype=dtype).element_size() * math.prod(row_shape)
        self.chunk_rows = max(MIN_ROWS, chunk_bytes // row_bytes // MIN_ROWS * MIN_ROWS)
        self.chunks: list[Chunk | None] = []
        self.returned: deque[Lease] = deque()  # ranges given back, not yet sorted (``give``)
        self.waiting: list[tuple[float, Lease]] = []  # given back, in quarantine (reusable from, lease)
        self.lock = threading.Lock()

    def lease(self, rows: int) -> Lease:
        """A range of at least ``rows`` rows."""
        rows = _rounded(rows)
        with self.lock:
            self._release_waiting()
            for i, chunk in enumerate(self.chunks):
                if chunk is not None and (base := chunk.take(rows)) is not None:
                    return Lease(i, base, rows)
            # (the first chunk is the whole budget; one made when it is full, by fragmentation or a
            # cache larger than it, only an eighth of it or that cache: a bounded overshoot, freed when empty)
            size = self.chunk_rows if not self.chunks else max(rows, self.chunk_rows // 8 // MIN_ROWS * MIN_ROWS)
            chunk = self._chunk(max(rows, size), rows)
            i = next((i for i, c in enumerate(self.chunks) if c is None), len(self.chunks))
            self.chunks[i:i + 1] = [chunk]
            return Lease(i, chunk.take(rows), rows)

    def extend(self, lease: Lease, rows: int) -> bool:
        """Grow ``lease`` to at least ``rows`` rows where it lies (its rows and their contents stay
        put), if the rows after it are free; False: it cannot."""
        rows = _rounded(rows)
        with self.lock:
            if rows > lease.rows and self.chunks[lease.chunk].extend(lease.base, lease.rows, rows - lease.rows):
                lease.rows = rows
                return True
            return False

    def _chunk(self, rows: int, least: int) -> Chunk:
        """A chunk of ``rows`` rows, or as many as memory allows down to ``least`` (a budget larger
        than the host can map, or a device that is short: fewer rows, not a failed worker)."""
        while True:
            try:
                return Chunk(rows, self.row_shape, self.dtype, self.device)
            except RuntimeError:  # (torch's out-of-memory errors on every device)
                if rows <= least:
                    raise
                rows = max(least, rows // 2 // MIN_ROWS * MIN_ROWS)

    def rows(self, lease: Lease) -> torch.Tensor:
        """The rows of ``lease`` (a view of its chunk)."""
        return self.chunks[lease.chunk].buf[lease.base:lease.base + lease.rows]

    def chunk(self, lease: Lease) -> torch.Tensor:
        return self.chunks[lease.chunk].buf

    def give(self, lease: Lease) -> None:
        """``lease``'s cache is done with it: reusable from the next ``lease`` on, unless a peer
        was served from it lately. Takes no lock (a cache's finalizer may run inside ``lease``)."""
        self.returned.append(lease)

    def _give(self, lease: Lease) -> None:
        chunk = self.chunks[lease.chunk]
        chunk.give(lease.base, lease.rows)
        if chunk.used == 0 and lease.chunk > 0:  # (an emptied extra chunk gives its memory back)
            self.chunks[lease.chunk] = None

    def _release_waiting(self) -> None:
        while self.returned:
            lease = self.returned.popleft()
            self.waiting.append((lease.served_at + QUARANTINE_S, lease))
        now = time.monotonic()
        if any(usable <= now for usable, _ in self.waiting):
            ready = [lease for usable, lease in self.waiting if usable <= now]
            self.waiting = [(u, lease) for u, lease in self.waiting if u > now]
            for lease in ready:
                self._give(lease)

    @property
    def leased_rows(self) -> int:
        """Rows held by caches (or given back and still in quarantine)."""
        with self.lock:
            self._release_waiting()
            return sum(c.used for c in self.chunks if c is not None)
