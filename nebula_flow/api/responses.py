"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat pipeline.

A Responses request is a conversation like a chat's, written otherwise: ``input`` (a string or a
list of items: messages, function calls and their outputs), ``instructions`` (a system message),
``max_output_tokens``, ``text.format`` (a structured output), flat function ``tools``. This module
turns it into the chat completion request that says the same (``parse_chat`` then checks it, so
both endpoints accept and refuse alike), and keeps the answers the gateway stored
(``ResponseStore``) so a request can go on from one with ``previous_response_id``, as OpenAI's and
vLLM's do. The answer's shape is ``api/response_items.py``'s.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nebula_flow.api.errors import ApiError, fields_known, invalid

# Fields OpenAI defines for a response, and the vLLM sampling extensions passed to the chat request as they are.
OPENAI_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "stream_options", "store",
    "previous_response_id", "tools", "tool_choice", "parallel_tool_calls", "text", "metadata", "user", "include",
    "top_logprobs", "reasoning", "truncation", "background", "service_tier", "prompt_cache_key", "safety_identifier",
    "max_tool_calls", "prompt", "conversation",
})
PASSED = ("top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "ignore_eos", "logit_bias", "stop_token_ids", "priority", "cache_salt", "skip_special_tokens", "bad_words",
          "include_stop_str_in_output", "allowed_token_ids", "chat_template_kwargs", "structured_outputs")
# Fields OpenAI defines that the gateway does not build: refused unless they ask for nothing.
UNSUPPORTED = {"background": (None, False), "truncation": (None, "disabled"), "max_tool_calls": (None,),
               "prompt": (None,), "conversation": (None,), "service_tier": (None, "auto", "default")}
ROLES = ("user", "assistant", "system", "developer")  # a message item's roles
LOGPROBS = "message.output_text.logprobs"  # the one ``include`` built: each output text's tokens' logprobs
ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
STORED = 1024  # responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` (the oldest go first)


