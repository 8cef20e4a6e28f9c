"""An OpenAI request body -> what the gateway asks the broker for, or an ``ApiError`` (400).

Pure: no sockets, no HTTP. Every field OpenAI defines is either honoured or refused with a
clear message naming it; fields it does not define are refused too (OpenAI does the same), so
nothing a caller sends is silently ignored. Extensions, as vLLM spells them: ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ``min_tokens``, ``chat_template_kwargs``,
``return_token_ids`` (each choice, and each streamed chunk, carries the ids of its tokens),
``structured_outputs`` (``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``) and the older
``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``, beside OpenAI's
``response_format`` (``nebula_flow/structured.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nebula_flow import structured
from nebula_flow.api import tools as tool_calls
from nebula_flow.api.conversation import MAX_MESSAGES, chat_options, flag, message_text, template_message
from nebula_flow.api.errors import ApiError, fields_known, invalid, no_such_model
from nebula_flow.api.tools import ToolCalling, ToolError
from nebula_flow.params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_LEN,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_SEED,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    is_int,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # choices in one answer (n for each prompt of a batch): OpenAI's most for n
# Fields OpenAI defines that the gateway does not build: refused when they ask for anything.
UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]),
    "web_search_options": (None,), "store": (None, False), "service_tier": (None, "auto", "default"),
    "verbosity": (None, "medium"),
}
IGNORED = {"user", "safety_identifier", "metadata"}  # accepted, no effect (as OpenAI: the caller's bookkeeping)
MAX_KEY_CHARS = 1024  # a prompt_cache_key's (or user's, safety_identifier's) longest


@dataclass
class Served:
    """What the gateway serves: the target's name, its context, the broker's output limit and the
    model's tool-call and thinking formats."""

    name: str
    max_model_len: int = 1 << 30
    max_new_tokens_limit: int = 4096
    tool_parser: str | None = None  # the model's tool-call format (``api/tools.PARSERS``): tool_choice "auto"
    reasoning_parser: str | None = None  # the model's thinking format (``api/reasoning.PARSERS``)
    root: str | None = None  # the broker's model folder (its tokenizer's: ``/v1/models``' ``root``, as vLLM's)


@dataclass
class Job:
    """What one HTTP request asks of the broker: ``n`` choices for each of ``inputs`` (each
    ``AsyncClient.stream``'s ``prompt=``, ``token_ids=`` or ``messages=`` and ``chat_options=``),
    every choice a request of its own at the broker; ``params`` are the rest of its keyword
    arguments."""

    chat: bool
    params: dict[str, Any]
    inputs: list[dict[str, Any]]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    calls: ToolCalling | None = None  # chat with tools: the output is tool calls (``api/tools.py``)
    reasoning: str | None = None  # chat: the reasoning parser that sets thinking apart (``api/reasoning.py``)
    echo: bool = False  # completions: each choice's text (and logprobs) begin with its prompt's
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (a token is made, and left out)
    prompt_top: int | None = None  # vLLM's prompt_logprobs: the prompt's, this many top tokens beside each
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N"
    chat_echo: str | None = None  # chat's echo (vLLM's): the final assistant message's text, before each answer

    def prompt_field(self, responding: bool) -> str:
        """The request's field that held its prompt (a refused prompt's error names it)."""
        return "input" if responding else "messages" if self.chat else "prompt"

    def echoes(self) -> list[str | None] | None:
        """With ``echo``, each choice's prompt text where it is the text given (None: the broker's text
        of the prompt it runs, token ids or a truncated prompt: ``SamplingParams.echo``)."""
        return [None if given.get("echo") else given.get("prompt") for given in self.inputs for _ in range(self.n)] \
            if self.echo else None

    def choices(self) -> list[dict[str, Any]]:
        """Each choice's keyword arguments for ``AsyncClient.stream``, in the order of the choices'
        indexes (prompt by prompt, ``n`` each). Choice j of a seeded request draws with ``seed + j``
        (as vLLM's do): the choices differ, and each is reproducible on its own, on any placement."""
        seed = self.params.get("seed")
        return [{**given, **self.params, **({"seed": (seed + j) % (MAX_SEED + 1)} if seed is not None and j else {})}
                for given in self.inputs for j in range(self.n)]


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or not low <= v <= high:
        raise invalid(name, f"{name} must be a number in [{low:g}, {high:g}], got {v!r}")
    return float(v)


