"""The gateway's ASGI application (Starlette).

Each choice of an HTTP request (``n`` for each prompt) becomes one request on the bus through one
shared ``AsyncClient`` (``api/choices.py``); their chunks go out as server-sent events as the
broker commits them. A client that goes away is noticed while its request runs (streamed or not)
and its requests are cancelled at the broker, which frees their KV. Errors answer in OpenAI's shape; the broker's BUSY is a 429 with
``Retry-After``. Its server is ``api/server.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import anyio
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nebula_flow.api import choices
from nebula_flow.api.access_log import AccessLog, Entry, entry_of
from nebula_flow.api.errors import ApiError, error_response, no_such_model, unrouted
from nebula_flow.api.reasoning import ThinkingStream
from nebula_flow.api.request import STRUCTURED_FIELDS, Job, Served, parse_chat, parse_completion
from nebula_flow.api.response import Shaper, sse
from nebula_flow.api.response_items import ResponseShaper, ResponseStream, to_store
from nebula_flow.api.responses import Ask, ResponseStore, listed
from nebula_flow.api.responses import parse as parse_responses
from nebula_flow.api.telemetry import Telemetry, health
from nebula_flow.api.tokenize import parse_detokenize, parse_tokenize, tokenized
from nebula_flow.api.tools import CallStream
from nebula_flow.client import AsyncClient, Busy, Chunk, Completion, NebulaError, RequestError, RequestTimeout
from nebula_flow.metrics import exposition, families

MAX_BODY_BYTES = 8 << 20
HEALTH_DOWN_S = 1.0  # /health answers 503 at once where the broker has not been connected this long
STATUS_TTL_S = 0.5  # /health, /metrics and the served model's facts reuse a broker status this young
# chat fields a Responses request names otherwise (``api/responses.py``)
RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
                   "reasoning_effort": "reasoning"}
BAD_REQUEST_CODES = ("invalid_params", "invalid_prompt", "invalid_prediction", "too_long", "no_tokenizer", "malformed")


def from_broker(exc: NebulaError, prompt: str = "prompt") -> ApiError:
    """The HTTP answer to a broker's refusal or failure; ``prompt``: the field that held the prompt
    (``prompt``, a chat's ``messages``, a response's ``input``), named by a refused prompt's error."""
    if isinstance(exc, Busy):
        return ApiError(429, f"the server is at its admission limit, retry later ({exc.message})", code="busy",
                        kind="rate_limit_error", headers={"Retry-After": "1"})
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), code="timeout", kind="timeout_error")
    if isinstance(exc, RequestError) and exc.code in BAD_REQUEST_CODES:
        return ApiError(400, exc.message, code=exc.code,
                        param={"invalid_prompt": prompt, "invalid_prediction": "prediction"}.get(exc.code))
    if isinstance(exc, RequestError) and exc.code == "shutting_down":
        return ApiError(503, exc.message, code=exc.code, kind="service_unavailable", headers={"Retry-After": "5"})
    return ApiError(500, f"the request failed: {exc}", code=getattr(exc, "code", None), kind="server_error")


class EventStream(StreamingResponse):
    """Server-sent events that watch for the client leaving while they wait for the next chunk:
    cancelling the stream cancels the request at the broker. (Starlette leaves that to the
    server under ASGI 2.4, and uvicorn only drops writes to a closed connection.)"""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:  # noqa: ANN401
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):  # (a stream cut at a write: close it now, which cancels its request)
            await self.body_iterator.aclose()


