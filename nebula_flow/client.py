"""The ZeroMQ client library: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    from nebula_flow.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        out = c.generate("def fib(n):", max_new_tokens=32)
        print(out.text, out.rounds, out.tokens_per_round, out.ttft_s)
        for chunk in c.stream("Once upon a time", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

A ``Client`` may be shared by threads (each thread talks to the broker over a connection of its
own, made at its first request) and streams interleaved in one thread; ``AsyncClient`` runs any
number of requests concurrently over one socket. TTFT and latency are measured here, on the client's
clock, from the moment the request is sent.
"""

from __future__ import annotations

import asyncio
import numbers
import os
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from nebula_flow import protocol, zmq_frames
from nebula_flow.broker_link import Conn

# (what the library hands back is part of its API)
from nebula_flow.outputs import (  # noqa: F401
    Busy,
    Chunk,
    Collector,
    Completion,
    NebulaError,
    RequestError,
    RequestTimeout,
    Tokenization,
)
from nebula_flow.params import SamplingParams, is_int
from nebula_flow.protocol import Cancel, Chunks, Done, Error, Msg, ProtocolError, State, Status, Submit, Tokens
from nebula_flow.resume import resend, seeded
from nebula_flow.shards import addresses as shard_addresses
from nebula_flow.shards import merge_states, route, shard_of

STATUS = "(status)"  # the blocking client's mailbox for a broker's STATE (no request id: ids are hex)


def token_array(ids: Any, name: str = "token_ids", what: str = "a list of token ids (ints >= 0)") -> np.ndarray:  # noqa: ANN401
    """``ids`` (a list of token ids) as the wire's int32 array, refused in words where it is not
    one: numpy would cut 1.5 to 1 in silence, and read "abc" as an error about int()."""
    values = ids.tolist() if hasattr(ids, "tolist") else ids  # (a numpy array or a torch tensor)
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be {what}, got {type(ids).__name__}")
    for value in values:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value < 2**31:
            raise ValueError(f"{name} must be {what}, got {value!r} among them")
    return np.asarray(values, dtype=np.int32)


def check_client(timeout_s: float, retries: int) -> None:
    """A client's settings, refused in words (zmq says "Invalid argument" to a negative timeout)."""
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if not is_int(retries) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")


def build_submit(req_id: str, prompt: str | None, token_ids: list[int] | None, chat: bool, session: str | None = None,
                 messages: list[dict[str, Any]] | None = None, chat_options: dict[str, Any] | None = None,
                 prediction: str | list[int] | None = None, *, compile_grammar: bool = True, **params: Any) -> Submit:
    """The SUBMIT message for one request (parameters validated before they leave): ``prompt``
    (``chat``: as one user message), ``token_ids``, or ``messages`` (a conversation, with the chat
    template's ``chat_options``). ``prediction``: what the output is expected to be, as text or
    token ids (OpenAI's Predicted Outputs): the output is the same, quicker where it matches.
    ``compile_grammar`` False: a structured output's grammar is checked in shape only (a check
    ahead of the real submission, which compiles it)."""
    if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, token_ids and messages")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"prompt must be text, got {type(prompt).__name__} (token ids go in token_ids=)")
    sp = SamplingParams.from_wire(params, grammar=compile_grammar)  # (the broker's checks: InvalidParams)
    if prediction is not None and not isinstance(prediction, str):
        prediction = token_array(prediction, "prediction", "text or a list of token ids (ints >= 0)")
    return Submit(req_id, sp.to_wire(), prompt, None if token_ids is None else token_array(token_ids),
                  chat, session, messages, chat_options, prediction if isinstance(prediction, str) else None,
                  prediction if isinstance(prediction, np.ndarray) else None)


async def completion_of(items: AsyncIterator[Chunk | Completion]) -> Completion:
    """The ``Completion`` that ends a stream of chunks (an async client's ``generate``)."""
    async for item in items:
        if isinstance(item, Completion):
            return item
    raise NebulaError("the stream ended without a result")


def _raise_error(err: Error) -> None:
    cls = Busy if err.code == "busy" else RequestError
    raise cls(err.code, err.message)