def _common(body: Any, served: Served, chat: bool) -> dict[str, Any]:  # noqa: ANN401, C901
    """The sampling parameters both endpoints share, checked."""
    fields_known(body, set(CHAT_FIELDS if chat else COMPLETION_FIELDS) | set(UNSUPPORTED) | IGNORED)
    for name, allowed in UNSUPPORTED.items():
        if name in body and not any(body[name] == a and type(body[name]) is type(a) for a in allowed):
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str):
        raise invalid("model", "model is required (a string: GET /v1/models lists it)")
    if model != served.name:
        raise no_such_model(model, served.name)
    n = body.get("n")
    if n is not None and (not is_int(n) or not 1 <= n <= MAX_CHOICES):
        raise invalid("n", f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r}")
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if not isinstance(body.get(name, ""), str) or len(body.get(name, "")) > MAX_KEY_CHARS:
            raise invalid(name, f"{name} must be a string of at most {MAX_KEY_CHARS} characters")
    if not isinstance(body.get("metadata") or {}, dict):
        raise invalid("metadata", "metadata must be an object")
    params: dict[str, Any] = {}
    if body.get("prompt_cache_key"):  # (requests sharing one go to one broker shard: shards.route)
        params["prompt_cache_key"] = body["prompt_cache_key"]
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise invalid("temperature", f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    params["temperature"] = temperature
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise invalid("top_p", "top_p must be in (0, 1]")
    params["top_p"] = top_p
    if (min_p := _number(body, "min_p", 0.0, 0.0, 1.0)) > 0:
        params["min_p"] = min_p
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or top_k < -1:
            raise invalid("top_k", f"top_k must be an integer >= 0 (0 or -1: off), got {top_k!r}")
        params["top_k"] = max(0, top_k)
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed) or not -(MAX_SEED + 1) <= seed <= MAX_SEED:
            raise invalid("seed", f"seed must be a 64-bit integer, got {seed!r}")
        params["seed"] = seed % (MAX_SEED + 1)  # (OpenAI's seed is signed; ours is not)
    for name in ("presence_penalty", "frequency_penalty"):
        if v := _number(body, name, 0.0, -2.0, 2.0):
            params[name] = v
    if (v := _number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, 10.0)) != 1.0:
        params["repetition_penalty"] = v
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not is_int(min_tokens) or min_tokens < 0:
            raise invalid("min_tokens", f"min_tokens must be an integer >= 0, got {min_tokens!r}")
        params["min_tokens"] = min_tokens
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT:
            raise invalid("cache_salt", f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters")
        params["cache_salt"] = salt
    priority = body.get("priority")
    if priority is not None:
        if not is_int(priority) or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise invalid("priority", f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
        params["priority"] = priority
    params["stop"] = _stop(body.get("stop"))
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(is_int(t) and 0 <= t < 1 << 31 for t in ids):
            raise invalid("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        params["stop_token_ids"] = tuple(ids)
    bad = body.get("bad_words")  # (vLLM's: the broker spells them in tokens)
    if bad is not None:
        if not isinstance(bad, list) or len(bad) > MAX_BAD_WORDS or not all(
                isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_LEN for w in bad):
            raise invalid("bad_words", f"bad_words must be a list of at most {MAX_BAD_WORDS} words of 1 to "
                          f"{MAX_BAD_WORD_LEN} characters")
        params["bad_words"] = tuple(bad)
    allowed = body.get("allowed_token_ids")  # (vLLM's)
    if allowed is not None:
        if not isinstance(allowed, list) or not 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS or not all(
                is_int(t) and 0 <= t < 1 << 31 for t in allowed):
            raise invalid("allowed_token_ids", f"allowed_token_ids must be a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
        params["allowed_token_ids"] = tuple(allowed)
    for name in ("ignore_eos", "return_token_ids", "include_stop_str_in_output", "return_tokens_as_token_ids",
                 "skip_special_tokens"):
        flag(body, name, False)
    params["ignore_eos"] = flag(body, "ignore_eos", False)
    if body.get("include_stop_str_in_output"):
        params["include_stop_str_in_output"] = True
    if body.get("skip_special_tokens") is False:
        params["skip_special_tokens"] = False
    if (keep := body.get("truncate_prompt_tokens")) is not None:  # (vLLM's; -1: the context's length)
        if not is_int(keep) or keep == 0 or keep < -1:
            raise invalid("truncate_prompt_tokens", f"truncate_prompt_tokens must be a positive integer or -1, got {keep!r}")
        params["truncate_prompt_tokens"] = served.max_model_len if keep == -1 else keep
    params.update(_max_tokens(body, served, chat))
    if (top := _logprobs(body, chat)) is not None:
        params["logprobs"] = top
    if bias := _logit_bias(body.get("logit_bias")):
        params["logit_bias"] = bias
    if (given := _structured(body)) is not None:
        _bind(params, *given)
    return params


def _bind(params: dict[str, Any], param: str, spec: dict[str, Any]) -> None:
    """Set the structured output ``spec`` that field ``param`` asked for, checked."""
    if params["ignore_eos"]:
        raise invalid("ignore_eos", "structured outputs cannot ignore EOS: a complete grammar ends with it")
    try:
        structured.check(spec)
    except structured.InvalidStructure as exc:
        raise invalid(param, f"{param}: {exc}") from None
    params["structured"] = spec


def _logit_bias(bias: Any) -> dict[int, float]:  # noqa: ANN401
    """OpenAI's ``logit_bias``: token ids (as JSON's string keys) to numbers in [-100, 100]."""
    if bias is None:
        return {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids to numbers")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdecimal() and int(key) < 1 << 31):
            raise invalid("logit_bias", f"logit_bias's keys must be token ids, got {str(key)[:40]!r}")
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or not -100 <= value <= 100:
            raise invalid("logit_bias", f"logit_bias's values must be numbers in [-100, 100], got {value!r}"[:200])
        out[int(key)] = float(value)
    return out


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", "tools", *GUIDED})


def _structured(body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The field that asks what the output must follow (``nebula_flow/structured.py``), and its
    spec: OpenAI's ``response_format``, vLLM's ``structured_outputs`` or its older ``guided_*``
    fields, at most one of them."""
    given: dict[str, dict[str, Any]] = {}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            schema = fmt.get("json_schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), dict):
                raise invalid("response_format", "response_format.json_schema must be an object with a schema")
            given["response_format"] = {"json": schema.get("schema", {})}
        elif kind != "text":
            raise invalid("response_format", "response_format.type must be text, json_object or json_schema")
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise invalid("structured_outputs", f"structured_outputs must be an object with one of {', '.join(structured.KINDS)}")
        chosen = {k: v for k, v in outputs.items() if v is not None and v is not False}
        if extra := sorted(set(chosen) - set(structured.KINDS)):
            raise ApiError(400, f"structured_outputs: {', '.join(map(str, extra))[:200]} not supported",
                           param="structured_outputs", code="unsupported_parameter")
        given["structured_outputs"] = chosen
    given.update({name: {kind: body[name]} for name, kind in GUIDED.items() if body.get(name) is not None})
    if len(given) > 1:
        raise invalid(sorted(given)[1], f"ask for one structured output, not {' and '.join(sorted(given))}")
    return next(iter(given.items()), None)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top tokens to report beside each output token's log-probability (None: none of
    it): chat's ``logprobs`` (a boolean) and ``top_logprobs``; completions' ``logprobs`` (a count)."""
    def count(name: str, v: Any) -> int:  # noqa: ANN401
        if not is_int(v) or not 0 <= v <= MAX_LOGPROBS:
            raise invalid(name, f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {v!r}")
        return v

    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        return None if asked is None else count("logprobs", asked)
    if asked is not None and not isinstance(asked, bool):
        raise invalid("logprobs", "logprobs must be a boolean (top_logprobs says how many top tokens)")
    if top is not None and not asked:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return (count("top_logprobs", top) if top is not None else 0) if asked else None


def _stop(stop: Any) -> tuple[str, ...]:  # noqa: ANN401
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "stop must be a string or a list of strings")
    stops = [s for s in stops if s]  # (an empty stop string stops nothing)
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in stops):
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LEN} characters")
    return tuple(stops)


def _max_tokens(body: dict[str, Any], served: Served, chat: bool) -> dict[str, Any]:
    """``max_completion_tokens`` (or the older ``max_tokens``); absent: OpenAI's default of 16 for
    completions, and for chat as many as the context leaves (up to the broker's limit)."""
    given = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise invalid("max_tokens", "max_tokens and max_completion_tokens disagree")
    if not given:
        if chat:
            return {"max_new_tokens": min(served.max_new_tokens_limit, served.max_model_len), "fit_context": True}
        return {"max_new_tokens": min(COMPLETION_DEFAULT_MAX_TOKENS, served.max_new_tokens_limit)}
    name, value = next(iter(given.items()))
    if value == 0 and is_int(value) and not chat and body.get("echo") is True:
        return {"max_new_tokens": 0}  # (echo alone: scores the prompt, ``parse_completion``)
    if not is_int(value) or value < 1:
        raise invalid(name, f"{name} must be a positive integer (0 only with echo, on completions), got {value!r}")
    if value > served.max_new_tokens_limit:
        raise invalid(name, f"{name} {value} exceeds this server's limit of {served.max_new_tokens_limit}")
    if value >= served.max_model_len:
        raise invalid(name, f"{name} {value} leaves no room for a prompt in the context of {served.max_model_len} tokens")
    return {"max_new_tokens": value}


def _streaming(body: dict[str, Any], params: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options``: whether the answer streams and ends with a usage event;
    with ``continuous_usage_stats`` (vLLM's) every event carries its choice's usage so far, for which
    the broker tells each request's prompt count before its first tokens (``params``' ``prompt_count``)."""
    stream, options = body.get("stream", False), body.get("stream_options")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", "stream must be a boolean")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"} \
            or not all(isinstance(options.get(k, False), bool) for k in options):
        raise invalid("stream_options", "stream_options takes include_usage, continuous_usage_stats and "
                      "include_obfuscation (booleans)")
    if options.get("include_obfuscation"):  # (OpenAI's padding of each event against size side channels)
        raise ApiError(400, "stream_options.include_obfuscation is not supported by this server (its events carry no "
                       "obfuscation field): send false or leave it out", param="stream_options",
                       code="unsupported_parameter")
    if options.get("continuous_usage_stats"):
        params["prompt_count"] = True
    return True, options.get("include_usage", False)


def _choices(body: dict[str, Any], prompts: int) -> int:
    """``n``, checked against the prompts it multiplies."""
    n = body.get("n") or 1
    if n * prompts > MAX_CHOICES:
        raise invalid("n", f"n ({n}) times the prompts ({prompts}) must be at most {MAX_CHOICES} choices")
    return n


def _prompt(prompt: Any, where: str) -> dict[str, Any]:  # noqa: ANN401
    """One prompt of a completion request: a string or token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise invalid(where, f"{where} is empty")
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(is_int(t) and 0 <= t < 1 << 31 for t in prompt):
        return {"token_ids": list(prompt)}
    raise invalid(where, f"{where} must be a non-empty string or a non-empty list of token ids")


def parse_completion(body: Any, served: Served) -> Job:  # noqa: ANN401
    """``POST /v1/completions``: a prompt (a string, or token ids), or a batch of them (a list of
    strings or of token-id lists); each prompt's choices come in the batch's order."""
    params = _common(body, served, chat=False)
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str | list) for p in prompt)
    if batch and len(prompt) > MAX_CHOICES:
        raise invalid("prompt", f"at most {MAX_CHOICES} prompts in one request, got {len(prompt)}")
    inputs = [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)] if batch else [_prompt(prompt, "prompt")]
    stream, usage = _streaming(body, params)
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise invalid("echo", "echo must be a boolean")
    if echo:  # (OpenAI's: the prompt's tokens' logprobs too, first null; a token-id prompt's text from the broker)
        if "logprobs" in params:
            params["prompt_logprobs"] = params["logprobs"]
        # (the broker's text of the prompt it runs: a token-id prompt's, or one it truncates)
        inputs = [{**given, "echo": True} if "token_ids" in given or "truncate_prompt_tokens" in params else given
                  for given in inputs]
    # echo and max_tokens 0 (as vLLM's): the prompt alone, scored. The request runs for one token, which
    # costs nothing more (the forward that computes the prompt picks it) and is left out of the answer.
    echo_only = params["max_new_tokens"] == 0
    if echo_only:
        params["max_new_tokens"] = 1
        if params.get("min_tokens"):
            raise invalid("min_tokens", "min_tokens must be 0 when max_tokens is 0")
    return Job(False, params, inputs, _choices(body, len(inputs)), stream=stream, include_usage=usage,
               return_token_ids=body.get("return_token_ids", False), echo=echo, echo_only=echo_only,
               prompt_top=_prompt_top(body, params, stream), tokens_as_ids=body.get("return_tokens_as_token_ids") is True)


def _prompt_top(body: dict[str, Any], params: dict[str, Any], stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs`` (an extension): the prompt's tokens' log-probabilities and this
    many top tokens beside each, in the answer (not streamed); the broker is asked for at least as
    many top tokens as echo's logprobs want too."""
    top = body.get("prompt_logprobs")
    if top is None:
        return None
    if not is_int(top) or not 0 <= top <= MAX_LOGPROBS:
        raise invalid("prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
    if stream:
        raise ApiError(400, "prompt_logprobs are not streamed: ask without stream (or use echo with logprobs)",
                       param="prompt_logprobs", code="unsupported_parameter")
    params["prompt_logprobs"] = max(top, params.get("prompt_logprobs", 0))
    return top


def _prediction(prediction: Any) -> str | None:  # noqa: ANN401
    """OpenAI's Predicted Outputs, ``{"type": "content", "content": text or text parts}``: what the
    answer is expected to be, mostly (a file being edited). Drafts are looked up in it; the answer
    is the same with or without it."""
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or set(prediction) - {"type", "content"}:
        raise invalid("prediction", 'prediction must be {"type": "content", "content": a string or text parts}')
    return message_text("prediction", prediction.get("content"))


def parse_chat(body: Any, served: Served) -> Job:  # noqa: ANN401
    """``POST /v1/chat/completions``: a conversation through the target's chat template."""
    params = _common(body, served, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise invalid("messages", f"messages must be a non-empty list (at most {MAX_MESSAGES})")
    options = chat_options(body)
    stream, usage = _streaming(body, params)
    try:
        tools, calls, forced = tool_calls.parse(body, served.tool_parser)
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param,
                       code="unsupported_parameter" if exc.unsupported else "invalid_value") from None
    if forced is not None:
        if "structured" in params:
            raise invalid("tool_choice", "a tool_choice that forces a call cannot be combined with a structured output")
        if "logprobs" in params:
            raise ApiError(400, "logprobs with a tool_choice that forces a call are not supported", param="logprobs",
                           code="unsupported_parameter")
        _bind(params, "tools", forced)
    if "structured" in params and served.reasoning_parser is not None:  # (the model thinks first, freely)
        params["think_first"] = True
    if tools is not None:
        options = {**(options or {}), "tools": tools}
    if (prediction := _prediction(body.get("prediction"))) is not None:
        params["prediction"] = prediction
    inputs = [{"messages": [template_message(i, m) for i, m in enumerate(messages)], "chat_options": options or None}]
    echo = flag(body, "echo", False)  # (vLLM's: the answer begins with the final message, where it is the assistant's)
    if echo and calls is not None:
        raise ApiError(400, "echo with tools is not supported", param="echo", code="unsupported_parameter")
    last = inputs[0]["messages"][-1]
    return Job(True, params, inputs, _choices(body, 1), stream=stream, include_usage=usage,
               return_token_ids=body.get("return_token_ids", False), calls=calls, reasoning=served.reasoning_parser,
               prompt_top=_prompt_top(body, params, stream), tokens_as_ids=body.get("return_tokens_as_token_ids") is True,
               chat_echo=(last["content"] or "") if echo and last["role"] == "assistant" else None)


SHARED_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options",
                 "n", "ignore_eos", "stop_token_ids", "return_token_ids", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "logit_bias", "response_format", "structured_outputs", "cache_salt",
                 "priority", "prompt_logprobs", "include_stop_str_in_output", "truncate_prompt_tokens",
                 "return_tokens_as_token_ids", "skip_special_tokens", "allowed_token_ids", "bad_words",
                 "prompt_cache_key", *GUIDED)
COMPLETION_FIELDS = (*SHARED_FIELDS, "prompt", "logprobs", "echo")
CHAT_FIELDS = (*SHARED_FIELDS, "messages", "max_completion_tokens", "chat_template_kwargs", "add_generation_prompt",
               "reasoning_effort",
               "continue_final_message", "echo", "logprobs", "top_logprobs",
               "tools", "tool_choice", "parallel_tool_calls", "prediction")
