"""Shared-memory KV for workers on one host: peers read a holder's KV without asking it.

With ``kv_transport = "shm"`` a worker keeps each request's KV rows and token ids in a file
under a shared-memory folder (``/dev/shm`` when it exists) and advertises ``shm://FOLDER``.
A peer on the same host pulls by mapping that file and copying the rows it lacks: a one-sided
read, like UCX RMA or CUDA IPC, so a holder busy computing (or waiting for its GIL) costs the
puller nothing. Peers on other hosts cannot see the folder; their pulls fail and they
recompute, so use ``zmq`` or ``ucx`` across hosts. Files are readable by the same user only.

One file per request and role, ``{role}-{rid}.kv``::

    [int64 x 8 header: MAGIC, length, capacity, row_bytes, state, ...]
    [int32 x capacity: token ids]            (padded to 64 bytes)
    [capacity rows of the cache layout]      (see kv/cache.py)

The holder writes rows as it computes and publishes the token ids and ``length`` after each
batch (``KVStore.publish``). Growing the buffer writes a new file and renames it over the old
one, so a reader never sees a half-built file; freeing unlinks it. Either way the old file's
``state`` becomes RETIRED, so a reader that kept it mapped maps the path afresh.

Readers keep their mappings between pulls (``PeerFiles``): on this VM a system call made
between two batches costs ~100 us (the CPU is cold after compute), so a pull that is one copy
from an already mapped file, with no open or read call, is about twice as fast as one that
opens and reads the file each time.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from nebula_flow.kv.transport import KVTransport, Lookup, PullItem, endpoint_part

MAGIC = 0x4E46_4B56_0002  # "NFKV" v2 (v2 added the state word)
HEADER_BYTES = 64
LENGTH, CAPACITY, ROW_BYTES, STATE = 1, 2, 3, 4  # header words after MAGIC
RETIRED = 1  # STATE: the cache moved to a bigger file, or was freed; this file no longer follows it


def _tokens_bytes(capacity: int) -> int:
    return (capacity * 4 + 63) // 64 * 64


def kv_file_name(role: str, rid: int) -> str:
    return f"{role}-{rid}.kv"


def kv_path(folder: Path, role: str, rid: int) -> Path:
    return Path(folder) / kv_file_name(role, rid)


class SharedMemoryFull(OSError):
    """The shared-memory folder cannot hold another cache (e.g. a container's small /dev/shm)."""


class SharedRows:
    """A file-backed buffer for one cache: rows, token ids and a header, all mapped."""

    def __init__(self, path: Path, capacity: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        row_bytes = int(np.prod(row_shape)) * torch.empty(0, dtype=dtype).element_size()
        total = HEADER_BYTES + _tokens_bytes(capacity) + capacity * row_bytes
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        full = False
        try:  # allocate the pages now, in one call, not one fault at a time while rows arrive
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            full = exc.errno == errno.ENOSPC  # a full tmpfs: a sparse mapping would SIGBUS on write
            if not full:
                os.ftruncate(fd, total)  # a file system without fallocate
        finally:
            os.close(fd)
        if full:
            tmp.unlink(missing_ok=True)
            raise SharedMemoryFull(f"no room for {total} bytes of KV in {path.parent}")
        fd = os.open(tmp, os.O_RDWR)
        try:
            # (no MAP_POPULATE: measured here it cost more per page than faulting the pages in
            # as rows are written, and it also maps the capacity never used)
            mem = torch.frombuffer(mmap.mmap(fd, total, flags=mmap.MAP_SHARED), dtype=torch.uint8)
        finally:
            os.close(fd)  # (the mapping keeps the file)
        self.header = mem[:HEADER_BYTES].view(torch.int64)
        self.tokens = mem[HEADER_BYTES:HEADER_BYTES + capacity * 4].view(torch.int32)
        start = HEADER_BYTES + _tokens_bytes(capacity)
        self.rows = mem[start:].view(dtype).view(capacity, *row_shape)
        self.header[:4] = torch.tensor([MAGIC, 0, capacity, row_bytes])
        self.tmp, self.path = tmp, path

    def install(self) -> None:
        """Make this the file peers read (atomically replaces an older, smaller one)."""
        os.replace(self.tmp, self.path)

    def publish(self, tokens: list[int]) -> None:
        n = min(len(tokens), self.tokens.shape[0])
        # (a buffer grown inside a forward is an inference tensor: only written in that mode)
        with torch.inference_mode():
            self.tokens[:n] = torch.as_tensor(tokens[:n], dtype=torch.int32)
            self.header[LENGTH] = n

    def retire(self) -> None:
        """Tell readers that kept this file mapped that it no longer follows the cache."""
        with torch.inference_mode():
            self.header[STATE] = RETIRED


PREFIX = "nebula-flow-kv-"


def remove_orphans(root: Path) -> list[Path]:
    """Delete KV folders of workers that died without cleaning up (their pid is gone)."""
    removed = []
    for folder in root.glob(f"{PREFIX}*"):
        try:
            pid = int(folder.name[len(PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except (ValueError, PermissionError, OSError):
            continue  # not ours to judge
    return removed


class _Mapped:
    """A peer's KV file mapped read-only: its header words, token ids and the address of its rows."""

    def __init__(self, mem: mmap.mmap) -> None:
        raw = np.frombuffer(mem, dtype=np.uint8)
        self.head = memoryview(mem)[:HEADER_BYTES].cast("q")  # (indexing gives plain ints: cheap)
        self.capacity, self.row_bytes = self.head[CAPACITY], self.head[ROW_BYTES]
        start = HEADER_BYTES + _tokens_bytes(self.capacity)
        if self.head[0] != MAGIC or self.row_bytes <= 0 or len(raw) < start + self.capacity * self.row_bytes:
            raise ValueError("not a KV file of this version")
        self.tokens = raw[HEADER_BYTES:HEADER_BYTES + self.capacity * 4].view(np.int32)
        self.rows = raw[start:start + self.capacity * self.row_bytes]
        self.rows_address = self.rows.ctypes.data
        self.nbytes = len(raw)
        self._mem = mem  # the views above keep it too; this says so


class PeerFiles:
    """Same-host peers' KV files, mapped once and read by one copy each (no system call per pull).

    A mapping is dropped and the path mapped again when its file is RETIRED (grown or freed) or
    holds fewer positions than asked (it may have been replaced a moment ago); a path that no
    longer exists reads as missing. At most ``limit`` files or ``max_bytes`` stay mapped; a
    mapping of a freed file holds that file's memory, so retired ones are swept now and then.
    """

    def __init__(self, limit: int = 256, max_bytes: int = 1 << 30) -> None:
        self.limit, self.max_bytes = limit, max_bytes
        self.maps: OrderedDict[str, _Mapped] = OrderedDict()
        self.mapped_bytes = 0
        self.reads = 0

    def read(self, path: str, start: int, end: int, dest: torch.Tensor) -> np.ndarray | None:
        """Copy rows ``start..end`` of the file at ``path`` into ``dest``; their tokens, or None.

        Kept lean on purpose: a pull runs between two batches, when every Python and numpy
        step costs several times what it costs in a hot loop (one ``memmove``, no numpy views).
        """
        self.reads += 1
        if self.reads % 64 == 0:
            self._sweep()
        m = self.maps.get(path)
        if m is not None and (m.head[STATE] == RETIRED or m.head[LENGTH] < end):
            self._drop(path)
            m = None
        if m is None and (m := self._map(path)) is None:
            return None  # not on this host, freed, or evicted
        self.maps.move_to_end(path)
        nbytes = (end - start) * m.row_bytes
        if m.head[LENGTH] < end or end > m.capacity or dest.nbytes != nbytes or not dest.is_contiguous():
            return None
        if dest.device.type != "cpu":  # (make_transport refuses shm for CUDA workers)
            raise ValueError("shared-memory KV is read into CPU memory only")
        ctypes.memmove(dest.data_ptr(), m.rows_address + start * m.row_bytes, nbytes)
        return m.tokens[start:end].copy()

    def _map(self, path: str) -> _Mapped | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            m = _Mapped(mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        except (OSError, ValueError, TypeError, IndexError):
            return None  # empty, shorter than a header, truncated or foreign
        finally:
            os.close(fd)
        self.maps[path] = m
        self.mapped_bytes += m.nbytes
        while len(self.maps) > self.limit or (self.mapped_bytes > self.max_bytes and len(self.maps) > 1):
            self._drop(next(iter(self.maps)))
        return m

    def _drop(self, path: str) -> None:
        m = self.maps.pop(path, None)
        if m is not None:
            self.mapped_bytes -= m.nbytes  # (the mapping goes when the last view of it does)

    def _sweep(self) -> None:
        for path in [p for p, m in self.maps.items() if m.head[STATE] == RETIRED]:
            self._drop(path)

    def close(self) -> None:
        self.maps.clear()
        self.mapped_bytes = 0


class ShmTransport(KVTransport):
    """Serve by sharing files; pull by reading peers' files (same host only)."""

    scheme = "shm"

    def __init__(self) -> None:
        root = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        remove_orphans(root)
        self.share_folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
        self.share_folder.chmod(0o700)
        self._visible: dict[str, bool] = {}  # shm:// endpoint part -> its folder is visible here
        self.files = PeerFiles()

    def serve(self, host: str, lookup: Lookup) -> str:
        """Nothing runs: the worker's stores write their KV into ``self.share_folder``."""
        return f"shm://{self.share_folder}"

    def pull_many(self, endpoint: str, items: list[PullItem]) -> list[np.ndarray | None]:
        endpoint = endpoint_part(endpoint, "shm://")
        if endpoint is None:
            return [None] * len(items)
        folder = endpoint[len("shm://"):]
        return [self.files.read(os.path.join(folder, kv_file_name(role, rid)), start, end, dest) for rid, role, start, end, dest in items]

    def reads_locally(self, endpoint: str) -> bool:
        """The holder's folder is visible here (same host and mount namespace). Remembered per
        folder: a path lookup costs ~85 us here after other work, and a worker asks several
        times per batch. (A folder that vanishes later just fails its reads: the caller then
        asks the network or recomputes, as for any missing file.)"""
        part = endpoint_part(endpoint, "shm://")
        if part is None:
            return False
        seen = self._visible.get(part)
        if seen is None:
            if len(self._visible) >= 1024:  # workers come and go over a long run: stay bounded
                self._visible.clear()
            seen = self._visible[part] = Path(part[len("shm://"):]).is_dir()
        return seen

    def close(self) -> None:
        self.files.close()
        shutil.rmtree(self.share_folder, ignore_errors=True)
