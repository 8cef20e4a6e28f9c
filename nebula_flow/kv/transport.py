"""KV transports: how one worker pulls a request's KV positions from the worker holding them.

One small interface, three implementations and one combination:

* ``ZmqTransport``: ROUTER server thread + one DEALER per peer; rows travel as one zero-copy
  frame. Always available; the fallback.
* ``UcxTransport`` (``nebula_flow/kv/ucx.py``): ucxx endpoints, rows received straight into
  the destination cache rows (host memory on CPU, CUDA memory on GPU). The default when
  ucxx is installed.
* ``ShmTransport`` (``nebula_flow/kv/shm.py``): same-host CPU workers keep their KV in shared
  memory files and read each other's directly (one-sided: the holder does nothing).
* ``LocalFirstTransport`` (``shm+zmq``, the ``auto`` choice for CPU workers): shared memory with
  peers on this host, ZeroMQ with the rest. Its endpoint names both (``shm://DIR;tcp://H:P``);
  every transport picks the part it speaks, so workers of different transports interoperate.

A server answers ``lookup(rid, role, start, end) -> (tokens, rows) | None`` where ``rows`` is
the contiguous slice ``cache.buf[start:end]`` (see ``kv/cache.py`` for the layout). A pull
asks one holder for several requests' positions at once (a batch's worth: one exchange, not
one per request), receives each into its ``dest`` (the puller's own cache rows) and returns
the tokens those positions hold, or None for an item the holder cannot serve (the caller then
recomputes it).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zmq

from nebula_flow import protocol, zmq_frames
from nebula_flow.kv import device_copy
from nebula_flow.kv.link_fit import PULL_TIMEOUT_S
from nebula_flow.protocol import Error, KvData, KvPull, KvRows, ProtocolError
from nebula_flow.security import (
    Identity,
    make_client,
    make_server,
    server_key_of,
    start_authenticator,
    user_id,
    with_server_key,
)

log = logging.getLogger("nebula_flow.kv")
Lookup = Callable[[int, str, int, int], "tuple[np.ndarray, torch.Tensor] | None"]
PullItem = tuple[int, str, int, int, torch.Tensor]  # rid, role, start, end, dest rows


# The numpy dtype a tensor's rows travel as (``host_view``): a reply in any other is refused.
WIRE_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
               torch.bfloat16: np.dtype(np.uint16)}


def host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (bf16 seen as uint16: bytes are what travel)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = device_copy.to_host(t)
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def endpoint_part(endpoint: str, prefix: str) -> str | None:
    """The address in ``endpoint`` (one, or several joined by ``;``) that starts with ``prefix``."""
    return next((part for part in endpoint.split(";") if part.startswith(prefix)), None)


class KVTransport(ABC):
    """Serve this worker's KV to peers; pull peers' KV into local buffers."""

    scheme: str
    share_folder: Path | None = None  # where the worker's stores keep KV files same-host peers read

    @abstractmethod
    def serve(self, host: str, lookup: Lookup) -> str:
        """Start serving in the background; returns the endpoint peers should use."""

    @abstractmethod
    def pull_many(self, endpoint: str, items: list[PullItem], timeout_s: float = PULL_TIMEOUT_S) -> list[np.ndarray | None]:
        """Fill each item's ``dest`` (its rows start..end) from one peer; per item, the tokens
        those positions hold, or None when the peer cannot serve it (or all None when it has not
        answered within ``timeout_s``)."""

    def pull(self, endpoint: str, rid: int, role: str, start: int, end: int, dest: torch.Tensor) -> np.ndarray | None:
        """One request's rows start..end into ``dest``; their tokens, or None."""
        return self.pull_many(endpoint, [(rid, role, start, end, dest)])[0]

    def reads_locally(self, endpoint: str) -> bool:
        """Whether a pull from ``endpoint`` is a copy from this host's memory (no peer, no
        network): such a pull is as cheap at compute start as in the background."""
        return False

    def prepare_reads(self, endpoint: str, items: list[tuple[int, str, int, int]]) -> None:
        """Get ready to read (rid, role, start, end) from ``endpoint`` soon (``reads_locally``
        holders: map the files, fault the pages in). Nothing to do for a network transport."""
        return None

    @abstractmethod
    def close(self) -> None: ...


