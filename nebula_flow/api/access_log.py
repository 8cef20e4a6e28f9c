"""The gateway's request log: one line for each HTTP request, written when its answer has ended
(a stream's last event included), so an operator can see who asked what and why it failed.

    127.0.0.1:40312 "POST /v1/chat/completions" 200 in 1.234 s (first byte 0.101 s): request 9f2c...,
      streamed, 12 prompt + 48 completion tokens, finish stop
    127.0.0.1:40318 "POST /v1/completions" 400 in 0.002 s: invalid_value (temperature): ...

The handlers note on the request (``entry_of``) what the answer was: the broker's request id, each
choice's tokens and finish reason, the error. ``errors`` (the default) logs failed requests only
(status 400 and up, and streams that failed or whose client left after the first event); ``all``
every request, but a probe (``/health``, ``/metrics``, ``/version``) only when it fails; ``off``
none. Failed requests log at most ``ERRORS_PER_S`` lines a second (``log_cap.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from nebula_flow.log_cap import LogCap
from nebula_flow.outputs import Completion

LEVELS = ("off", "errors", "all")
PROBES = frozenset({"/health", "/metrics", "/version"})
ERRORS_PER_S = 20
KEY = "nebula_flow.access"  # (the entry's key in the ASGI scope, which the handlers' requests share)
MESSAGE_CHARS = 300

log = logging.getLogger("nebula_flow.api.access")


@dataclass
class Entry:
    """What one HTTP request's answer was, as its handler noted it."""

    req_id: str | None = None
    streamed: bool = False
    n: int = 1  # choices for each prompt: choice i answers prompt i // n
    outputs: dict[int, Completion] = field(default_factory=dict)  # each finished choice, by its index
    error: str | None = None  # the error answered, or sent as a stream's last event
    left: bool = False  # the client went away before the answer ended

    def failed(self, exc: Any) -> None:  # noqa: ANN401
        """An ``ApiError`` answered (as the status or as a stream's error event)."""
        param = f" ({exc.param})" if getattr(exc, "param", None) else ""
        self.error = f"{exc.code or exc.kind}{param}: {exc.message}"[:MESSAGE_CHARS]

    def describe(self) -> str:
        parts = [f"request {self.req_id}"] if self.req_id else []
        if self.streamed:
            parts.append("streamed")
        if self.outputs:
            prompt = sum(int(out.stats.get("prompt_tokens", 0)) for i, out in self.outputs.items() if i % self.n == 0)
            made = sum(len(out.token_ids) for out in self.outputs.values())
            parts.append(f"{len(self.outputs)} choices, " * (len(self.outputs) > 1)
                         + f"{prompt} prompt + {made} completion tokens")
            parts.append("finish " + ",".join(sorted({out.finish_reason for out in self.outputs.values()})))
        if self.left:
            parts.append("the client left before the answer ended")
        if self.error:
            parts.append(self.error)
        return ", ".join(parts)


def entry_of(scope: dict[str, Any]) -> Entry | None:
    """The entry of the request whose ASGI scope this is (None where nothing is logged)."""
    return scope.get(KEY)


class AccessLog:
    """ASGI middleware that writes each request's line when its answer ends (``level``: ``LEVELS``)."""

    def __init__(self, app: Any, level: str = "errors") -> None:  # noqa: ANN401
        if level not in LEVELS:
            raise ValueError(f"access log level {level!r}: one of {', '.join(LEVELS)}")
        self.app, self.level = app, level
        self.cap = LogCap(ERRORS_PER_S)  # (failed requests' lines)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] != "http" or self.level == "off":
            return await self.app(scope, receive, send)
        entry = scope[KEY] = Entry()
        started, answered = time.perf_counter(), [500, None]  # (status, when its head went out)

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answered[:] = message["status"], time.perf_counter() - started
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:  # (a bug: uvicorn logs its traceback and answers 500; the line says which request)
            entry.error = f"internal error: {type(exc).__name__}: {exc}"[:MESSAGE_CHARS]
            raise
        finally:
            self.write(scope, entry, answered[0], time.perf_counter() - started, answered[1])

    def write(self, scope: dict[str, Any], entry: Entry, status: int, took_s: float, head_s: float | None) -> None:
        failed = status >= 400 or entry.error is not None or entry.left
        if not failed and (self.level != "all" or scope["path"] in PROBES):
            return
        skipped = self.cap.admit() if failed else ""
        if skipped is None:
            return
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        first = f" (first byte {head_s:.3f} s)" if entry.streamed and head_s is not None else ""
        details = entry.describe()
        log.info('%s "%s %s" %d in %.3f s%s%s%s', where, scope["method"], scope["path"][:200], status, took_s, first,
                 f": {details}" if details else "", skipped)
