"""OpenAI's response objects from the client's chunks and completion (pure).

Beside OpenAI's fields, a finished response carries ``speculative``: the request's rounds, the
tokens each round committed and their mean, and its draft tokens proposed and accepted.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from nebula_flow.client import Completion

FINISH_REASONS = ("stop", "length")


def finish_reason(out: Completion) -> str:
    return out.finish_reason if out.finish_reason in FINISH_REASONS else "stop"


def usage(out: Completion) -> dict[str, int]:
    prompt = int(out.stats.get("prompt_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": len(out.token_ids),
            "total_tokens": prompt + len(out.token_ids)}


def speculative(out: Completion) -> dict[str, Any]:
    return {"rounds": out.rounds, "tokens_per_round": out.tokens_per_round,
            "mean_tokens_per_round": round(out.mean_tokens_per_round, 4),
            "draft_tokens_proposed": out.stats.get("proposed", 0), "draft_tokens_accepted": out.stats.get("accepted", 0)}


class Shaper:
    """Builds one request's objects: ``chat`` (``chat.completion``) or text (``text_completion``)."""

    def __init__(self, req_id: str, model: str, chat: bool, token_ids: bool = False) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + req_id
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.token_ids = token_ids  # (the return_token_ids extension)
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, out: Completion) -> dict[str, Any]:
        """The non-streamed answer."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                      "finish_reason": finish_reason(out)}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": finish_reason(out)}
        if self.token_ids:
            choice["token_ids"] = out.token_ids
        return {**self._head(self.object), "choices": [choice], "usage": usage(out), "speculative": speculative(out)}

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False,
              token_ids: list[int] | None = None) -> dict[str, Any]:
        """One streamed event: ``text`` (a delta) and its ``token_ids``, and at the end the finish ``reason``."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None and not role:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        if self.token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head("chat.completion.chunk" if self.chat else self.object), "choices": [choice]}

    def last(self, out: Completion) -> dict[str, Any]:
        """The event that ends the stream's choices: the finish reason and the speculative stats."""
        return {**self.chunk(None if self.chat else "", finish_reason(out)), "speculative": speculative(out)}

    def usage_chunk(self, out: Completion) -> dict[str, Any]:
        """``stream_options.include_usage``: an event with no choices and the usage."""
        return {**self._head("chat.completion.chunk" if self.chat else self.object), "choices": [], "usage": usage(out)}


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    return b"data: " + (obj.encode() if isinstance(obj, str) else orjson.dumps(obj)) + b"\n\n"
