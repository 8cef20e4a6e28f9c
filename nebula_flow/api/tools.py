"""Tool calling in the chat API (OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``),
built on structured outputs (``nebula_flow/structured.py``). Pure: no sockets, no HTTP.

The tools go to the chat template (as ``tools``: templates made for tool use render them), and:

- ``tool_choice`` ``"none"``: the model answers in text;
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is that
  function's arguments, JSON that follows its ``parameters`` schema (vLLM's way); the answer's
  message holds one tool call, ``finish_reason`` ``stop`` (as OpenAI's for a forced function);
- ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, one of the tools
  each (one at most unless ``parallel_tool_calls``), vLLM's format; the message holds those calls,
  ``finish_reason`` ``tool_calls``;
- ``"auto"`` (the default with tools): the model decides, in its own format, which the server
  must know (vLLM's ``--tool-call-parser``; here ``hermes``: ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, the format of Qwen2.5, Qwen3, Hermes and many others). Its calls are parsed
  from the output (``finish_reason`` ``tool_calls``; the text before them is the content), and a
  stream sends text until a call begins (``CallStream``). Without a parser: a 400 that says so.

Streamed, a named function's arguments go out as they are made (``CallStream.arguments``), and so
do ``"auto"``'s and ``"required"``'s calls, each named first (``CallStream.calls``).

An output cut short by ``max_tokens`` is no complete call: its text comes back as content, with
``finish_reason`` ``length``. Every decision here is exact under speculation, as any grammar is.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from nebula_flow.api.reasoning import partial_tail

MAX_TOOLS = 128
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / ``parallel_tool_calls``: ``param`` names the field."""

    def __init__(self, param: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.param, self.unsupported = param, unsupported


PARSERS = ("hermes",)  # the tool-call formats ``"auto"`` reads (``--tool-call-parser``)
TAG, END = "<tool_call>", "</tool_call>"  # hermes'
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')  # a hermes call's start, name first
ITEM = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"parameters"\s*:\s*')  # a "required" call's start
CLOSE = re.compile(r"\s*\}")  # (what ends a "required" call after its parameters)


@dataclass
class ToolCalling:
    """What a chat answer's output is: the arguments of ``forced`` (a named function), an array of
    calls (``forced`` None: ``"required"``), or text with the model's own calls in it (``auto``)."""

    forced: str | None
    auto: bool = False

    @property
    def finish_reason(self) -> str:
        return "stop" if self.forced is not None else "tool_calls"

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A finished output's content and OpenAI's ``tool_calls`` (None: it makes none: cut
        short by the token limit, or, ``auto``, the model answered in text)."""
        if self.auto:
            return hermes(text)
        try:
            value = json.loads(text)
        except ValueError:
            return text, None
        if self.forced is not None:
            return None, [_call(self.forced, text)]
        if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
            return text, None
        written = array_calls(text)  # (the model's own text, as streamed; else normalized)
        return None, [_call(c["name"], written[i][1] if i < len(written) and written[i][0] == c["name"]
                            else json.dumps(c.get("parameters", {}), ensure_ascii=False)) for i, c in enumerate(value)]


def hermes(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """The content and calls of an output in the hermes format: ``<tool_call>{"name", "arguments"}
    </tool_call>`` blocks after the content (a last block may lack its end tag: the output ended).
    A block that is not such JSON makes the whole output content, as vLLM's parser does."""
    at = text.find(TAG)
    if at < 0:
        return text, None
    calls = []
    for block in text[at:].split(TAG)[1:]:
        raw = block.split(END, 1)[0].strip()
        try:
            call = json.loads(raw)
        except ValueError:
            return text, None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, None
        args = call.get("arguments", {})
        written = arguments_text(raw)  # (the model's own text, as streamed; else normalized)
        calls.append(_call(call["name"], written if written is not None else args if isinstance(args, str)
                           else json.dumps(args, ensure_ascii=False)))
    return text[:at].rstrip() or None, calls


def arguments_text(block: str) -> str | None:
    """A complete hermes call's arguments as the model wrote them, where it wrote the name first
    and the arguments as an object (what a stream sends piece by piece); else None."""
    head = HEAD.match(block)
    if head is None:
        return None
    try:
        value, end = json.JSONDecoder().raw_decode(block, head.end())
    except ValueError:
        return None
    return block[head.end():end] if isinstance(value, dict) and block[end:].strip() == "}" else None


def array_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a ``"required"`` output (``[{"name": ..., "parameters": {...}}, ...]``) as far
    as it is written: each one's name and its parameters as the model wrote them, the last one's
    without what may close it rather than its parameters where it is not complete yet."""
    calls, at = [], 0
    while (head := ITEM.match(text, at)) is not None:
        try:
            value, end = json.JSONDecoder().raw_decode(text, head.end())
        except ValueError:  # (not written to its end yet)
            calls.append((head.group(1), text[head.end():].rstrip(" \t\r\n}],")))
            break
        close = CLOSE.match(text, end)
        if not isinstance(value, dict) or close is None:
            break
        calls.append((head.group(1), text[head.end():end]))
        at = close.end()
    return calls


def hermes_calls(text: str) -> list[tuple[str, str]]:
    """The calls of an ``"auto"`` output from its first tag (hermes) as far as they are written
    name first: each one's name and its arguments as the model wrote them, the last one's without
    what may close it rather than its arguments, or begin the end tag, where it has not ended."""
    calls = []
    for block in text.split(TAG)[1:]:
        body, ended = block.split(END, 1)[0], END in block
        head = HEAD.match(body)
        if head is None:  # (its head not written yet, or not name first: whole at the end)
            break
        if not ended:
            args = body[head.end():]
            calls.append((head.group(1), args[:len(args) - partial_tail(args, END, 0)].rstrip(" \t\r\n}")))
            break
        if (args := arguments_text(body)) is None:  # (not such a call after all)
            break
        calls.append((head.group(1), args))
    return calls


class CallStream:
    """What of a streamed choice goes out as it comes. ``auto``: the text until its first call
    begins (a piece that may start the tag is held until it shows it does not), then each call as
    the text shows it (``calls``): its name once known, its arguments as they grow (a tail that may
    close the call rather than its arguments held back), as vLLM's hermes parser streams them; a
    call not written name first goes out whole at the end (``rest``). ``"required"``: its calls the
    same way, from the JSON array. A named function (``forced``): its arguments as they grow
    (``arguments``). ``sent``: the characters of content sent."""

    def __init__(self, auto: bool, forced: str | None = None) -> None:
        self.text, self.sent, self.closed = "", 0, not auto
        self.auto, self.forced = auto, forced
        self.calls_at: int | None = None  # auto: where the first call's tag begins
        self.streamed: list[int] = []  # auto, "required": each call announced so far: the characters of its arguments sent

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.closed:
            return ""
        at = self.text.find(TAG, max(0, self.sent - len(TAG)))
        if at >= 0:
            self.closed, self.calls_at = True, at
            end = at
        else:  # (hold back a tail that may be the tag's start)
            end = len(self.text) - partial_tail(self.text, TAG, self.sent)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def calls(self) -> list[dict[str, Any]]:
        """The tool-call deltas that the text fed so far adds (``feed`` first): ``auto``'s and
        ``"required"``'s calls, each named once its head is written, its arguments as they grow."""
        if self.forced is not None or (self.auto and self.calls_at is None):
            return []
        written = hermes_calls(self.text[self.calls_at:]) if self.auto else array_calls(self.text)
        deltas = []
        for j, (name, args) in enumerate(written):
            if j == len(self.streamed):
                self.streamed.append(0)
                deltas.append({"index": j, **_call(name, "")})
            if len(args) > self.streamed[j]:
                deltas.append({"index": j, "function": {"arguments": args[self.streamed[j]:]}})
                self.streamed[j] = len(args)
        return deltas

    def rest(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The deltas that complete ``calls`` (the finished output's) after what went out: the
        rest of each streamed call's arguments, and the others whole."""
        deltas = []
        for j, call in enumerate(calls):
            if j < len(self.streamed):
                missing = call["function"]["arguments"][self.streamed[j]:]
                if missing:
                    deltas.append({"index": j, "function": {"arguments": missing}})
            else:
                deltas.append({"index": j, **call})
        return deltas

    def arguments(self, piece: str) -> dict[str, Any] | None:
        """A named function's tool-call delta for ``piece`` of its arguments (None: nothing to
        send); the first carries the call's id and name."""
        self.text += piece
        if not piece:
            return None
        first, self.sent = self.sent == 0, self.sent + len(piece)
        return {"index": 0, **_call(self.forced, piece)} if first else {"index": 0, "function": {"arguments": piece}}


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": arguments}}


def parse(body: dict[str, Any], parser: str | None = None
          ) -> tuple[list[dict[str, Any]] | None, ToolCalling | None, dict[str, Any] | None]:
    """A chat request's tools (for the template), how its answer is shaped, and the structured
    output it forces (``ToolError`` for a bad field); ``parser``: the model's tool-call format, if
    the server knows it (``PARSERS``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None, None, None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise ToolError("tools", f"tools must be a list of 1 to {MAX_TOOLS} function tools")
    schemas = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError("tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ or -")
        if not isinstance(params, dict):
            raise ToolError("tools", f"tools[{i}].function.parameters must be a JSON schema (an object)")
        if name in schemas:
            raise ToolError("tools", f"two tools are named {name!r}")
        schemas[name] = params
    choice = "auto" if choice is None else choice
    if choice == "none":
        return tools, None, None
    if choice == "auto":
        if parser is None:
            raise ToolError("tool_choice", 'tool_choice "auto" needs the model\'s tool-call format: start the server with '
                            '--tool-call-parser (hermes), or use "required", a named function or "none"', unsupported=True)
        return tools, ToolCalling(None, auto=True), None
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False} for name, schema in schemas.items()]
        array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        return tools, ToolCalling(None), {"json": array if parallel else {**array, "maxItems": 1}}
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                        '{"type": "function", "function": {"name": ...}}')
    if named not in schemas:
        raise ToolError("tool_choice", f"tool_choice names {str(named)[:64]!r}, which is not among the tools")
    return tools, ToolCalling(named), {"json": schemas[named]}


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's arguments as
    an object where they are JSON text (as vLLM hands them to templates)."""
    calls = []
    for call in m["tool_calls"]:
        fn = dict(call["function"])
        try:
            fn["arguments"] = json.loads(fn["arguments"]) if isinstance(fn.get("arguments"), str) else fn.get("arguments")
        except ValueError:
            pass
        calls.append({**call, "function": fn})
    return {**m, "tool_calls": calls}
