"""``HttpClient``: the HTTP API spoken with ``AsyncClient``'s interface, so that `bench` and
`replay` measure what users of the front door see (``--api URL``).

Each request streams (server-sent events) with ``return_token_ids`` and the usage, and yields
the same ``Chunk`` and ``Completion`` objects as the ZeroMQ client, timed on this client's clock
from the moment the request is sent.

It speaks HTTP with aiohttp, not httpx: a load generator shares the host with what it measures.
With aiohttp's C parser, a streamed token costs ~10-20 us of CPU more than through the ZeroMQ
client; with httpx it cost ~65 us more. On a 2-core host that difference showed up as the
gateway's "overhead" (``docs/benchmarks.md``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import aiohttp
import orjson

from nebula_flow.client import Busy, Chunk, Completion, NebulaError, RequestError, completion_of

PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "seed": "seed", "stop": "stop", "ignore_eos": "ignore_eos", "structured": "structured_outputs",
          "logit_bias": "logit_bias", "prediction": "prediction", "cache_salt": "cache_salt",
          "priority": "priority", "prompt_cache_key": "prompt_cache_key"}


class HttpClient:
    """Streams requests to the gateway at ``url`` (``http://host:port``); ``api_key`` if it wants one."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        # (a read waits at most timeout_s for the next bytes, as the ZeroMQ client waits for its next message)
        self.timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
        self._http: aiohttp.ClientSession | None = None  # made in the event loop that uses it
        self.served: dict[str, Any] | None = None  # what /v1/models lists (asked once)

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:  # (no cap on connections: each concurrent stream holds one)
            self._http = aiohttp.ClientSession(self.url, headers=self.headers, timeout=self.timeout,
                                               connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20)
        return self._http

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()

    async def served_model(self) -> dict[str, Any]:
        """The model the gateway serves, as ``/v1/models`` lists it (``id``, ``max_model_len``)."""
        if self.served is None:
            try:
                async with self.http.get("/v1/models") as res:
                    content = await res.read()
                _check(res.status, content)
                self.served = orjson.loads(content)["data"][0]
            except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as exc:
                why = not_http(exc) or str(exc)
                raise NebulaError(f"the HTTP API at {self.url} does not answer /v1/models: {why}") from None
        return self.served

    async def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None, chat: bool = False,
                     messages: list[dict[str, Any]] | None = None, **params: Any) -> AsyncIterator[Chunk | Completion]:
        """As the client library's: a ``prompt`` (``chat``: as one user message), ``token_ids``, or
        ``messages`` (a conversation, to chat completions)."""
        body: dict[str, Any] = {"model": (await self.served_model())["id"], "stream": True, "return_token_ids": True,
                                "stream_options": {"include_usage": True}, "temperature": 0.0}
        for name, value in params.items():
            if name not in PARAMS:
                raise ValueError(f"the HTTP API takes no {name!r} here")
            if value is not None:
                body[PARAMS[name]] = list(value) if name == "stop" else \
                    {str(t): b for t, b in value.items()} if name == "logit_bias" else \
                    {"type": "content", "content": value} if name == "prediction" else value
        if chat or messages is not None:
            chat, path = True, "/v1/chat/completions"
            body["messages"] = messages if messages is not None else [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt if token_ids is None else list(token_ids)
        t0 = time.monotonic()
        tokens: list[int] = []
        text, times, counts, last = [], [], [], None
        try:
            async with aclosing(self._events(path, body)) as events:  # (left early: the response closes now)
                async for event in events:
                    if "error" in event:
                        raise RequestError(str(event["error"].get("code")), event["error"].get("message", ""))
                    if not event["choices"]:  # the usage, last
                        last = dict(last or {}, usage=event["usage"])
                        continue
                    choice = event["choices"][0]
                    piece = choice["delta"].get("content") or "" if chat else choice.get("text", "")
                    ids = choice.get("token_ids") or []
                    if ids or piece:
                        t = time.monotonic() - t0
                        tokens += ids
                        text.append(piece)
                        times.append(t)
                        counts.append(len(ids))
                        yield Chunk(ids, piece, t)
                    if choice.get("finish_reason"):
                        last = dict(last or {}, reason=choice["finish_reason"], spec=event.get("speculative", {}))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise NebulaError(f"the HTTP API at {self.url} failed mid-request: {exc!r}") from None
        if last is None or "reason" not in last:
            raise NebulaError(f"the stream from {self.url} ended without a finish")
        spec, latency = last.get("spec", {}), time.monotonic() - t0
        usage = last.get("usage", {})
        stats = {"prompt_tokens": usage.get("prompt_tokens", 0), "proposed": spec.get("draft_tokens_proposed", 0),
                 "accepted": spec.get("draft_tokens_accepted", 0),
                 "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
        yield Completion("".join(text), tokens, last["reason"], spec.get("rounds", 0), spec.get("tokens_per_round", []),
                         times[0] if times else latency, latency, times, stats, counts)

    async def _events(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON events of the server-sent stream that POSTing ``body`` to ``path`` answers."""
        async with self.http.post(path, data=orjson.dumps(body)) as res:
            if res.status != 200:
                _check(res.status, await res.read())
            async for line in res.content:  # (one line at a time; events are "data: ..." lines)
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    yield orjson.loads(line[6:])

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return await completion_of(self.stream(prompt, **kwargs))


def served_model(url: str, api_key: str | None = None) -> dict[str, Any]:
    """``HttpClient.served_model`` of the gateway at ``url``, from synchronous code."""
    async def ask() -> dict[str, Any]:
        async with HttpClient(url, api_key, timeout_s=10) as client:
            return await client.served_model()

    return asyncio.run(ask())


def not_http(exc: BaseException) -> str | None:
    """What the server is, where its answer was not HTTP at all (aiohttp's "Bad status line"), from
    the first bytes it sent; else None. A broker's ZeroMQ port opens with ZeroMQ's greeting (ZMTP:
    0xFF, eight bytes, 0x7F), the usual mistake: its client address given where the gateway's is."""
    message = str(getattr(exc, "message", ""))
    if not isinstance(exc, aiohttp.ClientResponseError) or "Bad status line" not in message:
        return None
    if "\\xff" in message and "\\x7f" in message:
        return ("it answers in ZeroMQ, not HTTP: that is a broker's address (give it to --broker, without --api; "
                "the HTTP API is what `serve --http-port` or `nebula-flow api` starts)")
    return "it does not answer in HTTP"


def _check(status: int, content: bytes) -> None:
    """Raise the client library's error for an HTTP error answer."""
    if status == 200:
        return
    try:
        err = orjson.loads(content)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        err = {"message": content[:200].decode(errors="replace"), "code": None}
    if status == 429:
        raise Busy("busy", err.get("message", ""))
    raise RequestError(str(err.get("code") or status), err.get("message", ""))
