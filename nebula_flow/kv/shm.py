"""Shared-memory KV for workers on one host: peers read a holder's KV without asking it.

With ``kv_transport = "shm"`` a worker keeps each request's KV rows and token ids in a file
under a shared-memory folder (``/dev/shm`` when it exists) and advertises ``shm://FOLDER``.
A peer on the same host pulls by mapping that file and copying the rows it lacks: a one-sided
read, like UCX RMA or CUDA IPC, so a holder busy computing (or waiting for its GIL) costs the
puller nothing. Peers on other hosts cannot see the folder; their pulls fail and they
recompute, so use ``zmq`` or ``ucx`` across hosts. Files are readable by the same user only.

One file per request and role, ``{role}-{rid}.kv``::

    [int64 x 8 header: MAGIC, length, capacity, row_bytes, ...]
    [int32 x capacity: token ids]            (padded to 64 bytes)
    [capacity rows of the cache layout]      (see kv/cache.py)

The holder writes rows as it computes and publishes the token ids and ``length`` after each
batch (``KVStore.publish``). Growing the buffer writes a new file and renames it over the old
one, so a reader never sees a half-built file; freeing unlinks it (a reader that already
mapped it keeps a valid view).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from nebula_flow.kv.transport import KVTransport, Lookup, PullItem, endpoint_part, host_view

MAGIC = 0x4E46_4B56_0001  # "NFKV" v1
HEADER_BYTES = 64


def _tokens_bytes(capacity: int) -> int:
    return (capacity * 4 + 63) // 64 * 64


def kv_path(folder: Path, role: str, rid: int) -> Path:
    return folder / f"{role}-{rid}.kv"


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
        mem = torch.from_file(str(tmp), shared=True, size=total, dtype=torch.uint8)
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
            self.header[1] = n


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


def read_rows(path: Path, start: int, end: int, dest: torch.Tensor) -> np.ndarray | None:
    """Copy rows ``start..end`` of the file at ``path`` into ``dest``; their tokens, or None.

    Plain reads, not a mapping: one system call per part, which copies from the page cache
    without faulting the holder's pages into this process (and releases the GIL meanwhile).
    """
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below
    except OSError:
        return None  # not on this host, freed, or evicted
    with f:
        head = np.frombuffer(os.pread(f.fileno(), HEADER_BYTES, 0), dtype=np.int64)
        if len(head) < 4:
            return None
        magic, length, capacity, row_bytes = (int(x) for x in head[:4])
        nbytes = (end - start) * row_bytes
        if magic != MAGIC or length < end or dest.numel() * dest.element_size() != nbytes:
            return None
        tokens = np.frombuffer(os.pread(f.fileno(), (end - start) * 4, HEADER_BYTES + start * 4), dtype=np.int32)
        offset = HEADER_BYTES + _tokens_bytes(capacity) + start * row_bytes
        if dest.device.type == "cpu":
            target = memoryview(host_view(dest).reshape(-1).view(np.uint8))
            got = os.preadv(f.fileno(), [target], offset)
        else:
            data = os.pread(f.fileno(), nbytes, offset)
            got = len(data)
            dest.copy_(torch.frombuffer(bytearray(data), dtype=dest.dtype).view(dest.shape).to(dest.device))
        if got != nbytes or len(tokens) != end - start:
            return None
        return tokens.copy()


class ShmTransport(KVTransport):
    """Serve by sharing files; pull by reading peers' files (same host only)."""

    scheme = "shm"

    def __init__(self) -> None:
        root = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        remove_orphans(root)
        self.share_folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
        self.share_folder.chmod(0o700)
        self._visible: dict[str, bool] = {}  # shm:// endpoint part -> its folder is visible here

    def serve(self, host: str, lookup: Lookup) -> str:
        """Nothing runs: the worker's stores write their KV into ``self.share_folder``."""
        return f"shm://{self.share_folder}"

    def pull_many(self, endpoint: str, items: list[PullItem]) -> list[np.ndarray | None]:
        endpoint = endpoint_part(endpoint, "shm://")
        if endpoint is None:
            return [None] * len(items)
        folder = Path(endpoint[len("shm://"):])
        return [read_rows(kv_path(folder, role, rid), start, end, dest) for rid, role, start, end, dest in items]

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
        shutil.rmtree(self.share_folder, ignore_errors=True)
