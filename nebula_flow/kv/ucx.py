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

Messages on an endpoint (int64 arrays whose sizes both sides know; same fields as KV_PULL /
KV_DATA):
  request  [seq, n, n x [rid, role, start, end]]: a batch's requests to one holder, the i-th
           is request seq + i (one message of at most 2 + 4 FIRST_ITEMS words: the holder's
           receive is posted at that size; past FIRST_ITEMS requests, the rest in a second one)
  reply    per request s: [s, status (1 = data, 0 = missing), positions, row bytes total, 0, 0,
           *tokens] (always 6 + end - start long; tag 2 s), then the rows (tag 2 s + 1; when
           missing, 8 zero bytes instead: the puller's receive for them is already posted).
The puller posts the receives for every reply with the request (the tags keep them apart), and
the holder answers each without waiting for the send: one round trip for the batch, not waits
per request (each UCX wait is several thread hand-offs, ~0.3 ms on a busy machine).
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
from ucxx.exceptions import UCXMessageTruncatedError, UCXMsgTruncated  # noqa: E402

from nebula_flow.kv.link_fit import PULL_TIMEOUT_S
from nebula_flow.kv.transport import (
    KVTransport,
    Lookup,
    PullItem,
    endpoint_part,
    host_view,
    log,
)
from nebula_flow.protocol import MAX_PULL_ITEMS  # noqa: E402

ROLE_CODES = {"draft": 0, "target": 1, "colocated": 2}
ROLE_NAMES = {v: k for k, v in ROLE_CODES.items()}
HEAD = 6  # reply words before the tokens
MAX_POSITIONS = 1 << 24  # a request for more is malformed (its reply alone would be 128 MiB)
NO_ROWS = np.zeros(1, dtype=np.int64)  # the rows message of a "missing" reply
FIRST_ITEMS = 16  # requests in a batch's first message (most batches: one message, one wait)


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
        self.replies: set[asyncio.Future] = set()  # replies being sent (their buffers travel until done)
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
        while True:
            batch = np.zeros(2 + 4 * FIRST_ITEMS, dtype=np.int64)  # (a short message leaves zeros)
            try:
                await ep.recv(batch)
                first, n = int(batch[0]), int(batch[1])
                if not 0 < n <= MAX_PULL_ITEMS:
                    raise ValueError(f"{n} requests in a batch")
                requests = batch[2:].reshape(FIRST_ITEMS, 4)[:n]
                if n > FIRST_ITEMS:
                    rest = np.zeros((n - FIRST_ITEMS, 4), dtype=np.int64)
                    await ep.recv(rest)
                    requests = np.concatenate([requests, rest])
            except (ValueError, UCXMessageTruncatedError, UCXMsgTruncated):
                self.errors += 1  # (malformed: no reply of a size the peer expects can be made)
                return
            except Exception:  # the peer closed its endpoint
                return
            for seq, (rid, role, start, end) in enumerate(requests.tolist(), first):
                if not (0 <= start < end and end - start <= MAX_POSITIONS and role in ROLE_NAMES):
                    self.errors += 1
                    return
                self._reply(ep, seq, lookup(rid, ROLE_NAMES[role], start, end), end - start)

    def _reply(self, ep, seq: int, found: tuple[np.ndarray, torch.Tensor] | None, n: int) -> None:  # noqa: ANN001
        """Send request ``seq``'s reply (``n`` positions asked), without waiting for it to go."""
        head = np.zeros(HEAD + n, dtype=np.int64)
        head[0] = seq
        rows = NO_ROWS
        if found is not None:
            tokens, kv = found
            head[1:4] = 1, len(tokens), kv.numel() * kv.element_size()
            head[HEAD:] = tokens
            rows = _device_buffer(kv.contiguous())
            self.served += 1
        reply = asyncio.gather(ep.send(head, tag=2 * seq), ep.send(rows, tag=2 * seq + 1))
        self.replies.add(reply)
        reply.add_done_callback(self._sent)

    def _sent(self, reply: asyncio.Future) -> None:
        self.replies.discard(reply)
        if not reply.cancelled() and reply.exception() is not None:  # (the peer went away mid-reply)
            self.errors += 1

    # -- pulling ---------------------------------------------------------------------------
    async def _endpoint(self, endpoint: str):  # noqa: ANN202
        if endpoint not in self.endpoints:
            host, port = endpoint[len("ucx://"):].rsplit(":", 1)
            self.endpoints[endpoint] = await ucxx.create_endpoint(host, int(port))
            self.locks[endpoint] = asyncio.Lock()
        return self.endpoints[endpoint]

    async def _pull_all(self, endpoint: str, items: list[PullItem]) -> list[np.ndarray | None]:
        ep = await self._endpoint(endpoint)
        async with self.locks[endpoint]:  # one batch at a time per endpoint keeps messages in order
            seqs = [next(self.seq) for _ in items]  # (consecutive: nothing else runs on the loop meanwhile)
            heads = [np.empty(HEAD + end - start, dtype=np.int64) for _, _, start, end, _ in items]
            words = [seqs[0], len(items)] + [w for rid, role, start, end, _ in items for w in (rid, ROLE_CODES[role], start, end)]
            cut = 2 + 4 * FIRST_ITEMS
            # The requests and every receive at once: the holder answers while we receive.
            sending = asyncio.gather(*(ep.send(np.array(part, dtype=np.int64)) for part in (words[:cut], words[cut:]) if part))
            receiving = asyncio.gather(*(r for seq, head, (*_, dest) in zip(seqs, heads, items)
                                         for r in (ep.recv(head, tag=2 * seq), ep.recv(_device_buffer(dest), tag=2 * seq + 1))))
            try:
                await receiving
                await sending
            finally:  # (both done by now, unless one failed: then the endpoint is dropped)
                sending.cancel()
                receiving.cancel()
        got: list[np.ndarray | None] = []
        for seq, head, (_, _, start, end, dest) in zip(seqs, heads, items):
            if head[0] != seq or head[1] != 1:
                got.append(None)  # (missing: ``dest`` holds 8 zero bytes, beyond what the cache holds)
            elif head[2] != end - start or head[3] != dest.numel() * dest.element_size():
                raise ValueError("KV shape mismatch between peers (different model or dtype?)")
            else:
                got.append(head[HEAD:].astype(np.int32))
        return got

    def pull_many(self, endpoint: str, items: list[PullItem], timeout_s: float = PULL_TIMEOUT_S) -> list[np.ndarray | None]:
        """One hand-off to the event loop and one round trip for the whole batch."""
        endpoint = endpoint_part(endpoint, "ucx://")
        if not items:
            return []
        if endpoint is None:  # a peer that speaks no UCX
            return [None] * len(items)

        try:
            return self._call(asyncio.wait_for(self._pull_all(endpoint, items), timeout_s), timeout_s + 1)
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
            pending = [*self.handlers, *self.replies]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        try:
            self._call(shutdown(), 5)
        except Exception:
            pass


async def _abort(ep) -> None:  # noqa: ANN001
    try:
        ep.abort()
    except Exception:
        pass
