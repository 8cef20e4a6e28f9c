"""What the client library hands back (``nebula_flow/client.py``): stream chunks, completions,
tokenizations and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class NebulaError(Exception):
    """Base class of the client's errors."""


class RequestError(NebulaError):
    """The broker rejected or failed a request. ``code`` says why (e.g. ``busy``, ``too_long``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class Busy(RequestError):
    """The broker is at its admission limit; retry later."""


class RequestTimeout(NebulaError):
    """No answer from the broker within the timeout."""


@dataclass
class Chunk:
    """Tokens committed by one verify step, and their text."""

    token_ids: list[int]
    text: str
    t_s: float  # seconds since the request was sent
    logprobs: list | None = None  # asked for: per token [id, text, logprob, [[id, text, logprob], ...]]
    # asked for, on the first chunk: the prompt's tokens', as ``logprobs`` and each token's rank after them (1: the
    # most likely; vLLM's); the first token's logprob and rank null: nothing predicts it
    prompt_logprobs: list | None = None
    prompt_text: str | None = None  # asked for (echo), on the first chunk: the prompt's text
    prompt_tokens: int | None = None  # asked for (prompt_count), on the first chunk: the prompt's token count


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    rounds: int
    tokens_per_round: list[int]
    ttft_s: float
    latency_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each chunk, as chunk_times_s
    logprobs: list | None = None  # asked for: each token's, as ``Chunk.logprobs``
    prompt_logprobs: list | None = None  # asked for: each prompt token's, as ``Chunk.prompt_logprobs``
    prompt_text: str | None = None  # asked for (echo): the prompt's text

    @property
    def mean_tokens_per_round(self) -> float:
        return len(self.token_ids) / self.rounds if self.rounds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "rounds": self.rounds, "tokens_per_round": self.tokens_per_round,
                "ttft_s": self.ttft_s, "latency_s": self.latency_s, "stats": self.stats,
                **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
                **({"prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else {}),
                **({"prompt_text": self.prompt_text} if self.prompt_text is not None else {})}


@dataclass
class Tokenization:
    """The broker's tokenizer at work (``Client.tokenize``, ``Client.detokenize``): the token ids (of the
    text given, or those given), the text (of the ids given), each id's piece of the vocabulary where
    asked, and the model's context."""

    token_ids: list[int]
    max_model_len: int
    text: str | None = None
    pieces: list[str] | None = None
