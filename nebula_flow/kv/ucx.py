"""UCX transport through ucxx: KV rows land directly in the puller's cache rows.

ucxx is asyncio-based, so one daemon thread runs an event loop for both the listener (serving
this worker's KV) and the endpoints (pulling from peers; one cached endpoint per peer).

Progress mode: ``thread`` with Python futures. UCX is progressed by ucxx's own thread, which
sleeps in epoll while nothing happens, and a finished request wakes its asyncio future. The
other modes spin (measured here with ucxx 0.52): in ``polling`` and ``blocking`` a pending
request is awaited by yielding to the event loop again and again, and a KV server always has
a receive pending, so an idle worker took a whole core, and with it the GIL its compute
thread needs (``blocking`` also stops arming its event fd after the first event). Measured
between two processes on the 2-core CPU machine: ~1.3-1.7 ms per small exchange against
~0.4-0.7 ms in ``blocking``, at 2 % of a core idle instead of 100 %. Pulls overlap compute,
so the latency is hidden; a stolen core is not.

Messages on an endpoint (fixed-size int64 headers, same fields as KV_PULL / KV_DATA):
  request  [seq, rid, role, start, end]
  reply    [seq, status (1 = data, 0 = missing), rows, row bytes total, 0, 0]
           then, when status is 1, the int32 tokens and the rows themselves.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

import numpy as np
import torch

# ucxx sets UCX_MEMTYPE_CACHE for older UCX releases; newer ones warn, on stdout, that it is unused
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx  # noqa: E402 - an ImportError here makes make_transport fall back to ZeroMQ

from nebula_flow.kv.transport import PULL_TIMEOUT_S, KVTransport, Lookup, PullItem, endpoint_part, host_view, log

ROLE_CODES = {"draft": 0, "target": 1, "colocated": 2}
ROLE_NAMES = {v: k for k, v in ROLE_CODES.items()}


def _device_buffer(t: torch.Tensor):  # noqa: ANN202
    """What ucxx sends from / receives into: host memory as numpy, CUDA memory as CuPy."""
    if t.device.type == "cpu":
        return host_view(t)
    import cupy

    return cupy.asarray(t.view(torch.uint16) if t.dtype == torch.bfloat16 else t)


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _ucx_loop() -> asyncio.AbstractEventLoop:
    """The process's one UCX event loop, on a daemon thread, started with the first transport.
    UCX is one context per process, bound to the loop it started on: a second loop (a second
    transport after the first was closed, as in a benchmark's repeated raw pulls) crashed."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="kv-ucx", daemon=True).start()

            async def init() -> None:
                try:
                    ucxx.init(progress_mode="thread", enable_python_future=True)
                except RuntimeError:  # already initiated in this process (by another library): use that
                    pass

            asyncio.run_coroutine_threadsafe(init(), loop).result()
            _loop = loop
        return _loop


class UcxTransport(KVTransport):
    scheme = "ucx"

    def __init__(self) -> None:
        self.loop = _ucx_loop()
        self.endpoints: dict[str, object] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.handlers: set[asyncio.Task] = set()
        self.seq = itertools.count(1)
        self.listener = None
        self.served = 0
        self.errors = 0

    def _call(self, coro, timeout: float | None = None):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- serving ---------------------------------------------------------------------------
    def serve(self, host: str, lookup: Lookup) -> str:
        async def start() -> int:
            async def on_connect(ep) -> None:  # noqa: ANN001 - must be a coroutine function for ucxx
                task = asyncio.current_task()
                self.handlers.add(task)
                try:
                    await self._handle(ep, lookup)
                finally:
                    self.handlers.discard(task)

            self.listener = ucxx.create_listener(on_connect, 0)
            return self.listener.port

        port = self._call(start())
        return f"ucx://{host}:{port}"

    async def _handle(self, ep, lookup: Lookup) -> None:  # noqa: ANN001
        req = np.empty(5, dtype=np.int64)
        while True:
            try:
                await ep.recv(req)
            except Exception:  # the peer closed its endpoint
                return
            seq, rid, role, start, end = (int(x) for x in req)
            found = None
            if 0 <= start < end and role in ROLE_NAMES:
                found = lookup(rid, ROLE_NAMES[role], start, end)
            try:
                if found is None:
                    await ep.send(np.array([seq, 0, 0, 0, 0, 0], dtype=np.int64))
                    continue
                tokens, rows = found
                buf = _device_buffer(rows.contiguous())
                await ep.send(np.array([seq, 1, len(tokens), rows.numel() * rows.element_size(), 0, 0], dtype=np.int64))
                await ep.send(np.ascontiguousarray(tokens, dtype=np.int32))
                await ep.send(buf)
                self.served += 1
            except Exception:
                self.errors += 1
                return

    # -- pulling ---------------------------------------------------------------------------
    async def _endpoint(self, endpoint: str):  # noqa: ANN202
        if endpoint not in self.endpoints:
            host, port = endpoint[len("ucx://"):].rsplit(":", 1)
            self.endpoints[endpoint] = await ucxx.create_endpoint(host, int(port))
            self.locks[endpoint] = asyncio.Lock()
        return self.endpoints[endpoint]

    async def _pull(self, endpoint: str, rid: int, role: str, start: int, end: int, dest: torch.Tensor) -> np.ndarray | None:
        ep = await self._endpoint(endpoint)
        async with self.locks[endpoint]:  # one exchange at a time per endpoint keeps messages in order
            seq = next(self.seq)
            await ep.send(np.array([seq, rid, ROLE_CODES[role], start, end], dtype=np.int64))
            reply = np.empty(6, dtype=np.int64)
            await ep.recv(reply)
            if reply[0] != seq or reply[1] != 1:
                return None
            if reply[2] != end - start or reply[3] != dest.numel() * dest.element_size():
                raise ValueError("KV shape mismatch between peers (different model or dtype?)")
            tokens = np.empty(end - start, dtype=np.int32)
            await ep.recv(tokens)
            await ep.recv(_device_buffer(dest))
            return tokens

    def pull_many(self, endpoint: str, items: list[PullItem]) -> list[np.ndarray | None]:
        """The exchanges run back to back on the event loop: one hand-off for the whole batch."""
        endpoint = endpoint_part(endpoint, "ucx://")
        if endpoint is None:  # a peer that speaks no UCX
            return [None] * len(items)

        async def run_all() -> list[np.ndarray | None]:
            return [await self._pull(endpoint, *item) for item in items]

        try:
            return self._call(asyncio.wait_for(run_all(), PULL_TIMEOUT_S), PULL_TIMEOUT_S + 1)
        except Exception as exc:  # peer gone, timeout, mismatch: the caller recomputes
            log.warning("UCX pull from %s failed: %r", endpoint, exc)
            ep = self.endpoints.pop(endpoint, None)
            if ep is not None:
                self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_abort(ep)))
            return [None] * len(items)

    def close(self) -> None:
        """Close this transport's endpoints, listener and server tasks. The process's UCX loop
        stays (the next transport uses it); it is a daemon thread, gone at exit."""
        async def shutdown() -> None:
            for ep in list(self.endpoints.values()):
                await _abort(ep)
            self.endpoints.clear()
            if self.listener is not None:
                self.listener.close()
            # End our server tasks, so that none is left pending: no "Task was destroyed but it
            # is pending" at exit.
            handlers = list(self.handlers)
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        try:
            self._call(shutdown(), 5)
        except Exception:
            pass


async def _abort(ep) -> None:  # noqa: ANN001
    try:
        ep.abort()
    except Exception:
        pass
