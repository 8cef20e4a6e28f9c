"""Sampling parameters of one request, validated where they enter the system."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MIN_TEMPERATURE = 1e-5  # below it sampling is greedy in all but name, and numerically unsafe
# The least repetition penalty: a positive logit is divided by it, then by the temperature, and a
# tinier one (fp32 rounds 1e-56 to 0) made logits infinite and the probabilities NaN, failing the
# request inside a worker (found by tests/test_api.py's fuzzer); at this one they stay finite.
MIN_REPETITION_PENALTY = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_SEED = 2**63 - 1
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # ids in allowed_token_ids (vocabularies reach ~256k)
MAX_BAD_WORDS, MAX_BAD_WORD_LEN = 64, 128  # bad_words: strings (and their token sequences), characters (tokens) each
MAX_LOGPROBS = 20  # most likely tokens reported beside each output token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 1024  # token ids a request may bias
MAX_CACHE_SALT = 256  # characters of a cache_salt
MAX_PRIORITY = 2**31 - 1  # a priority is in [-MAX_PRIORITY, MAX_PRIORITY]


def is_int(v: Any) -> bool:  # noqa: ANN401
    """An integer, and not a bool (JSON's true is no token id or count)."""
    return isinstance(v, int) and not isinstance(v, bool)


class InvalidParams(ValueError):
    """A request's sampling parameters are out of range or of the wrong type."""


def did_you_mean(unknown: list[str], known: Iterable[str], cutoff: float) -> str:
    """What follows an "unknown names" error: ``" (name: did you mean known_name?)"``, one clause for
    each of the first ``unknown`` names (a caller's, cut short) close to a ``known`` one, joined by
    "; "; "" where none is."""
    known = list(known)
    near = {str(name)[:64]: difflib.get_close_matches(str(name), known, 1, cutoff) for name in unknown[:8]}
    hints = "; ".join(f"{name}: did you mean {close[0]}?" for name, close in near.items() if close)
    return f" ({hints})" if hints else ""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy (argmax).

    ``top_k == 0``, ``top_p == 1.0`` and ``min_p == 0`` disable those filters (``min_p``, vLLM's: a
    token less likely than ``min_p`` times the most likely one is dropped; ``specdec.target_probs``).
    ``seed`` fixes every random number the request uses (see ``specdec.uniform``); the broker draws
    one when it is absent, so a request's randomness never depends on which worker runs it. ``stop_token_ids`` end the
    output like EOS (the token kept, ``finish_reason`` "stop"), whether or not ``ignore_eos``.
    ``logprobs`` (None: off): report each output token's log-probability under the target's own
    distribution (its raw logits, before penalties, temperature, top-k and top-p, as vLLM does by
    default) and this many most likely tokens beside it. ``prompt_logprobs`` (vLLM's; None: off):
    the same for each prompt token after the first (the target scores the whole prompt, so such a
    request does not read the prefix cache). ``echo``: the stream's first message carries the
    prompt's text, as the broker's tokenizer decodes it (OpenAI's ``echo``); ``prompt_count``: its
    token count (``usage.prompt_tokens`` before the end: vLLM's ``continuous_usage_stats``). ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, -2..2, on the output's tokens) and ``repetition_penalty``
    (vLLM's and HF's, > 0, on the prompt's and the output's) change the distribution the output
    follows, greedy or sampled (``nebula_flow/penalties.py``); so does ``min_tokens`` (vLLM's): no
    EOS or stop token id, and no stop string, ends the output before it has this many tokens.
    ``logit_bias`` (OpenAI's: token id -> a number from -100 to 100) is added to the target's logits
    before the penalties (as vLLM applies it), so -100 all but bans a token and 100 all but forces it.
    ``structured`` (None: free text): the output follows a JSON schema, any JSON object, a regular
    expression, one of some choices or a Lark grammar (``nebula_flow/structured.py``), greedy or
    sampled; it ends with EOS once the grammar is complete, so it cannot ignore EOS. With
    ``think_first`` it binds only what follows the end of a reasoning model's thinking
    (``</think>``, in the output or already in the prompt), as vLLM's reasoning parsers have it.
    ``cache_salt`` (vLLM's): the workers' prefix cache reuses KV only between requests with the
    same salt (none: those without one), so a user cannot tell from its speed whether another
    user's requests began as its own does (``kv/store.py``, ``prefixes.py``).
    ``priority`` (vLLM's): where the broker's ``priority`` policy is on, its queued tasks go before
    those of requests with a higher one (lower first; equal ones by arrival); else only 0 is taken.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    structured: dict[str, Any] | None = field(default=None, hash=False)  # e.g. {"json": schema}, {"regex": "..."}
    think_first: bool = False  # the grammar binds only the answer, after a reasoning model's thinking (</think>)
    fit_context: bool = False  # cut max_new_tokens to what the context leaves after the prompt
    echo: bool = False  # the stream's first message carries the prompt's text
    prompt_count: bool = False  # the stream's first message carries the prompt's token count
    cache_salt: str | None = None  # KV reused only among requests of the same salt (the prefix cache)
    priority: int = 0  # lower first (the broker's ``priority`` policy; nebula_flow/topic.py)
    include_stop_str_in_output: bool = False  # (vLLM's) the text keeps the stop string (or stop token) that ended it
    skip_special_tokens: bool = True  # (vLLM's) special tokens' text left out of the output's text
    # (vLLM's) only these ids may be picked: every other logit -inf in each verify and draft row (``penalties``)
    allowed_token_ids: tuple[int, ...] | None = None
    # (vLLM's) words the output may not write: the broker turns each into the token sequences that spell it
    # (``bad_word_ids``: as written, and after a space), and no row may pick a sequence's last token after the rest
    bad_words: tuple[str, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    truncate_prompt_tokens: int | None = None  # (vLLM's) only the prompt's last this many tokens are kept

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __post_init__(self) -> None:
        # penalized: penalties, min_tokens or a grammar change the target's distribution row by row
        # (``nebula_flow/penalties.py``); a plain attribute beside the fields, not a property: the
        # broker reads it for every task it sends
        object.__setattr__(self, "penalized", self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                           or self.repetition_penalty != 1.0 or self.min_tokens != 0 or self.structured is not None
                           or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_word_ids)
                           or bool(self.bad_words))

    def to_wire(self) -> dict[str, Any]:
        """The parameters as they travel (made once: every task of the request carries them;
        callers must not change it)."""
        wire = self.__dict__.get("_wire")
        if wire is None:
            wire = {f: getattr(self, f) for f in self.__dataclass_fields__}
            wire["stop"] = list(self.stop)
            wire["stop_token_ids"] = list(self.stop_token_ids)
            if self.allowed_token_ids is not None:
                wire["allowed_token_ids"] = list(self.allowed_token_ids)
            if self.logit_bias is not None:  # (JSON's keys are strings)
                wire["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
            object.__setattr__(self, "_wire", wire)  # (a frozen dataclass: a cache beside its fields)
        return wire

    @classmethod
    def from_wire(cls, raw: Any, grammar: bool = True) -> SamplingParams:  # noqa: ANN401
        if not isinstance(raw, dict):
            raise InvalidParams("params must be an object")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:  # (OpenAI's names, the closest of ours: max_tokens -> max_new_tokens)
            raise InvalidParams(f"unknown parameters: {sorted(unknown)}"
                                + did_you_mean(sorted(unknown), cls.__dataclass_fields__, 0.6))
        raw = dict(raw)
        stop = raw.pop("stop", ()) or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidParams("stop must be a string or a list of non-empty strings")
        ids = raw.pop("stop_token_ids", ()) or ()
        if not isinstance(ids, (list, tuple)):
            raise InvalidParams("stop_token_ids must be a list of token ids")
        for name in ("bad_words", "bad_word_ids"):
            given = raw.get(name) or ()
            if not isinstance(given, (list, tuple)) or name == "bad_word_ids" and not all(
                    isinstance(w, (list, tuple)) for w in given):
                raise InvalidParams(f"{name} must be a list of " + ("strings" if name == "bad_words" else "id lists"))
            raw[name] = tuple(tuple(w) if name == "bad_word_ids" else w for w in given)
        allowed = raw.pop("allowed_token_ids", None)
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)):
                raise InvalidParams("allowed_token_ids must be a list of token ids")
            raw["allowed_token_ids"] = tuple(allowed)
        bias = raw.pop("logit_bias", None)
        if bias is not None:
            if not isinstance(bias, dict):
                raise InvalidParams("logit_bias must be an object of token ids to numbers")
            try:
                bias = {int(t): b for t, b in bias.items()}
            except (TypeError, ValueError):
                raise InvalidParams("logit_bias's keys must be token ids") from None
        params = cls(stop=tuple(stop), stop_token_ids=tuple(ids), logit_bias=bias, **raw)
        params.validate(grammar=grammar)
        return params

    def validate(self, max_new_tokens_limit: int | None = None, grammar: bool = True) -> None:
        """``InvalidParams`` unless every parameter is in range; ``grammar``: compile a structured
        output's grammar too (else only its shape and size are checked)."""
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidParams(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidParams(f"max_new_tokens {self.max_new_tokens} exceeds the limit {max_new_tokens_limit}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0 or t > 100:
            raise InvalidParams(f"temperature must be a finite number in [0, 100], got {t!r}")
        if 0 < t < MIN_TEMPERATURE:  # (logits / a subnormal temperature overflow to inf: NaN probabilities)
            raise InvalidParams(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {t!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidParams(f"top_k must be an integer >= 0, got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not math.isfinite(p) or not 0 < p <= 1:
            raise InvalidParams(f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if not isinstance(m, (int, float)) or isinstance(m, bool) or not math.isfinite(m) or not 0 <= m <= 1:
            raise InvalidParams(f"min_p must be in [0, 1] (0: off), got {m!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidParams(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in self.stop):
            raise InvalidParams(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LEN} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
                is_int(t) and 0 <= t < 1 << 31 for t in self.stop_token_ids):
            raise InvalidParams(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidParams(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or null: off), got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not -2 <= v <= 2:
                raise InvalidParams(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r) \
                or not MIN_REPETITION_PENALTY <= r <= 10:
            raise InvalidParams(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, 10] (1: off), got {r!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidParams(f"min_tokens must be an integer from 0 to max_new_tokens, got {self.min_tokens!r}")
        if self.allowed_token_ids is not None and (not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS or not all(
                is_int(t) and 0 <= t < 1 << 31 for t in self.allowed_token_ids)):
            raise InvalidParams(f"allowed_token_ids must be 1 to {MAX_ALLOWED_TOKEN_IDS} token ids (integers >= 0)")
        if len(self.bad_words) > MAX_BAD_WORDS or not all(isinstance(w, str) and 0 < len(w.strip()) and len(w) <=
                                                          MAX_BAD_WORD_LEN for w in self.bad_words):
            raise InvalidParams(f"bad_words must be at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_LEN} characters")
        if len(self.bad_word_ids) > 2 * MAX_BAD_WORDS or not all(0 < len(w) <= MAX_BAD_WORD_LEN and all(
                is_int(t) and 0 <= t < 1 << 31 for t in w) for w in self.bad_word_ids):
            raise InvalidParams(f"bad_word_ids must be at most {2 * MAX_BAD_WORDS} sequences of 1 to "
                                f"{MAX_BAD_WORD_LEN} token ids")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT):
            raise InvalidParams(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters, got {self.cache_salt!r}")
        if not is_int(self.priority) or not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidParams(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")
        flags = ("ignore_eos", "fit_context", "think_first", "echo", "prompt_count", "include_stop_str_in_output",
                 "skip_special_tokens")
        if not all(isinstance(getattr(self, f), bool) for f in flags):
            raise InvalidParams(f"{', '.join(flags)} must be booleans")
        if self.truncate_prompt_tokens is not None and (not is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < 1):
            raise InvalidParams(f"truncate_prompt_tokens must be a positive integer, got {self.truncate_prompt_tokens!r}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS or not all(
                    is_int(t) and 0 <= t < 1 << 31 and isinstance(b, (int, float)) and not isinstance(b, bool)
                    and math.isfinite(b) and -100 <= b <= 100 for t, b in bias.items()):
                raise InvalidParams(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]")
        if self.structured is not None:
            from nebula_flow import structured  # (llguidance: loaded only where a request asks for it)

            structured.check(self.structured, compile=grammar)
            if self.ignore_eos:
                raise InvalidParams("structured outputs cannot ignore EOS: a complete grammar ends with it")