def build_tokenize(text: str | None = None, messages: list[dict[str, Any]] | None = None,
                   chat_options: dict[str, Any] | None = None, token_ids: list[int] | None = None,
                   special: bool | None = None, pieces: bool = False) -> protocol.Tokenize:
    """A TOKENIZE of one of ``text``, ``messages`` (a conversation through the chat template) and
    ``token_ids`` (to text); ``special``: the tokenizer's special tokens added (default: to a text,
    not to a conversation, whose template writes its own, as vLLM's ``/tokenize``)."""
    if sum(x is not None for x in (text, messages, token_ids)) != 1:
        raise ValueError("give exactly one of text, messages and token_ids")
    ids = None if token_ids is None else token_array(token_ids).astype(np.int64)
    if special is None:
        special = messages is None
    return protocol.Tokenize(uuid.uuid4().hex, text, messages, chat_options, ids, special, pieces)


def _tokenization(reply: Msg) -> Tokenization:
    if isinstance(reply, Error):
        _raise_error(reply)
    return Tokenization(reply.token_ids.tolist(), reply.max_model_len, reply.text, reply.pieces)


class Client:
    """Blocking client. ``timeout_s`` bounds the wait for each message from the broker; after
    a timeout the request is resent ``retries`` times with the same id (idempotent). A request
    in flight when the connection to the broker drops is sent again as soon as it is back."""

    def __init__(self, address: str, timeout_s: float = 120.0, retries: int = 0, keys: str | None = None) -> None:
        """``address``: the broker's, or a sharded deployment's shards' separated by commas."""
        check_client(timeout_s, retries)
        self.address, self.timeout_s, self.retries, self.keys = address, timeout_s, retries, keys
        self.session = secrets.token_hex(16)  # (without keys: what proves these requests are ours)
        # (a ZeroMQ socket is one thread's: each thread gets its own connections; two threads on one
        # socket each took, and dropped, the other's messages, and both waited out their timeout)
        self._local, self._opened, self._lock, self._pid = threading.local(), [], threading.Lock(), os.getpid()
        self.conns  # noqa: B018 (this thread's, made now: a bad address is an error here)

    @property
    def conns(self) -> list[Conn]:
        """The calling thread's connections, one per shard."""
        if self._pid != os.getpid() and self._local is not None:
            # (a forked child, e.g. multiprocessing's: its parent's sockets are not its own to use)
            self._local, self._opened, self._lock, self._pid = threading.local(), [], threading.Lock(), os.getpid()
        conns = getattr(self._local, "conns", None)
        if conns is None and self._local is None:
            raise NebulaError("this client is closed")
        if conns is None:
            conns = self._local.conns = [Conn(zmq.Context.instance(), a, self.keys) for a in shard_addresses(self.address)]
            for conn in conns:
                conn.sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))  # no broker: never block forever
                conn.poller = zmq.Poller()
                conn.poller.register(conn.sock, zmq.POLLIN)
                conn.poller.register(conn.monitor, zmq.POLLIN)
            with self._lock:
                self._opened.extend(conns)
        return conns

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
        for conn in opened:  # (every thread's)
            conn.close()
        self._local = None

    def wait_connected(self, timeout_s: float) -> None:
        """Wait until the connection to every broker is made; ``RequestTimeout`` naming one that is
        not within ``timeout_s``. A request to an address where no broker runs would otherwise wait
        its whole timeout in silence (the CLI's `generate` asks this first)."""
        deadline = time.monotonic() + timeout_s
        for conn in self.conns:
            if conn.wait_up(deadline):
                continue
            if (why := conn.refusal()) is not None:
                raise RequestError("handshake_failed", f"cannot talk to {conn.address}: {why}")
            raise RequestTimeout(f"cannot reach {conn.address} within {timeout_s:.0f} s (no broker there, or "
                                 "it refused this client's keys)")

    def _send(self, conn: Conn, msg: Msg, block: bool = True) -> None:
        try:
            zmq_frames.send(conn.sock, protocol.encode(msg), 0 if block else zmq_frames.NOBLOCK)
        except zmq.Again:
            if block:
                raise RequestTimeout(f"cannot reach {conn.address} (not running, or keys refused)") from None
        except zmq.ZMQError:  # (a CANCEL of a stream finalized after close(): nothing to cancel it on)
            if block:
                raise

    def _recv(self, conn: Conn, key: str, timeout_s: float | None = None) -> Msg | None:
        """The next message from that broker for ``key`` (a request id, or ``STATUS``), whose mailbox
        the caller opened; None when the connection was made again after dropping (the caller sends
        what it has in flight again). Messages for the thread's other open mailboxes (streams read
        in turns) wait in theirs; those for none (an abandoned request's) are dropped."""
        box = conn.boxes[key]
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        while not box and (left := deadline - time.monotonic()) > 0:
            events = dict(conn.poller.poll(int(left * 1000) + 1))
            if conn.monitor in events and conn.link.event(conn.monitor.recv_multipart()):
                for waiting in conn.boxes.values():
                    waiting.append(None)
            if conn.sock in events:
                msg = protocol.decode(zmq_frames.recv(conn.sock))
                for item in msg.chunks if isinstance(msg, Chunks) else [msg]:
                    to = getattr(item, "req_id", None) or (STATUS if isinstance(item, State) else None)
                    if to is None:  # (an error that names no request: every caller's)
                        for waiting in conn.boxes.values():
                            waiting.append(item)
                    elif to in conn.boxes:
                        conn.boxes[to].append(item)
        if box:
            return box.popleft()
        raise RequestTimeout(f"no answer from {conn.address} within {timeout_s:.0f} s")

    def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None, chat: bool = False,
               **params: Any) -> Iterator[Chunk | Completion]:
        """Yield a ``Chunk`` per verify step, then the final ``Completion``. Besides ``SamplingParams``:
        ``request_id`` (default: a new one), ``prompt_cache_key`` (requests sharing one go to one
        broker shard: ``shards.route``)."""
        req_id = params.pop("request_id", None) or uuid.uuid4().hex
        conn = self.conns[route(req_id, params.pop("prompt_cache_key", None), len(self.conns))]
        submit = build_submit(req_id, prompt, token_ids, chat, self.session, **seeded(params))
        conn.boxes[req_id] = deque()  # (its mailbox holds its own messages only: ``_recv``)
        col = Collector()
        finished, attempts = False, 0
        try:
            self._send(conn, submit)
            while True:
                try:
                    msg = self._recv(conn, req_id)
                except RequestTimeout:
                    if attempts >= self.retries:
                        raise
                    attempts += 1  # same req_id: the broker re-attaches or replays, never duplicates
                    self._send(conn, resend(submit, col))
                    continue
                if msg is None:  # a new connection (a restarted broker): send it again
                    self._send(conn, resend(submit, col))
                    continue
                if isinstance(msg, Tokens):
                    chunk = col.chunk(msg)
                    if chunk is not None:
                        yield chunk
                elif isinstance(msg, Done):
                    finished = True
                    yield from col.finish(msg)
                    return
                elif isinstance(msg, Error):
                    finished = True
                    _raise_error(msg)
        finally:
            conn.boxes.pop(req_id, None)
            if not finished:  # abandoned (or timed out): the broker should stop working on it
                self._send(conn, Cancel(req_id, self.session), block=False)

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run one request to the end; see ``SamplingParams`` for the keyword arguments."""
        for item in self.stream(prompt, **kwargs):
            if isinstance(item, Completion):
                return item
        raise NebulaError("the stream ended without a result")

    def status(self) -> dict[str, Any]:
        """The broker's state (``nebula-flow status --json``); a sharded deployment's merged."""
        return merge_states([self._status(conn) for conn in self.conns])

    def tokenize(self, text: str | None = None, **kwargs: Any) -> Tokenization:
        """The broker's tokenizer at work, nothing run: ``text`` or ``messages=`` to token ids, or
        ``token_ids=`` to text (``build_tokenize``'s arguments)."""
        msg = build_tokenize(text, **kwargs)
        conn = self.conns[shard_of(msg.req_id, len(self.conns))]
        conn.boxes[msg.req_id] = deque()
        try:
            self._send(conn, msg)
            while True:
                reply = self._recv(conn, msg.req_id)
                if reply is None:  # (the connection was made again: ask again)
                    self._send(conn, msg)
                elif getattr(reply, "req_id", None) == msg.req_id:
                    return _tokenization(reply)
        finally:
            conn.boxes.pop(msg.req_id, None)

    def _status(self, conn: Conn) -> dict[str, Any]:
        conn.boxes[STATUS] = deque()
        try:
            self._send(conn, Status())
            while True:
                msg = self._recv(conn, STATUS, min(self.timeout_s, 10.0))
                if msg is None:
                    self._send(conn, Status())
                elif isinstance(msg, State):
                    return msg.state
                elif isinstance(msg, Error):  # (e.g. this is a broker's worker address, not its client address)
                    _raise_error(msg)
        finally:
            conn.boxes.pop(STATUS, None)


class AsyncClient:
    """asyncio client: many concurrent requests over one socket, dispatched by req_id. As
    ``Client``: after a timeout a request is resent ``retries`` times with the same id, and what is
    in flight when the connection drops is sent again as soon as it is back."""

    def __init__(self, address: str, timeout_s: float = 120.0, keys: str | None = None, retries: int = 0) -> None:
        """``address``: the broker's, or a sharded deployment's shards' separated by commas."""
        check_client(timeout_s, retries)
        self.address, self.timeout_s, self.retries = address, timeout_s, retries
        self.session = secrets.token_hex(16)  # (without keys: what proves these requests are ours)
        self.conns = [Conn(zmq.asyncio.Context.instance(), a, keys) for a in shard_addresses(address)]
        self.queues: dict[str, asyncio.Queue[Msg]] = {}
        # sent again when a dropped connection is back (a request's with what its stream had: ``resend``)
        self.inflight: dict[str, tuple[Conn, Msg, Collector | None]] = {}
        self.tasks: list[asyncio.Task] = []  # each connection's reader and watcher
        self.started = 0.0
        self.closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for conn in self.conns:
            conn.close()
        self.closed = True

    def start(self) -> None:
        """Read this loop's connections from now on (each call does it when it must: a caller that needs
        their state before its first request, as ``unreachable`` reports it, calls this first)."""
        if self.closed:
            raise NebulaError("this client is closed")
        if self.tasks and (before := self.tasks[0].get_loop()) is not asyncio.get_running_loop():
            if before.is_running():  # (two loops would read one socket, each dropping the other's replies)
                raise RuntimeError("this AsyncClient is in use on another event loop: give each loop its own")
            self.tasks, self.queues, self.inflight = [], {}, {}  # (asyncio.run again: its readers ended with the last)
        if not self.tasks:
            for i, conn in enumerate(self.conns):
                self.tasks += [asyncio.ensure_future(self._read(i, conn)), asyncio.ensure_future(self._watch(conn))]
            self.started = time.monotonic()  # (from here on the monitors are read: ``unreachable``)

    async def _watch(self, conn: Conn) -> None:
        """Send every request in flight to that broker again when its dropped connection is back."""
        while True:
            if conn.link.event(await conn.monitor.recv_multipart()):
                for to, msg, col in list(self.inflight.values()):
                    if to is conn:
                        await conn.sock.send_multipart(protocol.encode(resend(msg, col) if col is not None else msg), copy=False)

    async def _read(self, index: int, conn: Conn) -> None:
        while True:
            frames = await conn.sock.recv_multipart(copy=False)
            try:
                msg = protocol.decode(frames)
            except ProtocolError:
                continue
            for one in msg.chunks if isinstance(msg, Chunks) else (msg,):
                key = getattr(one, "req_id", None) or (f"__status__{index}" if isinstance(one, State) else None)
                if key in self.queues:
                    self.queues[key].put_nowait(one)
                elif key is None and isinstance(one, Error):  # (an error that names no request: each one's of that broker)
                    for waiting, (to, _, _) in list(self.inflight.items()):
                        if to is conn and waiting in self.queues:
                            self.queues[waiting].put_nowait(one)

    async def _send(self, conn: Conn, msg: Msg) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await conn.sock.send_multipart(protocol.encode(msg), copy=False)
        except TimeoutError:
            raise RequestTimeout(f"cannot reach {conn.address} (not running, or keys refused)") from None

    async def _next(self, queue: asyncio.Queue[Msg]) -> Msg:
        # (asyncio.timeout, not wait_for: wait_for runs the wait as a task of its own, a cost paid
        # per message by a gateway streaming many requests)
        if not queue.empty():
            return queue.get_nowait()
        try:
            async with asyncio.timeout(self.timeout_s):
                return await queue.get()
        except TimeoutError:
            raise RequestTimeout(f"no answer from {self.address} within {self.timeout_s:.0f} s") from None

    async def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None, chat: bool = False,
                     **params: Any) -> AsyncIterator[Chunk | Completion]:
        self.start()
        req_id = params.pop("request_id", None) or uuid.uuid4().hex
        conn = self.conns[route(req_id, params.pop("prompt_cache_key", None), len(self.conns))]
        msg = build_submit(req_id, prompt, token_ids, chat, self.session, **seeded(params))
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.queues[req_id] = queue
        col = Collector()
        self.inflight[req_id] = (conn, msg, col)
        await self._send(conn, msg)
        finished, attempts = False, 0
        try:
            while True:
                try:
                    reply = await self._next(queue)
                except RequestTimeout:
                    if attempts >= self.retries:
                        raise
                    attempts += 1  # same req_id: the broker re-attaches or replays, never duplicates
                    await self._send(conn, resend(msg, col))
                    continue
                if isinstance(reply, Tokens):
                    chunk = col.chunk(reply)
                    if chunk is not None:
                        yield chunk
                elif isinstance(reply, Done):
                    finished = True
                    for item in col.finish(reply):
                        yield item
                    return
                elif isinstance(reply, Error):
                    finished = True
                    _raise_error(reply)
        finally:
            self.queues.pop(req_id, None)
            self.inflight.pop(req_id, None)
            if not finished:
                try:
                    await conn.sock.send_multipart(protocol.encode(Cancel(req_id, self.session)),
                                                   flags=zmq.NOBLOCK)
                except zmq.ZMQError:  # (no room to queue it, or the client was closed)
                    pass

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return await completion_of(self.stream(prompt, **kwargs))

    async def status(self) -> dict[str, Any]:
        """The broker's state; a sharded deployment's merged (``shards.merge_states``)."""
        self.start()
        return merge_states(list(await asyncio.gather(*(self._status(i, c) for i, c in enumerate(self.conns)))))

    async def tokenize(self, text: str | None = None, **kwargs: Any) -> Tokenization:
        """As ``Client.tokenize``."""
        self.start()
        msg = build_tokenize(text, **kwargs)
        queue: asyncio.Queue[Msg] = self.queues.setdefault(msg.req_id, asyncio.Queue())
        conn = self.conns[shard_of(msg.req_id, len(self.conns))]
        self.inflight[msg.req_id] = (conn, msg, None)  # (asked again on a new connection too)
        try:
            await self._send(conn, msg)
            return _tokenization(await self._next(queue))
        finally:
            self.queues.pop(msg.req_id, None)
            self.inflight.pop(msg.req_id, None)

    def refusal(self) -> str | None:
        """Why a broker's connection failed its handshake (``Conn.refusal``: keys, or no broker there), if one did."""
        return next((f"{conn.address}: {why}" for conn in self.conns if (why := conn.refusal()) is not None), None)

    def unreachable(self, for_s: float) -> str | None:
        """Why a broker is not connected, where it has not been for ``for_s`` (None: every one is, or it
        is too soon to say: its connection is followed from the first call on): what ``/health`` answers
        at once, where asking the broker would wait out a timeout."""
        self.start()
        now = time.monotonic()
        for conn in self.conns:
            if not conn.link.up and now - max(conn.link.since, self.started) >= for_s:
                return f"{conn.address}: " + (conn.refusal() or f"not connected for {now - conn.link.since:.0f} s "
                                              "(nothing listens there, or it is restarting)")
        return None

    async def _status(self, index: int, conn: Conn) -> dict[str, Any]:
        key = f"__status__{index}"
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.queues[key] = queue
        self.inflight[key] = (conn, Status(), None)  # (asked again on a new connection too)
        try:
            await self._send(conn, Status())
            if isinstance(answer := await self._next(queue), Error):
                _raise_error(answer)
            return answer.state
        finally:
            self.queues.pop(key, None)
            self.inflight.pop(key, None)
