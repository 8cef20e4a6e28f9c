"""vLLM's ``/tokenize`` and ``/detokenize``: the broker's tokenizer at work, nothing generated
(``protocol.Tokenize``; the gateway holds no tokenizer of its own, so the ids are the ones a
request would be given).

``POST /tokenize`` takes a ``prompt`` (text; ``add_special_tokens`` default true) or ``messages``
(through the chat template as a chat request's, with its ``chat_template_kwargs`` and ``tools``;
``add_generation_prompt`` default true, ``add_special_tokens`` default false), and
``return_token_strs``; it answers ``{"count", "max_model_len", "tokens", "token_strs"}``.
``POST /detokenize`` takes ``tokens`` and answers ``{"prompt"}``. ``model`` is optional, as vLLM's.
"""

from __future__ import annotations

from typing import Any

from nebula_flow.api import tools as tool_calls
from nebula_flow.api.conversation import MAX_MESSAGES, chat_options, flag, template_message
from nebula_flow.api.errors import fields_known, invalid, no_such_model
from nebula_flow.api.request import Served
from nebula_flow.outputs import Tokenization

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "chat_template_kwargs", "tools", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
MAX_TOKEN_IDS = 1 << 20  # ids in one /detokenize


def _checked(body: Any, served: Served, known: frozenset[str]) -> dict[str, Any]:  # noqa: ANN401
    """``body``'s fields known, and its ``model``, where given, the one served (optional, as vLLM's)."""
    body = fields_known(body, known)
    model = body.get("model")
    if model is not None and model != served.name:
        raise no_such_model(str(model), served.name)
    return body


def parse_tokenize(body: Any, served: Served) -> dict[str, Any]:  # noqa: ANN401
    """``POST /tokenize``'s body, checked: ``AsyncClient.tokenize``'s keyword arguments."""
    body = _checked(body, served, TOKENIZE_FIELDS)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise invalid("prompt", "give exactly one of prompt and messages")
    pieces = flag(body, "return_token_strs", False)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise invalid("prompt", "prompt must be a string")
        return {"text": prompt, "special": flag(body, "add_special_tokens", True), "pieces": pieces}
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise invalid("messages", f"messages must be a non-empty list (at most {MAX_MESSAGES})")
    options = chat_options(body)
    try:  # (the tools as a chat request gives them to the template; how calls would be read does not matter here)
        tools, _, _ = tool_calls.parse({"tools": body.get("tools"), "tool_choice": "none"})
    except tool_calls.ToolError as exc:
        raise invalid(exc.param, str(exc)) from None
    if tools is not None:
        options = {**(options or {}), "tools": tools}
    return {"messages": [template_message(i, m) for i, m in enumerate(messages)], "chat_options": options or None,
            "special": flag(body, "add_special_tokens", False), "pieces": pieces}


def parse_detokenize(body: Any, served: Served) -> dict[str, Any]:  # noqa: ANN401
    """``POST /detokenize``'s body, checked: ``AsyncClient.tokenize``'s keyword arguments."""
    tokens = _checked(body, served, DETOKENIZE_FIELDS).get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in tokens):
        raise invalid("tokens", f"tokens must be a list of at most {MAX_TOKEN_IDS} token ids")
    return {"token_ids": tokens}


def tokenized(got: Tokenization) -> dict[str, Any]:
    """``/tokenize``'s answer."""
    return {"count": len(got.token_ids), "max_model_len": got.max_model_len, "tokens": got.token_ids,
            "token_strs": got.pieces}
