"""A conversation as the gateway takes it (OpenAI's messages) and hands it to the chat template:
each message checked and shaped as the template reads it, and the options that render it."""

from __future__ import annotations

from typing import Any

from nebula_flow.api import tools as tool_calls
from nebula_flow.api.errors import ApiError, invalid
from nebula_flow.tokenizer import RENDER_OPTIONS

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_MESSAGES = 4096


def template_message(i: int, m: Any) -> dict[str, Any]:  # noqa: ANN401, C901
    """Message ``i`` of a conversation, checked, as the chat template reads it."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise invalid(where, f"{where} must be an object with a role and content")
    if m["role"] not in ROLES:
        raise ApiError(400, f"{where}: role {m['role'][:40]!r} is not supported (system, developer, user, assistant, "
                       "tool)", param=where, code="unsupported_parameter")
    fields = {"role", "content", "name"} | ({"tool_calls"} if m["role"] == "assistant" else set()) | (
        {"tool_call_id"} if m["role"] == "tool" else set())
    if extra := sorted(set(m) - fields):
        raise ApiError(400, f"{where}: {', '.join(map(str, extra))[:200]} not supported", param=where,
                       code="unsupported_parameter")
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise invalid(where, f"{where}: a tool message needs the tool_call_id it answers")
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", ""), str) for c in calls):
            raise invalid(where, f"{where}.tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                          "\"function\": {\"name\", \"arguments\"}}")
        content = None if m.get("content") is None else message_text(where, m["content"])  # (None: the calls alone)
        return {**tool_calls.template_message(m), "role": "assistant", "content": content}
    return {**{k: m[k] for k in ("tool_call_id",) if k in m}, "role": ROLES[m["role"]], "content": message_text(where, m.get("content"))}


def message_text(where: str, content: Any) -> str:  # noqa: ANN401
    """A message's content (a string, or text parts) as one string."""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{where}: only text content parts are supported", param=where,
                           code="unsupported_parameter")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise invalid(where, f"{where}.content must be a string or a list of text parts")
    return content


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field of ``body`` (absent or null: ``default``)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be a boolean")
    return value


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's


def chat_options(body: dict[str, Any]) -> dict[str, Any]:
    """A conversation's ``chat_template_kwargs`` (the template's variables; ``reasoning_effort``,
    OpenAI's, is one, for templates that read it, as vLLM passes it: gpt-oss's) and vLLM's
    ``add_generation_prompt`` and ``continue_final_message`` (how it is rendered: an answer begun
    in the final message is continued, not a new turn; ``tokenizer.RENDER_OPTIONS``)."""
    options = body.get("chat_template_kwargs")
    if options is not None and not isinstance(options, dict):
        raise invalid("chat_template_kwargs", "chat_template_kwargs must be an object")
    options = dict(options or {})
    if (effort := body.get("reasoning_effort")) is not None:  # (the template's variable, as vLLM hands it over)
        if effort not in REASONING_EFFORTS:
            raise invalid("reasoning_effort", f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}")
        options.setdefault("reasoning_effort", effort)
    for name in RENDER_OPTIONS:
        if body.get(name) is not None:
            options[name] = flag(body, name, False)
    if options.get(RENDER_OPTIONS[0]) is True and options.get(RENDER_OPTIONS[1]) is True:
        raise invalid("continue_final_message", "continue_final_message continues the final message: "
                      "add_generation_prompt must not be true too")
    return options
