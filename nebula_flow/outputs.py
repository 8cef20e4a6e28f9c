"""What the client library hands back (``nebula_flow/client.py``): stream chunks, completions,
tokenizations and the errors it raises; and ``Collector``, which makes a request's chunks and
completion of the broker's messages."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nebula_flow.protocol import Done, Tokens


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


class Collector:
    """Turns TOKENS / DONE messages of one request into chunks and a ``Completion``.

    Chunks carry the offsets of their first token and character, so after a re-send (a retry
    re-attaches and gets everything again; a restarted broker runs the request again, with the
    same output, greedy or seeded, but maybe other round boundaries) only what was not seen yet is
    passed on.
    """

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.ttft: float | None = None
        self.times: list[float] = []
        self.counts: list[int] = []
        self.seen_tokens = 0
        self.seen_text = 0
        self.token_ids: list[int] = []  # the tokens passed on so far (what a resend resumes after: ``client.resend``)
        self.logprobs: list | None = None  # asked for: every token's, as the chunks brought them
        self.prompt_logprobs: list | None = None  # asked for: the prompt's tokens', as their chunks brought them
        self.prompt_text: str | None = None  # asked for (echo)
        self.prompt_tokens: int | None = None  # asked for (prompt_count)

    def chunk(self, msg: Tokens) -> Chunk | None:
        if msg.prompt_text is not None:
            self.prompt_text = msg.prompt_text
        if msg.prompt_tokens is not None:
            self.prompt_tokens = msg.prompt_tokens
        if msg.prompt_logprobs:  # (they come before the first tokens, in chunks of their own)
            have, at = self.prompt_logprobs or [], msg.prompt_offset
            if at <= len(have):
                self.prompt_logprobs = have[:at] + msg.prompt_logprobs + have[at + len(msg.prompt_logprobs):]
        skip = max(0, self.seen_tokens - msg.offset)
        tokens = list(msg.token_ids[skip:])
        text = msg.text[max(0, self.seen_text - msg.text_offset):]
        if not tokens and not text:
            return None  # all of it was seen already
        self.seen_tokens = max(self.seen_tokens, msg.offset + len(msg.token_ids))
        self.token_ids.extend(tokens)
        self.seen_text = max(self.seen_text, msg.text_offset + len(msg.text))
        t = time.monotonic() - self.t0
        first = self.ttft is None
        self.ttft = t if first else self.ttft
        self.times.append(t)
        self.counts.append(len(tokens))
        logprobs = msg.logprobs[skip:] if msg.logprobs is not None else None
        if logprobs:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(logprobs)
        return Chunk(tokens, text, t, logprobs, *((self.prompt_logprobs, self.prompt_text, self.prompt_tokens) if first
                                                  else (None, None, None)))

    def finish(self, msg: Done) -> list[Chunk | Completion]:
        """The request's end: the text the stream held back, if any (a character still partial at
        the last round: the final decode gives it out, as U+FFFD), then the ``Completion``, so
        that a stream's pieces always add up to its text."""
        rest = msg.text[self.seen_text:]
        chunk = self.chunk(Tokens(msg.req_id, [], rest, len(msg.token_ids), self.seen_text)) if rest else None
        return [chunk, self.done(msg)] if chunk is not None else [self.done(msg)]

    def done(self, msg: Done) -> Completion:
        latency = time.monotonic() - self.t0
        st = msg.stats
        return Completion(msg.text, msg.token_ids, msg.finish_reason, st.get("rounds", 0),
                          st.get("tokens_per_round", []), self.ttft if self.ttft is not None else latency,
                          latency, self.times, st, self.counts, self.logprobs, self.prompt_logprobs, self.prompt_text)
