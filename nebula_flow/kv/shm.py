"""Shared-memory KV for workers on one host: peers read a holder's KV without asking it.

With ``kv_transport = "shm"`` a worker keeps each request's KV rows and token ids in a file
under a shared-memory folder (``/dev/shm`` when it exists) and advertises ``shm://FOLDER``.
A peer on the same host pulls by mapping that file and copying the rows it lacks: a one-sided
read, like UCX RMA or CUDA IPC, so a holder busy computing (or waiting for its GIL) costs the
puller nothing. Peers on other hosts cannot see the folder; their pulls fail and they
recompute, so use ``zmq`` or ``ucx`` across hosts. Files are readable by the same user only.

One file per request and role, ``{role}-{rid}.kv``::

    [int64 x 8 header: MAGIC, length, capacity, row_bytes, state, owner, ...]
    [int32 x capacity: token ids]            (padded to 64 bytes)
    [capacity rows of the cache layout]      (see kv/cache.py)

The holder writes rows as it computes and publishes the token ids and ``length`` after each
batch (``KVStore.publish``). Growing the buffer writes a new file and renames it over the old
one, so a reader never sees a half-built file; the old file's ``state`` becomes RETIRED.

A finished (or evicted) request's file is not deleted but kept in the holder's ``FilePool``
(``state`` POOLED, renamed out of the way) and given to a later request: writing into a new
file faults every page in, one at a time, and a pool file's pages are already mapped. Measured
here: 24 MB (a 512-token prompt of the bundled target) copied into a new file in 11 ms, into
a pooled one in 3.7 ms.

Readers keep their mappings between pulls (``PeerFiles``), by file rather than by name: a
pool file that comes back under a new request's name is read through the mapping the reader
already has (2.4 ms for the same 24 MB), and a small pull is one copy with no system call (on
this VM a system call made between two batches costs ~100 us: the CPU is cold after compute).
For a large read into a cache not held yet, the worker's prefetch thread makes the cache and
maps the holder's file while the previous batch computes, both with their pages faulted in
(``populate``), so the read at compute start is only the copy.
Every read checks that the file is LIVE and its ``owner`` is the request asked for, before
and after the copy, so a file recycled meanwhile reads as missing, never as another
request's KV.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from nebula_flow.kv.link_fit import MAX_PULL_S, PULL_TIMEOUT_S
from nebula_flow.kv.transport import KVTransport, Lookup, PullItem, endpoint_part

MAGIC = 0x4E46_4B56_0003  # "NFKV" v3 (v2 added the state word, v3 the owner and pooled files)
HEADER_BYTES = 64
LENGTH, CAPACITY, ROW_BYTES, STATE, OWNER = 1, 2, 3, 4, 5  # header words after MAGIC
# STATE values
LIVE = 0  # the file holds the KV of request OWNER
RETIRED = 1  # replaced by a bigger file, or deleted: readers let go of their mapping (and its memory)
POOLED = 2  # kept by its holder for a later request: readers stop reading it under its old name


def _tokens_bytes(capacity: int) -> int:
    return (capacity * 4 + 63) // 64 * 64


def kv_file_name(role: str, rid: int) -> str:
    return f"{role}-{rid}.kv"


def kv_path(folder: Path, role: str, rid: int) -> Path:
    return Path(folder) / kv_file_name(role, rid)


_libc = ctypes.CDLL(None, use_errno=True)
# Linux 5.14+ (older kernels refuse them: then pages fault in one at a time as rows are copied)
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
PAGE = mmap.PAGESIZE


def populate(address: int, nbytes: int, write: bool = True) -> bool:
    """Fault in the pages of ``nbytes`` at ``address`` (for writing, or reading), in one system
    call (the GIL is released meanwhile). Whether the kernel did."""
    start = address - address % PAGE
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start), advice) == 0


class SharedMemoryFull(OSError):
    """The shared-memory folder cannot hold another cache (e.g. a container's small /dev/shm)."""


class SharedRows:
    """A file-backed buffer for one cache: rows, token ids and a header, all mapped."""

    def __init__(self, path: Path, capacity: int, row_shape: tuple[int, ...], dtype: torch.dtype, owner: int) -> None:
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
        # Never inference tensors, even when a cache grows inside a forward: the file outlives
        # its request (FilePool), and the next one writes to it outside inference mode too.
        with torch.inference_mode(False):
            try:
                # (no MAP_POPULATE: measured here it cost more per page than faulting the pages
                # in as rows are written, and it also maps the capacity never used)
                mem = torch.frombuffer(mmap.mmap(fd, total, flags=mmap.MAP_SHARED), dtype=torch.uint8)
            finally:
                os.close(fd)  # (the mapping keeps the file)
            self.header = mem[:HEADER_BYTES].view(torch.int64)
            self.tokens = mem[HEADER_BYTES:HEADER_BYTES + capacity * 4].view(torch.int32)
            start = HEADER_BYTES + _tokens_bytes(capacity)
            self.rows = mem[start:].view(dtype).view(capacity, *row_shape)
            self.header[:6] = torch.tensor([MAGIC, 0, capacity, row_bytes, LIVE, owner])
        self.nbytes = total
        self.staged, self.path = tmp, path  # where the file is now, where peers look for it

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    def install(self) -> None:
        """Make this the file peers read (atomically replaces an older, smaller one)."""
        os.replace(self.staged, self.path)
        self.staged = self.path

    def set_state(self, state: int, owner: int | None = None) -> None:
        if owner is not None:
            self.header[OWNER] = owner
            self.header[LENGTH] = 0
        self.header[STATE] = state

    def publish(self, tokens: list[int]) -> None:
        n = min(len(tokens), self.tokens.shape[0])
        self.tokens[:n] = torch.as_tensor(tokens[:n], dtype=torch.int32)
        self.header[LENGTH] = n

    def retire(self) -> None:
        """Tell readers that kept this file mapped that it no longer follows the cache."""
        self.set_state(RETIRED)


POOL_QUARANTINE_S = MAX_PULL_S + 1.0


class FilePool:
    """A holder's KV files of finished requests, kept (mapped, pages in) for later requests.

    A file a network peer was served from in the last ``POOL_QUARANTINE_S`` is not reused yet:
    the ZeroMQ and UCX servers send rows straight from the cache's memory, and a send still
    under way after that long goes to a puller that has already given up (``MAX_PULL_S``).
    At most ``max_bytes`` are kept; the oldest files go first. Thread-safe: the compute and
    prefetch threads both make caches (and grow them).
    """

    def __init__(self, folder: Path, role: str, max_bytes: int) -> None:
        self.folder, self.role, self.max_bytes = Path(folder), role, max_bytes
        self.entries: list[tuple[float, SharedRows]] = []  # (reusable from, file), oldest first
        self.bytes = 0
        self.seq = itertools.count()
        self.reused = 0
        self.lock = threading.Lock()

    def put(self, rows: SharedRows, served_at: float) -> None:
        """Take back the file of a request this worker no longer holds."""
        rows.set_state(POOLED)  # readers stop trusting it under its old name at once
        name = self.folder / f"{self.role}-pool-{next(self.seq)}.kv"
        try:
            os.replace(rows.path, name)  # (the request's name is free again, and reads as missing)
        except OSError:
            rows.retire()  # its name is gone (the folder was removed): nothing to keep
            return
        rows.staged = rows.path = name
        with self.lock:
            self.entries.append((served_at + POOL_QUARANTINE_S, rows))
            self.bytes += rows.nbytes
            while self.bytes > self.max_bytes and self.entries:
                self._drop(0)

    def take(self, path: Path, owner: int, least: int, most: int) -> SharedRows | None:
        """The smallest pooled file for ``owner`` with room for ``least..most`` positions, set up
        to be installed at ``path``."""
        now, best = time.monotonic(), None
        with self.lock:
            for i, (usable, rows) in enumerate(self.entries):
                if usable <= now and least <= rows.capacity <= most and (
                        best is None or rows.capacity < self.entries[best][1].capacity):
                    best = i
            if best is None:
                return None
            rows = self.entries.pop(best)[1]
            self.bytes -= rows.nbytes
            self.reused += 1
        rows.set_state(LIVE, owner)  # (still under its pool name: no reader looks there)
        rows.path = path
        return rows

    def clear(self) -> None:
        """Give every pooled file's memory back (the shared-memory folder is full)."""
        with self.lock:
            while self.entries:
                self._drop(0)

    def _drop(self, i: int) -> None:
        _, rows = self.entries.pop(i)
        self.bytes -= rows.nbytes
        rows.retire()
        Path(rows.staged).unlink(missing_ok=True)


PREFIX = "nebula-flow-kv-"


ALIVE = ".alive"  # a worker holds an exclusive flock on this file in its folder while it lives
STALE_S = 60.0  # a folder without the lock file this old was left by a worker that died making it


def hold_alive(folder: Path) -> int:
    """Lock ``folder`` as this process's for as long as the returned descriptor stays open (the
    kernel drops the lock when the process dies, however it dies)."""
    # Locked before it takes its name: another worker's ``remove_orphans`` must never find the
    # file unlocked between its creation and the lock (it would delete a live worker's folder;
    # workers forked together start within milliseconds of each other).
    staged = folder / f"{ALIVE}.{os.getpid()}"
    fd = os.open(staged, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(staged, folder / ALIVE)  # (the lock belongs to the open file: it keeps it)
    return fd


def remove_orphans(root: Path) -> list[Path]:
    """Delete KV folders of workers that died without cleaning up. A folder is an orphan when
    nobody holds its lock: unlike a process id, a lock means the same in every PID namespace that
    shares the folder (a pid from another namespace may be unknown here, or another process's)."""
    removed = []
    for folder in root.glob(f"{PREFIX}*"):
        try:
            fd = os.open(folder / ALIVE, os.O_RDWR)
        except FileNotFoundError:  # dying before taking its lock, or being made right now
            try:
                stale = time.time() - folder.stat().st_mtime > STALE_S
            except OSError:
                continue
            if stale:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            continue
        except OSError:
            continue  # not ours to judge (another user's)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its worker lives
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
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

    Mappings are kept by file (device, inode), and each name read is remembered with its file
    and owner. A name whose file is no longer LIVE for that owner (grown, freed, pooled or
    recycled), or holds fewer positions than asked, is looked up again; a name that no longer
    exists reads as missing. The mapping of a pooled file is kept: it may come back under
    another name. At most ``limit`` files or ``max_bytes`` stay mapped; a mapping of a deleted
    file holds that file's memory, so RETIRED ones are swept now and then.
    """

    def __init__(self, limit: int = 256, max_bytes: int = 1 << 30) -> None:
        self.limit, self.max_bytes = limit, max_bytes
        self.maps: OrderedDict[tuple[int, int], _Mapped] = OrderedDict()
        self.names: dict[str, tuple[tuple[int, int], int]] = {}  # path -> (file, owner read there)
        self.mapped_bytes = 0
        self.reads = 0
        # The compute thread reads; the prefetch thread maps ahead (``prefault``).
        self.lock = threading.Lock()

    def prefault(self, path: str, owner: int, start: int, end: int) -> None:
        """Map request ``owner``'s file at ``path`` now and fault in the pages of its rows
        ``start..end``, so that reading them later is only a copy (a new mapping of a 24 MB
        file otherwise faults ~1.3 ms of pages in during the read)."""
        with self.lock:
            m = self._mapping(path, owner, 0)
        if m is not None and 0 <= start < end <= m.capacity:
            populate(m.rows_address + start * m.row_bytes, (end - start) * m.row_bytes, write=False)

    def read(self, path: str, owner: int, start: int, end: int, dest: torch.Tensor) -> np.ndarray | None:
        with self.lock:
            return self._read(path, owner, start, end, dest)

    def _read(self, path: str, owner: int, start: int, end: int, dest: torch.Tensor) -> np.ndarray | None:
        """Copy rows ``start..end`` of request ``owner``'s file at ``path`` into ``dest``; their
        tokens, or None.

        Kept lean on purpose: a pull runs between two batches, when every Python and numpy
        step costs several times what it costs in a hot loop (one ``memmove``, no numpy views).
        """
        self.reads += 1
        if self.reads % 64 == 0:
            self._sweep()
        m = self._mapping(path, owner, end)
        if m is None:
            return None  # not on this host, freed, evicted, or not this request's
        head = m.head
        nbytes = (end - start) * m.row_bytes
        if head[LENGTH] < end or end > m.capacity or dest.nbytes != nbytes or not dest.is_contiguous():
            return None
        if dest.device.type != "cpu":  # (make_transport refuses shm for CUDA workers)
            raise ValueError("shared-memory KV is read into CPU memory only")
        ctypes.memmove(dest.data_ptr(), m.rows_address + start * m.row_bytes, nbytes)
        tokens = m.tokens[start:end].copy()
        if head[STATE] != LIVE or head[OWNER] != owner or head[LENGTH] < end:
            return None  # freed or recycled while we copied: what we read may not be these rows
        return tokens

    def _mapping(self, path: str, owner: int, end: int) -> _Mapped | None:
        """The mapping of request ``owner``'s file at ``path``: the one remembered for that name
        while it is LIVE for ``owner`` and holds ``end`` positions, else looked up again."""
        known = self.names.get(path)
        m = self.maps.get(known[0]) if known is not None else None
        if m is None or m.head[STATE] != LIVE or m.head[OWNER] != owner or m.head[LENGTH] < end:
            if m is not None and m.head[STATE] == RETIRED:
                self._drop(known[0])  # (a deleted file: let go of its memory now)
            return self._open(path, owner)
        self.maps.move_to_end(known[0])
        return m

    def _open(self, path: str, owner: int) -> _Mapped | None:
        """The file now at ``path``, mapped (a mapping kept from earlier reads is used again), if
        it is LIVE for ``owner``."""
        self.names.pop(path, None)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            m = self.maps.get(key)
            if m is None or m.nbytes != st.st_size or m.head[STATE] == RETIRED:
                self._drop(key)
                m = _Mapped(mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
                self.maps[key] = m
                self.mapped_bytes += m.nbytes
        except (OSError, ValueError, TypeError, IndexError):
            return None  # empty, shorter than a header, truncated or foreign
        finally:
            os.close(fd)
        self.maps.move_to_end(key)
        while len(self.maps) > self.limit or (self.mapped_bytes > self.max_bytes and len(self.maps) > 1):
            self._drop(next(iter(self.maps)))
        if key not in self.maps or m.head[STATE] != LIVE or m.head[OWNER] != owner:
            return None
        self.names[path] = (key, owner)
        return m

    def _drop(self, key: tuple[int, int]) -> None:
        m = self.maps.pop(key, None)
        if m is not None:
            self.mapped_bytes -= m.nbytes  # (the mapping goes when the last view of it does)

    def _sweep(self) -> None:
        for key in [k for k, m in self.maps.items() if m.head[STATE] == RETIRED]:
            self._drop(key)
        for path, (key, owner) in list(self.names.items()):
            m = self.maps.get(key)
            if m is None or m.head[STATE] != LIVE or m.head[OWNER] != owner:
                del self.names[path]

    def close(self) -> None:
        with self.lock:
            self.maps.clear()
            self.names.clear()
            self.mapped_bytes = 0


class ShmTransport(KVTransport):
    """Serve by sharing files; pull by reading peers' files (same host only)."""

    scheme = "shm"

    def __init__(self) -> None:
        root = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        remove_orphans(root)
        self.share_folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
        self.share_folder.chmod(0o700)
        self.alive = hold_alive(self.share_folder)
        # endpoint -> the folder it names, with a trailing "/", or "" when there is none or it
        # is not visible here (same host and mount namespace). Remembered: between batches a
        # path lookup costs ~85 us here, and parsing the endpoint tens of us; a worker asks
        # several times per batch. (A folder that vanishes later just fails its reads: the
        # caller then asks the network or recomputes, as for any missing file.)
        self._folders: dict[str, str] = {}
        self.files = PeerFiles()

    def serve(self, host: str, lookup: Lookup) -> str:
        """Nothing runs: the worker's stores write their KV into ``self.share_folder``."""
        return f"shm://{self.share_folder}"

    def _folder(self, endpoint: str) -> str:
        folder = self._folders.get(endpoint)
        if folder is None:
            if len(self._folders) >= 1024:  # workers come and go over a long run: stay bounded
                self._folders.clear()
            part = endpoint_part(endpoint, "shm://")
            folder = part[len("shm://"):] if part is not None else ""
            folder = self._folders[endpoint] = os.path.join(folder, "") if folder and os.path.isdir(folder) else ""
        return folder

    def pull_many(self, endpoint: str, items: list[PullItem], timeout_s: float = PULL_TIMEOUT_S) -> list[np.ndarray | None]:
        folder = self._folder(endpoint)  # (a read of this host's memory: nothing to wait for)
        if not folder:
            return [None] * len(items)
        return [self.files.read(folder + kv_file_name(role, rid), rid, start, end, dest) for rid, role, start, end, dest in items]

    def prepare_reads(self, endpoint: str, items: list[tuple[int, str, int, int]]) -> None:
        folder = self._folder(endpoint)
        for rid, role, start, end in items if folder else ():
            self.files.prefault(folder + kv_file_name(role, rid), rid, start, end)

    def reads_locally(self, endpoint: str) -> bool:
        """The holder's folder is visible here (same host and mount namespace)."""
        return bool(self._folder(endpoint))

    def close(self) -> None:
        self.files.close()
        shutil.rmtree(self.share_folder, ignore_errors=True)
        os.close(self.alive)
