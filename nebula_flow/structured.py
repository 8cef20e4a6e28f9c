"""Structured outputs: a request may ask that its output follow a JSON schema, any JSON object, a
regular expression, one of a list of choices, or a Lark grammar (vLLM's ``structured_outputs``).

A request names it as one entry, vLLM's ``StructuredOutputsParams`` fields:

    {"json": <a JSON schema (an object, or its text)>}   {"json_object": true}
    {"regex": "<pattern>"}   {"choice": ["yes", "no"]}   {"grammar": "<Lark grammar>"}

It becomes an llguidance grammar (``grammar``); the verify of every round masks each row's logits
to the tokens the grammar allows after that row's path (``workers/guides.py``, beside the
penalties in ``nebula_flow/penalties.py``), and once the grammar is complete only EOS is allowed.
So greedy output is the target's own greedy output under the grammar, and sampled output follows
the target's masked distribution exactly. The draft follows the grammar too, so that its
proposals are worth verifying (``workers/draft_rules.py``); exactness never depends on it.

JSON is written compactly by default, as ``json.dumps`` writes it (no free whitespace: a model
cannot pad an object with spaces until ``max_tokens``); a schema's ``x-guidance`` options (e.g.
``{"whitespace_flexible": true}``) override that, as llguidance defines them.

llguidance (Rust; no torch) compiles and checks grammars here, in the broker and the gateway,
so a bad one is a clear error before any worker sees it.
"""

from __future__ import annotations

import json
from typing import Any

from nebula_flow.params import InvalidParams

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 << 10  # a spec's size as JSON: every task of the request carries it
MAX_CHOICES = 1024
MAX_GRAMMARS = 256  # distinct specs whose grammar a process keeps
JSON_DEFAULTS = {"whitespace_flexible": False}


class InvalidStructure(InvalidParams):
    """A structured-output request that names no grammar llguidance can build."""


def check(spec: Any, compile: bool = True) -> None:  # noqa: ANN401
    """Raise ``InvalidStructure`` unless ``spec`` is one kind this module knows, with a grammar
    that compiles (``compile``; else of a size that may)."""
    if compile:
        grammar(spec)
    else:
        _text(spec)


def compiled(spec: Any) -> bool:  # noqa: ANN401
    """Whether ``spec``'s grammar is compiled here already (``grammar`` costs nothing then): a
    broker compiles a new one on a thread of its own, as it tokenizes a long prompt (a large JSON
    schema takes ~70 ms)."""
    try:
        return _text(spec) in _GRAMMARS
    except InvalidStructure:
        return True  # (refused at once: nothing to compile)


def grammar(spec: Any) -> str:  # noqa: ANN401
    """The llguidance grammar of ``spec`` (compiled and checked once per distinct spec)."""
    text = _text(spec)
    if (built := _GRAMMARS.get(text)) is None:
        built = _compile(text)
        if len(_GRAMMARS) >= MAX_GRAMMARS:  # (a bound, not an LRU: a deployment serves few schemas)
            _GRAMMARS.clear()
        _GRAMMARS[text] = built
    return built


def grammar_of(params: Any) -> str:  # noqa: ANN401
    """``grammar(params.structured)``, kept on ``params`` (a worker's tasks of one request share
    one ``SamplingParams``: its spec is not serialized again every round)."""
    built = params.__dict__.get("_grammar")
    if built is None:
        built = grammar(params.structured)
        object.__setattr__(params, "_grammar", built)  # (a frozen dataclass: a cache beside its fields)
    return built


def _text(spec: Any) -> str:  # noqa: ANN401
    """``spec`` checked for shape and size, as JSON text (the key of its grammar)."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise InvalidStructure(f"structured outputs take exactly one of {', '.join(KINDS)}, got "
                               f"{sorted(spec)[:5] if isinstance(spec, dict) else type(spec).__name__}")
    try:
        text = json.dumps(spec, ensure_ascii=False)  # (not sorted: a schema's properties come in its order)
    except (TypeError, ValueError) as exc:
        raise InvalidStructure(f"structured outputs must be JSON: {exc}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidStructure(f"a structured-output spec may be at most {MAX_SPEC_CHARS} characters as JSON")
    return text


_GRAMMARS: dict[str, str] = {}  # spec as JSON -> its grammar (dicts are safe across threads for this use)


def _compile(text: str) -> str:
    from llguidance import LLMatcher

    (kind, value), = json.loads(text).items()
    try:
        built = _build(LLMatcher, kind, value)
    except InvalidStructure:
        raise
    except ValueError as exc:  # (llguidance's own refusals: a schema that is not an object, ...)
        raise InvalidStructure(f"the {kind} grammar does not compile: {exc}") from None
    if error := LLMatcher.validate_grammar(built):
        raise InvalidStructure(f"the {kind} grammar does not compile: {error.strip()[:500]}")
    return built


def _build(LLMatcher: Any, kind: str, value: Any) -> str:  # noqa: ANN401, N803
    """llguidance's grammar text for one kind of spec."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidStructure(f"json must be a JSON schema (an object or its text): {exc}") from None
        if not isinstance(value, dict):
            raise InvalidStructure("json must be a JSON schema (an object)")
        return LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        if value is not True:
            raise InvalidStructure("json_object must be true")
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidStructure("regex must be a non-empty string")
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or len(value) > MAX_CHOICES or not all(
                isinstance(c, str) and c for c in value):
            raise InvalidStructure(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        # (Lark's string literals read JSON's escapes)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(value)))
    if not isinstance(value, str) or not value:
        raise InvalidStructure("grammar must be a Lark grammar (a non-empty string)")
    return LLMatcher.grammar_from_lark(value)
