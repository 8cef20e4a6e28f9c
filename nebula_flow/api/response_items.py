"""A Responses API answer (OpenAI's ``response`` object and its stream of events) from the chat
pipeline's answer (pure).

The gateway runs a Responses request as the chat request that says the same (``api/responses.py``)
and reshapes what comes out: the chat answer's thinking becomes a ``reasoning`` item, its text a
``message`` item with one ``output_text`` part, each tool call a ``function_call`` item, in that
order; a chat stream's events become the Responses events OpenAI sends (``response.created``, an
item added, its deltas, its end, ..., ``response.completed``), each with its ``sequence_number``,
as the ``openai`` client's ``responses.stream`` puts them together.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from nebula_flow.api.responses import Ask, Stored


class ResponseShaper:
    """Builds one response's objects and events (``req_id``: the chat answer's id without its prefix)."""

    def __init__(self, ask: Ask, model: str, req_id: str) -> None:
        self.ask, self.model, self.created = ask, model, int(time.time())
        self.id, self._req = f"resp_{req_id}", req_id
        self._items = 0

    def item_id(self, prefix: str) -> str:
        self._items += 1
        return f"{prefix}_{self._req}{self._items}"

    def response(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None = None,
                 speculative: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object: ``output`` items, ``status`` (``in_progress``, ``completed`` or
        ``incomplete``: the output reached ``max_output_tokens``) and the chat usage, reshaped."""
        answer = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                  "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                  "model": self.model, "output": output,
                  "store": self.ask.store, "truncation": "disabled", "background": False,
                  "usage": None if usage is None else _usage(usage), **self.ask.echoed}
        answer["metadata"] = answer["metadata"] or {}
        if speculative is not None:
            answer["speculative"] = speculative
        return answer

    def full(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response for a chat completion (``Shaper.full``'s) of one choice."""
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if thinking := message.get("reasoning_content"):
            output.append(self.reasoning(thinking, "completed"))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            output.append(self.message(message.get("content") or "", "completed", _logprobs(choice)))
        output += [self.call(c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output[-1]["status"] = status  # (the item the limit cut, as a stream ends it)
        return self.response(output, status, chat["usage"], chat.get("speculative"))

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.item_id("rs"), "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def message(self, text: str, status: str, logprobs: list | None) -> dict[str, Any]:
        return {"type": "message", "id": self.item_id("msg"), "status": status, "role": "assistant",
                "content": [self.part(text, logprobs)]}

    def part(self, text: str, logprobs: list | None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [],
                **({"logprobs": logprobs or []} if self.ask.logprobs else {})}

    def call(self, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": self.item_id("fc"), "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}


class ResponseStream:
    """A chat stream's events (``Gateway._events``' dicts, ``[DONE]`` last) as Responses events."""

    def __init__(self, shaper: ResponseShaper, done: Callable[[dict[str, Any]], None]) -> None:
        self.shaper, self.done = shaper, done  # (``done``: called with the finished response, to store it)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.pieces: list[str] = []  # its text (or arguments) so far, joined when it ends
        self.logprobs: list = []

    def event(self, kind: str, **fields: Any) -> bytes:  # noqa: ANN401
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    async def events(self, chat: AsyncIterator[dict[str, Any] | str]) -> AsyncIterator[bytes]:
        shaper, usage, status, speculative = self.shaper, None, "completed", None
        try:
            begun = shaper.response([], "in_progress")
            yield self.event("response.created", response=begun)
            yield self.event("response.in_progress", response=begun)
            async for ev in chat:
                if ev == "[DONE]":
                    break
                if "error" in ev:  # (the request failed at the broker: OpenAI's error event ends the stream)
                    error = ev["error"]
                    yield self.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
                    return
                if not ev["choices"]:
                    usage = ev["usage"]
                    continue
                choice = ev["choices"][0]
                for out in self._deltas(choice):
                    yield out
                if choice["finish_reason"] is not None:
                    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
                    speculative = ev.get("speculative")
            if not self.output and self.open is None:  # (no text at all: one empty message, as the answer unstreamed)
                for out in self._open("message"):
                    yield out
            for out in self._close(status):
                yield out
            final = shaper.response(self.output, status, usage, speculative)
            self.done(final)
            yield self.event(f"response.{status}", response=final)
        finally:
            await chat.aclose()  # (a client gone mid-stream: its request is cancelled at the broker)

    def _deltas(self, choice: dict[str, Any]) -> list[bytes]:
        delta, out = choice["delta"], []
        if text := delta.get("reasoning_content"):
            out += self._open("reasoning")
            self.pieces.append(text)
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                  content_index=0, delta=text))
        if text := delta.get("content"):
            out += self._open("message")
            self.pieces.append(text)
            piece = _logprobs(choice) or []
            self.logprobs += piece
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                  content_index=0, delta=text, logprobs=piece))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if call.get("id"):  # (a new call: the item open before it ends)
                out += self._open("function_call", call["id"], fn.get("name") or "")
            if fn.get("arguments"):
                self.pieces.append(fn["arguments"])
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.output), delta=fn["arguments"]))
        return out

    def _open(self, kind: str, call_id: str = "", name: str = "") -> list[bytes]:
        """Begin a ``kind`` item unless it is the one open (closing that one)."""
        if self.open is not None and self.open["type"] == kind and kind != "function_call":
            return []
        out = self._close("completed")
        shaper, at = self.shaper, len(self.output)
        self.open = shaper.reasoning("", "in_progress") if kind == "reasoning" else shaper.message(
            "", "in_progress", []) if kind == "message" else shaper.call(call_id, name, "", "in_progress")
        out.append(self.event("response.output_item.added", output_index=at, item=self.open))  # (serialized now)
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=at,
                                  content_index=0, part=shaper.part("", [])))
        return out

    def _close(self, status: str) -> list[bytes]:
        """End the open item, if any, with ``status``."""
        item, self.open = self.open, None
        if item is None:
            return []
        at, out, text = len(self.output), [], "".join(self.pieces)
        self.pieces = []
        item["status"] = status
        if item["type"] == "message":
            part = self.shaper.part(text, self.logprobs)
            item["content"] = [part]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=part["text"], logprobs=self.logprobs))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                                  part=part))
        elif item["type"] == "reasoning":
            item["content"][0]["text"] = text
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=text))
        else:
            item["arguments"] = text
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                  name=item["name"], arguments=item["arguments"]))
        self.output.append(item)
        out.append(self.event("response.output_item.done", output_index=at, item=item))
        return out


def to_store(ask: Ask, response: dict[str, Any]) -> Stored:
    """What the store keeps of ``response``: it, and the conversation with its output as chat messages."""
    said = next((i["content"][0]["text"] for i in response["output"] if i["type"] == "message"), None)
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in response["output"] if i["type"] == "function_call"]
    turn = {"role": "assistant", "content": said if said or not calls else None, **({"tool_calls": calls} if calls else {})}
    return Stored(response, [*ask.history, turn], ask.inputs,
                  ask.chat.get("prompt_cache_key") or response["id"].removeprefix("resp_"))  # (its request id)


def _logprobs(choice: dict[str, Any]) -> list | None:
    """A chat choice's (or chunk's) token logprobs, the shape Responses' ``output_text`` takes them in."""
    return (choice.get("logprobs") or {}).get("content")


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    """Chat usage as a response's. (Reasoning tokens are not counted apart: 0.)"""
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}