class Gateway:
    """The application's state: the broker client, what is served, the API key, the metrics."""

    def __init__(self, broker: str, keys: str | None = None, api_key: str | None = None,
                 model_name: str | None = None, timeout_s: float = 600.0, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, allowed_origins: Sequence[str] = (),
                 access_log: str = "errors") -> None:
        self.access_log = access_log  # (which requests get a line in the gateway's log: ``api/access_log.py``)
        self.broker, self.keys, self.timeout_s, self.tool_parser = broker, keys, timeout_s, tool_parser
        self.allowed_origins = list(allowed_origins)  # (web pages that may call it from a browser: CORS)
        self.reasoning_parser = reasoning_parser
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.model_name = model_name
        self.client: AsyncClient | None = None
        self.telemetry = Telemetry()
        self.stored = ResponseStore()  # (the Responses API's, for previous_response_id)
        self._state: tuple[float, dict[str, Any]] | None = None
        self._status_lock: asyncio.Lock | None = None

    # -- the broker ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.client = AsyncClient(self.broker, timeout_s=self.timeout_s, keys=self.keys, retries=1)
        self.client.start()  # (its connections followed from now: the first probe answers at once too)
        self._status_lock = asyncio.Lock()
        try:
            yield
        finally:
            await self.client.close()

    async def state(self, at_once: bool = False) -> dict[str, Any]:
        """The broker's status, at most ``STATUS_TTL_S`` old (one question in flight at a time);
        ``at_once``: a 503 without asking where the broker has not been connected for ``HEALTH_DOWN_S``
        (a request instead waits for it: a broker that restarts is back within seconds)."""
        async with self._status_lock:
            if self._state is None or time.monotonic() - self._state[0] > STATUS_TTL_S:
                try:
                    # (a failed handshake: keys, or no broker there, said at once)
                    if why := self.client.unreachable(HEALTH_DOWN_S) if at_once else self.client.refusal():
                        raise NebulaError(why)
                    state = await asyncio.wait_for(self.client.status(), 5.0)
                except (NebulaError, TimeoutError) as exc:  # (a wait that ran out says nothing of its own)
                    why = str(exc) or self.client.refusal() or "no answer within 5 s"
                    raise ApiError(503, f"the broker at {self.broker} does not answer: {why}", code="broker_unreachable",
                                   kind="service_unavailable", headers={"Retry-After": "5"}) from None
                self._state = (time.monotonic(), state)
            return self._state[1]

    async def served(self) -> Served:
        state = await self.state()
        name = self.model_name or state.get("model") or "default"
        return Served(name, int(state.get("max_model_len") or 1 << 30),
                      int(state.get("max_new_tokens_limit") or 4096), self.tool_parser, self.reasoning_parser,
                      state.get("tokenizer"))

    # -- the endpoints ---------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.expected is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), self.expected):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key",
                           kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})

    async def health(self, request: Request) -> Response:
        try:
            state = await self.state(at_once=True)  # (a load balancer's probe answered at once, not in 5 s)
        except ApiError as exc:
            return error_response(exc, request)
        status, body = health(state)
        if status != 200 and (logged := entry_of(request.scope)) is not None:
            logged.error = body.get("message", body["status"])
        return JSONResponse(body, status_code=status)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [_model_card(await self.served())]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}`` (the ``openai`` client's ``models.retrieve``)."""
        self.authorize(request)
        served, asked = await self.served(), request.path_params["model"]
        if asked != served.name:
            raise no_such_model(asked, served.name)
        return JSONResponse(_model_card(served))

    async def metrics(self, request: Request) -> Response:
        self.authorize(request)
        text = generate_latest(self.telemetry.registry).decode()
        with contextlib.suppress(ApiError):  # (the gateway's own metrics even when the broker is away)
            text += exposition(families(await self.state()))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        return await self._counted(request, "tokenize", self._tokenizer(request, parse_tokenize))

    async def detokenize(self, request: Request) -> Response:
        return await self._counted(request, "detokenize", self._tokenizer(request, parse_detokenize))

    async def version(self, _request: Request) -> Response:
        """``GET /version`` (vLLM's): the server's version."""
        return JSONResponse({"version": importlib.metadata.version("nebula-flow")})

    async def completions(self, request: Request) -> Response:
        return await self._counted(request, "completions", self._generate(request, parse_completion))

    async def chat(self, request: Request) -> Response:
        return await self._counted(request, "chat", self._generate(request, parse_chat))

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` (OpenAI's Responses API): run as the chat request that says the same."""
        return await self._counted(request, "responses", self._generate(request, parse_chat, responding=True))

    async def stored_response(self, request: Request) -> Response:
        """``GET`` and ``DELETE /v1/responses/{id}``: a response this gateway stored."""
        self.authorize(request)
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            self.stored.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        return JSONResponse(self.stored.get(response_id).response)

    async def input_items(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items``: a page of a stored response's input items."""
        self.authorize(request)
        return JSONResponse(listed(self.stored.get(request.path_params["response_id"]).inputs,
                                   dict(request.query_params)))

    async def _counted(self, request: Request, endpoint: str, answer: Awaitable[Response]) -> Response:
        """An endpoint's answer (an ``ApiError`` answered in OpenAI's shape), counted by its status."""
        try:
            response = await answer
        except ApiError as exc:
            response = error_response(exc, request)
        self.telemetry.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _tokenizer(self, request: Request, parse: Any) -> Response:  # noqa: ANN401
        """``/tokenize`` and ``/detokenize`` (``api/tokenize.py``): the broker's tokenizer at work."""
        self.authorize(request)
        asked = parse(await read_json(request), await self.served())
        try:
            got = await self.client.tokenize(**asked)
        except RequestError as exc:
            if exc.code not in BAD_REQUEST_CODES:
                raise from_broker(exc) from None
            raise ApiError(400, exc.message, code=exc.code, param="tokens" if "token_ids" in asked
                           else "messages" if "messages" in asked else "prompt") from None
        except NebulaError as exc:
            raise from_broker(exc) from None
        return JSONResponse(tokenized(got) if parse is parse_tokenize else {"prompt": got.text})

    async def _generate(self, request: Request, parse: Any, responding: bool = False) -> Response:  # noqa: ANN401
        self.authorize(request)
        served = await self.served()
        body = await read_json(request)
        ask = None
        if responding:  # (a Responses request: the chat request that says the same, ``api/responses.py``)
            ask = parse_responses(body, self.stored)
            body = ask.chat
        # (a structured output's new grammar compiles off the event loop: a large JSON schema takes ~70 ms)
        try:
            job = await asyncio.to_thread(parse, body, served) if isinstance(body, dict) and STRUCTURED_FIELDS & body.keys() \
                else parse(body, served)
        except ApiError as exc:
            if ask is not None and exc.param is not None:  # (named as the Responses request names it)
                exc.param = RESPONSES_NAMES.get(exc.param.split("[")[0], exc.param)
            raise
        return await self._run(request, job, served.name, ask)

    async def _run(self, request: Request, job: Job, model: str, ask: Ask | None = None) -> Response:
        """Run ``job`` and answer it: as a chat or text completion, or (``ask``) as a response."""
        req_id = uuid.uuid4().hex
        if (logged := entry_of(request.scope)) is not None:
            logged.req_id, logged.streamed, logged.n = req_id, job.stream, job.n
        shaper = Shaper(req_id, model, job.chat, job.return_token_ids, job.n, job.calls, job.reasoning, job.echoes(),
                        (job.params.get("logprobs"), job.prompt_top))
        shaper.tokens_as_ids, shaper.chat_echo = job.tokens_as_ids, job.chat_echo
        asks = job.choices()
        streams = [self.client.stream(request_id=req_id if len(asks) == 1 else f"{req_id}-{i}", **ask)
                   for i, ask in enumerate(asks)]
        # The client may leave at any time, a long prefill included: watch for it from the start.
        gone = asyncio.ensure_future(_disconnected(request))
        first = asyncio.ensure_future(choices.heads(streams))  # (a refusal is still an HTTP status, not an event)
        if not await self._unless_gone(first, gone, logged):
            return Response(status_code=499)
        try:
            heads = first.result()
        except NebulaError as exc:
            gone.cancel()
            raise from_broker(exc, job.prompt_field(ask is not None)) from None
        except ValueError as exc:  # (parameters the client library refuses before sending)
            gone.cancel()
            raise ApiError(400, str(exc), code="invalid_value") from None
        if job.params.get("prompt_count"):  # (continuous_usage_stats: each choice's first item knows its prompt's count)
            shaper.prompt_counts = [h.prompt_tokens if isinstance(h, Chunk) else int(h.stats.get("prompt_tokens", 0))
                                    for h in heads]
            shaper.made = [0] * len(heads)
        items = choices.merged(heads, streams)
        if job.echo_only:
            items = choices.prompt_only(items)
        if job.stream:
            gone.cancel()  # (the event stream watches for it from here)
            events = self._events(shaper, job, len(streams), items, logged)
            answer = _sse(events) if ask is None else ResponseStream(
                ResponseShaper(ask, model, req_id), lambda response: self._keep(ask, response)).events(events)
            return EventStream(answer, headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(choices.completions(items, len(streams)))
        if not await self._unless_gone(collect, gone, logged):
            return Response(status_code=499)
        gone.cancel()
        try:
            outs = collect.result()
        except NebulaError as exc:
            raise from_broker(exc, job.prompt_field(ask is not None)) from None
        for out in outs:
            self.telemetry.finished(out)
        if logged is not None:
            logged.outputs = dict(enumerate(outs))
        if ask is None:
            return JSONResponse(shaper.full(outs))
        response = ResponseShaper(ask, model, req_id).full(shaper.full(outs))
        self._keep(ask, response)
        return JSONResponse(response)

    def _keep(self, ask: Ask, response: dict[str, Any]) -> None:
        """A finished response, kept where its request asked to be (``store``)."""
        if ask.store:
            self.stored.put(to_store(ask, response))

    async def _unless_gone(self, work: asyncio.Future, gone: asyncio.Future, logged: Entry | None) -> bool:
        """Wait for ``work``; False if the client left first (then ``work``, which reads the
        request's stream, is cancelled, and with it the request at the broker)."""
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return True
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, NebulaError):
            await work
        self.telemetry.disconnects.inc()
        if logged is not None:
            logged.left = True
        return False

    async def _events(self, shaper: Shaper, job: Job, count: int, items: AsyncIterator[tuple[int, Chunk | Completion]],
                      logged: Entry | None = None) -> AsyncIterator[dict[str, Any] | str]:
        """The answer's events: each choice's chunks as they come (its role first, for chat; with
        tools, a named function's arguments as they come, else its text until a call begins and
        then its calls, as they come with ``auto``, whole with ``"required"``), its finish event
        when it ends, then the usage if asked."""
        finished, outs = False, [None] * count
        echoed: set[int] = set()  # (echo: the choices whose prompt went out, before their first tokens)
        gates = [CallStream(job.calls.auto, job.calls.forced) for _ in range(count)] if job.calls is not None else None
        thinking = [ThinkingStream(job.reasoning) for _ in range(count)] if job.reasoning is not None else None
        try:
            if job.chat:
                for i in range(count):
                    yield shaper.chunk(None, role=True, index=i)
                    if job.chat_echo:
                        yield shaper.chunk(job.chat_echo, index=i)
            async for i, item in items:
                if shaper.prompt_counts is not None and isinstance(item, Chunk):
                    shaper.made[i] += len(item.token_ids)
                if i not in echoed and (echo := shaper.echo(i, item)) is not None:
                    echoed.add(i)
                    yield shaper.chunk(echo[0], index=i, logprobs=echo[1])
                if isinstance(item, Completion):
                    outs[i] = item
                    self.telemetry.finished(item)
                    if logged is not None:
                        logged.outputs[i] = item
                    for event in _pieces(shaper, i, thinking[i].rest() if thinking else [], gates):
                        yield event
                    if gates is not None and (held := shaper.held(item, i, gates[i])) is not None:
                        yield held  # (what of its calls or its answer was held back until it was complete)
                    yield shaper.last(item, i)
                elif thinking is not None or gates is not None:  # (thinking apart; with tools, text until a call)
                    pieces = thinking[i].feed(item.text) if thinking is not None else [("content", item.text)]
                    for event in _pieces(shaper, i, pieces, gates, item.token_ids, item.logprobs):
                        yield event
                elif item.text or item.logprobs or shaper.token_ids and item.token_ids:  # (no event without news)
                    yield shaper.chunk(item.text, token_ids=item.token_ids, index=i, logprobs=item.logprobs)
            finished = True
            if job.include_usage:
                yield shaper.usage_chunk(outs)
        except NebulaError as exc:
            finished, failure = True, from_broker(exc, job.prompt_field(False))
            if logged is not None:
                logged.failed(failure)
            yield failure.body()
        finally:
            if not finished:
                self.telemetry.disconnects.inc()
                if logged is not None:
                    logged.left = True
            await items.aclose()  # (unfinished requests are cancelled at the broker)
        yield "[DONE]"


async def _sse(events: AsyncIterator[dict[str, Any] | str]) -> AsyncIterator[bytes]:
    """A chat or text completion's events as server-sent events."""
    try:
        async for event in events:
            yield sse(event)
    finally:
        await events.aclose()


def _pieces(shaper: Shaper, index: int, pieces: list[tuple[str, str]], gates: list[CallStream] | None,
            token_ids: list[int] | None = None, logprobs: list | None = None) -> list[dict[str, Any]]:
    """A streamed chunk's events when its text is split (thinking and answer: ``api/reasoning.py``;
    an answer held from where a tool call begins: ``api/tools.py``); its token ids and logprobs
    ride with the first event (one with an empty delta where they are asked for and nothing of it
    goes out yet; otherwise no event: a chunk whose text is held back, a character's first bytes,
    says nothing)."""
    events = []
    for kind, text in pieces:
        calls = []
        if kind == "content" and gates is not None:
            gate = gates[index]
            if gate.forced is not None:  # (a named function's arguments, as they grow)
                call = gate.arguments(text)
                calls, text = [call] if call is not None else [], ""
            else:  # (its text until a call begins, then the calls as far as the text shows them)
                text, calls = gate.feed(text), gate.calls()
        if text:
            first = not events
            events.append(shaper.chunk(text, index=index, kind=kind, token_ids=token_ids if first else None,
                                       logprobs=logprobs if first else None))
        if calls:
            first = not events
            events.append(shaper.call_chunk(index, calls, logprobs if first else None, token_ids if first else None))
    if not events and (shaper.token_ids and token_ids or logprobs):
        events.append(shaper.chunk(None, index=index, token_ids=token_ids, logprobs=logprobs))
    return events


def _model_card(served: Served) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": 0, "owned_by": "nebula-flow",
            "max_model_len": served.max_model_len, "root": served.root}  # (vLLM's: where the model lies)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_json(request: Request) -> Any:  # noqa: ANN401
    """The request's JSON body, at most ``MAX_BODY_BYTES``. A field that is null is one not given,
    as vLLM's optional fields (clients send `"temperature": null` for the default)."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes", code="too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes", code="too_large")
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    return {k: v for k, v in parsed.items() if v is not None} if isinstance(parsed, dict) else parsed


def build_app(gateway: Gateway) -> Starlette:
    def route(path: str, handler: Any, methods: list[str]) -> Route:  # noqa: ANN401
        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                return error_response(exc, request)
        return Route(path, guarded, methods=methods)

    return Starlette(routes=[
        route("/v1/completions", gateway.completions, ["POST"]),
        route("/v1/chat/completions", gateway.chat, ["POST"]),
        route("/v1/responses", gateway.responses, ["POST"]),
        route("/v1/responses/{response_id}", gateway.stored_response, ["GET", "DELETE"]),
        route("/v1/responses/{response_id}/input_items", gateway.input_items, ["GET"]),
        route("/v1/models", gateway.models, ["GET"]),
        route("/v1/models/{model:path}", gateway.model, ["GET"]),
        route("/tokenize", gateway.tokenize, ["POST"]),
        route("/detokenize", gateway.detokenize, ["POST"]),
        route("/health", gateway.health, ["GET"]),
        route("/version", gateway.version, ["GET"]),
        route("/metrics", gateway.metrics, ["GET"]),
    ], lifespan=gateway.lifespan, exception_handlers={HTTPException: unrouted}, middleware=[
        Middleware(AccessLog, level=gateway.access_log),  # (outermost: it times the whole answer)
        # (preflights answered before a route's API key check: a browser sends them without it)
        *([Middleware(CORSMiddleware, allow_origins=gateway.allowed_origins, allow_methods=["GET", "POST", "DELETE"],
                      allow_headers=["*"], max_age=600)] if gateway.allowed_origins else [])])