@dataclass
class Stored:
    """A stored response: its object (as answered) and its conversation in chat messages, without
    instructions (as OpenAI's: a request that goes on from it gives its own)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    inputs: list[dict[str, Any]] = field(default_factory=list)  # its request's input items (``input_items``)
    key: str | None = None  # the routing key of the shard it ran on (``shards.route``): the next turns go there too


class ResponseStore:
    """The responses this gateway answered with ``store`` (OpenAI's default), in its memory: at most
    ``capacity``, the least lately used dropped first; gone when the gateway restarts."""

    def __init__(self, capacity: int = STORED) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()  # (handlers run on the event loop, parsing on worker threads)

    def put(self, stored: Stored) -> None:
        with self._lock:
            self._kept[stored.response["id"]] = stored
            self._kept.move_to_end(stored.response["id"])
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response ``response_id`` (a 404 naming ``param`` where there is none)."""
        with self._lock:
            stored = self._kept.get(response_id)
            if stored is not None:
                self._kept.move_to_end(response_id)
        if stored is None:
            raise ApiError(404, f"no response {response_id[:80]!r} is stored here (responses are kept in the gateway's "
                           f"memory, the latest {self.capacity}, and only with store)", param=param, code="not_found")
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._kept.pop(response_id, None)


@dataclass
class Ask:
    """A Responses request as the chat request that says the same, and what its answer repeats."""

    chat: dict[str, Any]  # the chat completion request
    history: list[dict[str, Any]]  # the conversation before the output (chat messages, no instructions)
    echoed: dict[str, Any] = field(default_factory=dict)  # the request's fields a response object repeats
    inputs: list[dict[str, Any]] = field(default_factory=list)  # ``input`` as items, each with an id
    store: bool = True
    logprobs: bool = False


def parse(body: Any, store: ResponseStore) -> Ask:  # noqa: ANN401
    """The chat request for a Responses request (a 400 naming the Responses field where it is wrong)."""
    fields_known(body, OPENAI_FIELDS | set(PASSED))
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise ApiError(400, f"{name} {str(body[name])[:80]} is not supported by this server", param=name,
                           code="unsupported_parameter")
    history = []
    if (previous := body.get("previous_response_id")) is not None:
        if not isinstance(previous, str):
            raise invalid("previous_response_id", "previous_response_id must be a response's id")
        earlier = store.get(previous, "previous_response_id")
        history = [dict(m) for m in earlier.messages]
    history += input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "instructions must be a string")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": ([{"role": "system", "content": instructions}]
                                                                     if instructions else []) + history}
    for name in ("temperature", "top_p", "stream", "user", "safety_identifier", "prompt_cache_key", "metadata",
                 "parallel_tool_calls", *PASSED):
        if body.get(name) is not None:
            chat[name] = body[name]
    if previous is not None and body.get("prompt_cache_key") is None and earlier.key:
        chat["prompt_cache_key"] = earlier.key  # (a conversation's turns go to one broker shard, which knows its KV)
    if (limit := body.get("max_output_tokens")) is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise invalid("max_output_tokens", f"max_output_tokens must be a positive integer, got {limit!r}")
        chat["max_completion_tokens"] = limit
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # (the last event carries the usage)
    if body.get("tools") is not None:
        chat["tools"] = [_tool(i, t) for i, t in enumerate(_list(body["tools"], "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if (fmt := _format(body.get("text"))) is not None:
        chat["response_format"] = fmt
    if (reasoning := body.get("reasoning")) is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"} or reasoning.get("summary") not in (
                None, "auto", "concise", "detailed"):
            raise invalid("reasoning", 'reasoning takes an effort (given to the chat template as reasoning_effort); '
                          'a summary is not made apart')
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    logprobs = _logprobs(body, chat)
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise invalid("store", "store must be a boolean")
    echoed = {name: body.get(name) for name in ("instructions", "max_output_tokens", "previous_response_id",
                                                "metadata", "user", "safety_identifier", "prompt_cache_key")}
    echoed.update(temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                  tools=body.get("tools") or [], tool_choice=body.get("tool_choice", "auto"),
                  parallel_tool_calls=body.get("parallel_tool_calls", True),
                  text=body.get("text") or {"format": {"type": "text"}}, top_logprobs=body.get("top_logprobs"),
                  reasoning={"effort": (reasoning or {}).get("effort"), "summary": None})
    return Ask(chat, history, echoed, inputs=input_items(body["input"]), store=keep, logprobs=logprobs)


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` (checked: ``input_messages``) as OpenAI lists a response's input items: each with
    its id and status, a message's content as parts."""
    items = []
    for item in [{"role": "user", "content": given}] if isinstance(given, str) else given:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            parts = [{"type": "input_text" if item["role"] != "assistant" else "output_text", "text": content}] \
                if isinstance(content, str) else content
            item = {"type": "message", "role": item["role"], "content": parts}
        items.append({"id": item.get("id") or f"{ITEM_PREFIXES.get(kind, 'item')}_{secrets.token_hex(12)}",
                      "status": "completed", **item})
    return items


def input_messages(given: Any) -> list[dict[str, Any]]:  # noqa: ANN401
    """``input`` as chat messages: a string is the user's message; a list's items are messages
    (their text parts joined), function calls (an assistant's tool calls, consecutive ones in one
    message) and their outputs (tool messages). Reasoning items are left out: chat templates drop an
    earlier turn's thinking."""
    if isinstance(given, str):
        if not given:
            raise invalid("input", "input is empty")
        return [{"role": "user", "content": given}]
    if given is None:
        raise invalid("input", "input is required: a string, or a list of messages, function calls and their outputs")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(_list(given, "input")):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"{where} must be an object (a message, a function call or its output)")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise invalid(where, f"{where}.role must be one of {', '.join(ROLES)}")
            messages.append({"role": item["role"], "content": _text(where, item.get("content"))})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text(where, output)})
        elif kind != "reasoning":
            raise ApiError(400, f"{where}: items of type {str(kind)[:40]!r} are not supported (message, function_call, "
                           "function_call_output, reasoning)", param=where, code="unsupported_parameter")
    if not messages:
        raise invalid("input", "input holds no message")
    return messages


def _list(value: Any, name: str) -> list:  # noqa: ANN401
    if not isinstance(value, list):
        raise invalid(name, f"{name} must be a list")
    return value


def _string(item: dict[str, Any], name: str, where: str) -> str:
    if not isinstance(item.get(name), str):
        raise invalid(where, f"{where}.{name} must be a string")
    return item[name]


def _text(where: str, content: Any) -> str:  # noqa: ANN401
    """A message's content: a string, or parts of text (``input_text``, ``output_text``, ``refusal``)."""
    if isinstance(content, str):
        return content
    parts = _list(content, f"{where}.content")
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(text, str):
            raise ApiError(400, f"{where}.content: only text parts are supported (input_text, output_text), not "
                           f"{str(kind)[:40]!r}", param=where, code="unsupported_parameter")
        texts.append(text)
    return "".join(texts)


def _tool(i: int, tool: Any) -> dict[str, Any]:  # noqa: ANN401
    """A Responses function tool (flat: ``name``, ``parameters``, ...) as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f"tools[{i}]: only function tools are supported", param="tools",
                       code="unsupported_parameter")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:  # noqa: ANN401
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: Any) -> dict[str, Any] | None:  # noqa: ANN401
    """``text.format`` as a chat ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None, "medium"):
        raise invalid("text", 'text takes a format ({"type": "text"}, {"type": "json_object"} or {"type": '
                      '"json_schema", "name", "schema"}); verbosity other than "medium" is not supported')
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise invalid("text", f"text.format.type must be text, json_object or json_schema, got {str(kind)[:40]!r}")


def _logprobs(body: dict[str, Any], chat: dict[str, Any]) -> bool:
    """``include`` (only ``message.output_text.logprobs``) and ``top_logprobs`` as the chat request's."""
    include = body.get("include") or []
    if not isinstance(include, list) or any(x != LOGPROBS for x in include):
        raise ApiError(400, f"include: only {LOGPROBS!r} is supported", param="include", code="unsupported_parameter")
    if include:
        chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs") or 0
    elif body.get("top_logprobs") not in (None, 0):
        raise invalid("top_logprobs", f"top_logprobs needs include: [{LOGPROBS!r}]")
    return bool(include)


def listed(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """A page of a response's input items, as OpenAI lists them: ``order`` (``desc``, the default:
    the last first; or ``asc``), at most ``limit`` (1-100, default 20), those after the item ``after``."""
    order, after = query.get("order", "desc"), query.get("after")
    limit = query.get("limit", "20")
    if order not in ("asc", "desc"):
        raise invalid("order", "order must be asc or desc")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise invalid("limit", "limit must be an integer from 1 to 100")
    if unknown := sorted(set(query) - {"order", "limit", "after", "include"}):
        raise invalid(unknown[0], f"unrecognized query parameter(s): {', '.join(unknown)[:200]}")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    if after is not None and after not in ids:
        raise invalid("after", f"no input item {after[:80]!r} in this response")
    start = ids.index(after) + 1 if after is not None else 0
    page = ordered[start:start + int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(ordered)}
