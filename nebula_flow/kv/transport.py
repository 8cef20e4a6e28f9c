"""KV transports: how one worker pulls a request's KV positions from the worker holding them.

One small interface, two implementations:

* ``ZmqTransport``: ROUTER server thread + one DEALER per peer; rows travel as one zero-copy
  frame. Always available; the fallback.
* ``UcxTransport`` (``nebula_flow/kv/ucx.py``): ucxx endpoints, rows received straight into
  the destination cache rows (host memory on CPU, CUDA memory on GPU). The default when
  ucxx is installed.

A server answers ``lookup(rid, role, start, end) -> (tokens, rows) | None`` where ``rows`` is
the contiguous slice ``cache.buf[start:end]`` (see ``kv/cache.py`` for the layout). A pull
receives into ``dest`` (the puller's own cache rows) and returns the tokens those positions
hold, or None when the holder cannot serve them (the caller then recomputes).
"""

from __future__ import annotations

import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zmq

from nebula_flow import protocol
from nebula_flow.protocol import Message, ProtocolError

log = logging.getLogger("nebula_flow.kv")
Lookup = Callable[[int, str, int, int], "tuple[np.ndarray, torch.Tensor] | None"]
PULL_TIMEOUT_S = 2.0  # a holder slower than this is treated as gone: recomputing is cheaper


def host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (bf16 seen as uint16: bytes are what travel)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


class KVTransport(ABC):
    """Serve this worker's KV to peers; pull peers' KV into local buffers."""

    scheme: str

    @abstractmethod
    def serve(self, host: str, lookup: Lookup) -> str:
        """Start serving in the background; returns the endpoint peers should use."""

    @abstractmethod
    def pull(self, endpoint: str, rid: int, role: str, start: int, end: int, dest: torch.Tensor) -> np.ndarray | None:
        """Fill ``dest`` (rows start..end) from the peer; returns their tokens, or None."""

    @abstractmethod
    def close(self) -> None: ...


class ZmqTransport(KVTransport):
    scheme = "tcp"

    def __init__(self, keys: Path | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.keys = keys  # CURVE: peers must hold an authorised worker key
        self.auth = None
        self.peers: dict[str, zmq.Socket] = {}
        self.seq = itertools.count(1)
        self.served = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def serve(self, host: str, lookup: Lookup) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys:
            from nebula_flow.security import make_server, start_authenticator

            self.auth = start_authenticator(self.keys)
            make_server(sock, self.keys, "worker")
        port = sock.bind_to_random_port(f"tcp://{host}")
        self._thread = threading.Thread(target=self._serve_loop, args=(sock, lookup), name="kv-server", daemon=True)
        self._thread.start()
        return f"tcp://{host}:{port}"

    def _serve_loop(self, sock: zmq.Socket, lookup: Lookup) -> None:
        while not self._stop.is_set():
            if not sock.poll(200):
                continue
            ident, *frames = sock.recv_multipart(copy=False)
            try:
                req = protocol.decode(frames)
                if req.kind != "KV_PULL":
                    raise ProtocolError("unexpected_kind", f"{req.kind} is not a KV request")
                h = req.header
                if not 0 <= h["start"] < h["end"]:
                    raise ProtocolError("malformed", "need 0 <= start < end")
                found = lookup(h["rid"], h["role"], h["start"], h["end"])
                if found is None:
                    reply = Message("KV_MISSING", {"seq": h["seq"]})
                else:
                    tokens, rows = found
                    reply = Message("KV_DATA", {"seq": h["seq"]})
                    reply.header["tokens"] = reply.add_array(np.asarray(tokens, dtype=np.int32))
                    reply.header["rows"] = reply.add_array(host_view(rows))
                    self.served += 1
            except ProtocolError as exc:
                self.errors += 1
                reply = protocol.error(exc.code, exc.message)
            try:
                sock.send_multipart([ident, *protocol.encode(reply)], copy=False, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                self.errors += 1
        sock.close()

    def _peer(self, endpoint: str) -> zmq.Socket:
        sock = self.peers.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.keys:
                from nebula_flow.security import make_client

                make_client(sock, self.keys, "worker", server="worker")
            sock.connect(endpoint)
            self.peers[endpoint] = sock
        return sock

    def pull(self, endpoint: str, rid: int, role: str, start: int, end: int, dest: torch.Tensor) -> np.ndarray | None:
        sock = self._peer(endpoint)
        seq = next(self.seq)
        sock.send_multipart(protocol.encode(Message("KV_PULL", {"seq": seq, "rid": rid, "role": role,
                                                                "start": start, "end": end})))
        while True:
            if not sock.poll(int(PULL_TIMEOUT_S * 1000)):
                # The peer is gone or stuck: drop the socket so a late reply cannot confuse us.
                self.peers.pop(endpoint).close()
                return None
            reply = protocol.decode(sock.recv_multipart(copy=False))
            if reply.header.get("seq") != seq:
                continue  # a late answer to an earlier, abandoned pull
            if reply.kind != "KV_DATA":
                return None
            tokens = reply.array(reply.header["tokens"])
            rows = reply.array(reply.header["rows"])
            target = host_view(dest) if dest.device.type == "cpu" else None
            if len(tokens) != end - start or rows.shape != tuple(dest.shape) or (
                    target is not None and rows.dtype != target.dtype):
                return None
            if target is not None:
                np.copyto(target, rows)
            else:
                dest.copy_(torch.from_numpy(rows.copy()).view(dest.dtype).to(dest.device))
            return tokens.copy()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for sock in self.peers.values():
            sock.close()
        self.peers.clear()
        if self.auth is not None:
            self.auth.stop()


def make_transport(name: str, keys: Path | None = None, device: str = "cpu") -> KVTransport | None:
    """``auto`` = UCX for CUDA workers when ucxx imports, else ZeroMQ; ``none`` disables KV moves.

    On CPU, ZeroMQ is the auto choice: measured here, in-system UCX pulls were slower than
    ZeroMQ and an idle UCX worker kept ~1/3 of a core busy progressing its event loop.
    """
    if name == "none":
        return None
    if name == "auto" and not device.startswith("cuda"):
        name = "zmq"
    if name in ("ucx", "auto") and keys is None:
        try:
            from nebula_flow.kv.ucx import UcxTransport

            return UcxTransport()
        except ImportError:
            if name == "ucx":
                raise
            log.info("ucxx is not installed: KV moves over ZeroMQ")
    if name in ("zmq", "auto"):
        return ZmqTransport(keys)
    raise ValueError(f"unknown KV transport {name!r}; choose auto, ucx, zmq or none")