class ZmqTransport(KVTransport):
    scheme = "tcp"

    def __init__(self, identity: Identity | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.identity = identity  # CURVE: this worker's keys; peers must hold an authorized worker key
        self.auth = self.authorized = None
        self.peers: dict[str, zmq.Socket] = {}
        self.seq = itertools.count(1)
        self.served = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def serve(self, host: str, lookup: Lookup) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        me = self.identity
        if me:
            self.auth, self.authorized = start_authenticator(me.folder)
            make_server(sock, me, accepts="worker")
        port = sock.bind_to_random_port(f"tcp://{host}")
        self._thread = threading.Thread(target=self._serve_loop, args=(sock, lookup), name="kv-server", daemon=True)
        self._thread.start()
        endpoint = f"tcp://{host}:{port}"
        return with_server_key(endpoint, me.public.decode()) if me else endpoint

    def _serve_loop(self, sock: zmq.Socket, lookup: Lookup) -> None:
        while not self._stop.is_set():
            if not sock.poll(200):
                continue
            ident, *frames = zmq_frames.recv(sock)
            try:
                if self.authorized is not None and not self.authorized.allowed("workers", user_id(frames[0])):
                    raise ProtocolError("unauthorized", "this key was revoked")  # (connected before it was)
                req = protocol.decode(frames)
                if not isinstance(req, KvPull):
                    raise ProtocolError("unexpected_kind", f"{req.KIND} is not a KV request")
                reply = KvData(req.seq)
                for rid, role, start, end in req.items:
                    found = lookup(rid, role, start, end)
                    if found is None:
                        reply.items.append(None)
                        continue
                    tokens, rows = found
                    reply.items.append(KvRows(np.asarray(tokens, dtype=np.int32), host_view(rows)))
                    self.served += 1
            except ProtocolError as exc:
                self.errors += 1
                reply = Error(exc.code, exc.message)
            try:
                zmq_frames.send(sock, [ident, *protocol.encode(reply)], zmq_frames.NOBLOCK)
            except zmq.ZMQError:
                self.errors += 1
        sock.close()

    def _peer(self, endpoint: str, server_key: str | None) -> zmq.Socket:
        sock = self.peers.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.identity:
                me = self.identity
                make_client(sock, me, server_key=server_key)
            sock.connect(endpoint)
            self.peers[endpoint] = sock
        return sock

    def pull_many(self, endpoint: str, items: list[PullItem], timeout_s: float = PULL_TIMEOUT_S) -> list[np.ndarray | None]:
        server_key = server_key_of(endpoint)
        endpoint = endpoint_part(endpoint, "tcp://")
        if endpoint is None or (self.identity is not None and server_key is None):
            return [None] * len(items)  # (with keys, a holder that names no key cannot be verified)
        sock = self._peer(endpoint, server_key)
        seq = next(self.seq)
        zmq_frames.send(sock, protocol.encode(KvPull(seq, [[rid, role, start, end] for rid, role, start, end, _ in items])))
        deadline = time.monotonic() + timeout_s  # (a late answer to an earlier pull does not extend it)
        while True:
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                # The peer is gone or stuck: drop the socket so a late reply cannot confuse us.
                self.peers.pop(endpoint).close()
                return [None] * len(items)
            try:
                reply = protocol.decode(zmq_frames.recv(sock))
            except ProtocolError:
                continue
            if getattr(reply, "seq", None) == seq:
                break  # (anything else is a late answer to an earlier, abandoned pull)
        if not isinstance(reply, KvData) or len(reply.items) != len(items):
            return [None] * len(items)
        return [_receive(g, end - start, dest) for (_, _, start, end, dest), g in zip(items, reply.items)]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for sock in self.peers.values():
            sock.close()
        self.peers.clear()
        if self.auth is not None:
            self.auth.stop()


class LocalFirstTransport(KVTransport):
    """Shared memory for peers on this host, the network for the others.

    A same-host pull is a one-sided read of the holder's file (a busy holder costs nothing,
    measured ~1.5 % stall against ~6 % over ZeroMQ on two cores); a peer on another host, in
    another container, or whose file is missing (evicted, or kept private because the shared
    folder was full) is asked over the network instead. ``routes`` counts the items each way.
    """

    def __init__(self, local: KVTransport, remote: KVTransport) -> None:
        self.local, self.remote = local, remote
        self.scheme = f"{local.scheme}+{remote.scheme}"
        self.share_folder = local.share_folder
        self.routes = {"local": 0, "remote": 0}

    @property
    def errors(self) -> int:
        return getattr(self.remote, "errors", 0)

    def serve(self, host: str, lookup: Lookup) -> str:
        return f"{self.local.serve(host, lookup)};{self.remote.serve(host, lookup)}"

    def pull_many(self, endpoint: str, items: list[PullItem], timeout_s: float = PULL_TIMEOUT_S) -> list[np.ndarray | None]:
        got: list[np.ndarray | None] = [None] * len(items)
        if self.local.reads_locally(endpoint):  # the holder is on this host
            got = self.local.pull_many(endpoint, items)
            self.routes["local"] += sum(g is not None for g in got)
        missing = [i for i, g in enumerate(got) if g is None]
        if missing and any(not part.startswith("shm://") for part in endpoint.split(";")):
            for i, g in zip(missing, self.remote.pull_many(endpoint, [items[i] for i in missing], timeout_s)):
                got[i] = g
                self.routes["remote"] += g is not None
        return got

    def reads_locally(self, endpoint: str) -> bool:
        return self.local.reads_locally(endpoint)

    def prepare_reads(self, endpoint: str, items: list[tuple[int, str, int, int]]) -> None:
        if self.local.reads_locally(endpoint):
            self.local.prepare_reads(endpoint, items)

    def close(self) -> None:
        self.remote.close()
        self.local.close()


def _receive(got: KvRows | None, n: int, dest: torch.Tensor) -> np.ndarray | None:
    """Copy one KV_DATA item into ``dest``; its tokens, or None if missing or not what was asked."""
    if got is None:
        return None
    tokens, rows = got.tokens, got.rows
    if len(tokens) != n or rows.shape != tuple(dest.shape) or rows.dtype != WIRE_DTYPES.get(dest.dtype):
        return None
    if dest.device.type == "cpu" and dest.is_contiguous():  # (one memmove: see shm.PeerFiles.read)
        ctypes.memmove(dest.data_ptr(), rows.ctypes.data, rows.nbytes)
    elif dest.device.type == "cpu":
        np.copyto(host_view(dest), rows)
    else:  # (off the compute stream; the cache waits for it: ``kv/device_copy.py``)
        device_copy.to_device(dest, rows)
    return tokens.copy()


TRANSPORTS = ("auto", "ucx", "zmq", "shm", "shm+zmq", "none")


def resolve_transport(name: str, device: str = "cpu", keys: bool = False) -> str:
    """What ``auto`` means for a worker: UCX for CUDA workers (when ucxx is installed, else
    ZeroMQ); shared memory with same-host peers plus ZeroMQ with the rest for CPU workers; and
    ZeroMQ alone with CURVE keys (neither UCX nor a shared folder is authenticated)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose {', '.join(TRANSPORTS)}")
    if keys and name != "none":
        return "zmq"
    if name != "auto":
        return name
    if device.startswith("cuda"):
        import importlib.util

        return "ucx" if importlib.util.find_spec("ucxx") else "zmq"
    return "shm+zmq"


def make_transport(name: str, identity: Identity | None = None, device: str = "cpu") -> KVTransport | None:
    """The transport ``resolve_transport(name)`` names; ``none`` disables KV moves.

    On CPU, UCX is not the auto choice: measured here (2 cores, bench-kv), a small UCX exchange
    takes ~6 ms in the system (the progress thread, the notifier and the event loop hand each
    completion on; on loaded cores every hand-off waits), and compute waited ~18 % of its time,
    against ~8 % over ZeroMQ and ~1-2 % reading shared memory.
    """
    asked = name
    name = resolve_transport(name, device, identity is not None)
    if name == "none":
        return None
    if name in ("shm", "shm+zmq"):
        if device.startswith("cuda"):
            raise ValueError(f"the {name} KV transport is for CPU workers; use ucx or zmq on GPUs")
        from nebula_flow.kv.shm import ShmTransport

        return ShmTransport() if name == "shm" else LocalFirstTransport(ShmTransport(), ZmqTransport(identity))
    if name == "ucx":
        try:
            from nebula_flow.kv.ucx import UcxTransport

            return UcxTransport()
        except ImportError:  # installed but not loadable (e.g. its CUDA libraries are missing)
            if asked == "ucx":
                raise
            log.warning("ucxx is installed but does not load: KV moves over ZeroMQ")
    return ZmqTransport(identity)
