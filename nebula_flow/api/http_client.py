"""``HttpClient``: the HTTP API spoken with ``AsyncClient``'s interface, so that `bench` and
`replay` measure what users of the front door see (``--api URL``).

Each request streams (server-sent events) with ``return_token_ids`` and the usage, and yields
the same ``Chunk`` and ``Completion`` objects as the ZeroMQ client, timed on this client's clock
from the moment the request is sent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from nebula_flow.client import Busy, Chunk, Completion, NebulaError, RequestError, completion_of

PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
          "seed": "seed", "stop": "stop", "ignore_eos": "ignore_eos"}


class HttpClient:
    """Streams requests to the gateway at ``url`` (``http://host:port``); ``api_key`` if it wants one."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.served: dict[str, Any] | None = None  # what /v1/models lists (asked once)

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def served_model(self) -> dict[str, Any]:
        """The model the gateway serves, as ``/v1/models`` lists it (``id``, ``max_model_len``)."""
        if self.served is None:
            try:
                res = await self.http.get("/v1/models")
                _check(res.status_code, res.content)
                self.served = res.json()["data"][0]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                raise NebulaError(f"the HTTP API at {self.url} does not answer /v1/models: {exc}") from None
        return self.served

    async def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None, chat: bool = False,
                     **params: Any) -> AsyncIterator[Chunk | Completion]:
        body: dict[str, Any] = {"model": (await self.served_model())["id"], "stream": True, "return_token_ids": True,
                                "stream_options": {"include_usage": True}, "temperature": 0.0}
        for name, value in params.items():
            if name not in PARAMS:
                raise ValueError(f"the HTTP API takes no {name!r} here")
            if value is not None:
                body[PARAMS[name]] = list(value) if name == "stop" else value
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt if token_ids is None else list(token_ids)
        t0 = time.monotonic()
        tokens: list[int] = []
        text, times, counts, last = [], [], [], None
        async with self.http.stream("POST", path, content=orjson.dumps(body),
                                    headers={"Content-Type": "application/json"}) as res:
            if res.status_code != 200:
                _check(res.status_code, await res.aread())
            async for line in res.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[len("data: "):])
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
        if last is None or "reason" not in last:
            raise NebulaError(f"the stream from {self.url} ended without a finish")
        spec, latency = last.get("spec", {}), time.monotonic() - t0
        stats = {"prompt_tokens": last.get("usage", {}).get("prompt_tokens", 0), "proposed":
                 spec.get("draft_tokens_proposed", 0), "accepted": spec.get("draft_tokens_accepted", 0)}
        yield Completion("".join(text), tokens, last["reason"], spec.get("rounds", 0), spec.get("tokens_per_round", []),
                         times[0] if times else latency, latency, times, stats, counts)

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return await completion_of(self.stream(prompt, **kwargs))


def served_model(url: str, api_key: str | None = None) -> dict[str, Any]:
    """``HttpClient.served_model`` of the gateway at ``url``, from synchronous code."""
    import asyncio

    async def ask() -> dict[str, Any]:
        async with HttpClient(url, api_key, timeout_s=10) as client:
            return await client.served_model()

    return asyncio.run(ask())


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
