"""OpenAI's response objects from the client's chunks and completion (pure).

Beside OpenAI's fields, a finished response carries ``speculative``: the request's rounds, the
tokens each round committed and their mean, and its draft tokens proposed and accepted.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from nebula_flow.api import reasoning
from nebula_flow.api.tools import CallStream, ToolCalling
from nebula_flow.client import Chunk, Completion

FINISH_REASONS = ("stop", "length")


def finish_reason(out: Completion) -> str:
    return out.finish_reason if out.finish_reason in FINISH_REASONS else "stop"


def usage(outs: list[Completion], n: int = 1) -> dict[str, Any]:
    """The answer's usage: each prompt counted once (``n`` choices each), with how many of its
    tokens a worker's prefix cache held (``cached_tokens``, as OpenAI's prompt caching), every choice's output;
    with a prediction (Predicted Outputs), how many of its tokens the answers held, in order
    (``lookup.matched``), and how many they did not."""
    prompt = sum(int(out.stats.get("prompt_tokens", 0)) for out in outs[::n])
    completion = sum(len(out.token_ids) for out in outs)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                           # (positions a worker copied from other requests' KV: the prefix cache)
                           "prompt_tokens_details": {"cached_tokens": sum(int(o.stats.get("cached_tokens", 0))
                                                                          for o in outs[::n])}}
    predicted = [(int(o.stats["prediction_tokens"]), int(o.stats.get("prediction_accepted", 0)))
                 for o in outs if "prediction_tokens" in o.stats]
    if predicted:
        accepted = sum(min(given, took) for given, took in predicted)
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": sum(given for given, _ in predicted) - accepted}
    return out


def speculative(outs: list[Completion]) -> dict[str, Any]:
    """The answer's rounds (every choice's, in the order of their indexes) and draft tokens."""
    rounds = sum(out.rounds for out in outs)
    tokens = sum(len(out.token_ids) for out in outs)
    return {"rounds": rounds, "tokens_per_round": [n for out in outs for n in out.tokens_per_round],
            "mean_tokens_per_round": round(tokens / rounds if rounds else 0.0, 4),
            "draft_tokens_proposed": sum(out.stats.get("proposed", 0) for out in outs),
            "draft_tokens_accepted": sum(out.stats.get("accepted", 0) for out in outs)}


class Shaper:
    """Builds one answer's objects: ``chat`` (``chat.completion``) or text (``text_completion``),
    of one choice or several (``n`` for each prompt; a choice's ``index`` is its place)."""

    def __init__(self, req_id: str, model: str, chat: bool, token_ids: bool = False, n: int = 1,
                 calls: ToolCalling | None = None, reasoning: str | None = None,
                 echoes: list[str | None] | None = None, tops: tuple[int | None, int | None] = (None, None)) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + req_id
        self.reasoning = reasoning  # chat: the reasoning parser, thinking apart from the answer (``api/reasoning.py``)
        self.calls = calls  # chat with tools (not "none"): the output's calls become tool calls (``api/tools.py``)
        self.model, self.chat, self.created, self.n = model, chat, int(time.time()), n
        self.token_ids = token_ids  # (the return_token_ids extension)
        self.object = "chat.completion" if chat else "text_completion"
        self.text_offsets: dict[int, int] = {}  # completions' logprobs: each choice's characters so far
        # completions' echo: each choice's prompt, as given (None: token ids, as the broker decoded them)
        self.echoes = echoes
        # the top tokens each prompt token's entry shows: echo's (``logprobs``) and vLLM's ``prompt_logprobs``
        # (the broker reports as many as the larger asks)
        self.echo_top, self.prompt_top = tops
        self.tokens_as_ids = False  # (vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N")
        self.chat_echo: str | None = None  # (chat's echo: the final assistant message, before each answer)
        # vLLM's continuous_usage_stats: each choice's prompt tokens (None: not asked) and its tokens so far
        self.prompt_counts: list[int] | None = None
        self.made: list[int] = []

    def logprobs(self, entries: list | None, index: int) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of a choice (or of a streamed chunk of it) from the broker's entries
        (``protocol.Tokens.logprobs``: [id, text, logprob, [[id, text, logprob], ...]] per token)."""
        if entries is None:
            return None
        if self.tokens_as_ids:
            entries = [[e[0], f"token_id:{e[0]}", e[2], [[t[0], f"token_id:{t[0]}", t[2]] for t in e[3]]] for e in entries]
        if self.chat:
            return {"content": [{**_token(e), "top_logprobs": [_token(t) for t in e[3]]} for e in entries]}
        offsets, at = [], self.text_offsets.get(index, 0)
        for e in entries:
            offsets.append(at)
            at += len(e[1])
        self.text_offsets[index] = at
        return {"tokens": [e[1] for e in entries], "token_logprobs": [e[2] for e in entries],
                "top_logprobs": [{t[1]: t[2] for t in e[3]} if e[2] is not None else None for e in entries],
                "text_offset": offsets}  # (an echoed prompt's first token: no logprob, no top tokens, as OpenAI's)

    def echo(self, index: int, item: Chunk | Completion) -> tuple[str, list | None] | None:
        """With echo, choice ``index``'s prompt: its text and its tokens' logprob entries (None: not
        asked), from the choice's first chunk or its completion."""
        if self.echoes is None:
            return None
        given, entries = self.echoes[index], item.prompt_logprobs
        if entries is not None and self.echo_top is not None:
            entries = [[*e[:3], e[3][:self.echo_top]] for e in entries]
        return (given if given is not None else item.prompt_text or ""), entries

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, out: Completion) -> dict[str, Any]:
        prompt, scored = self.echo(index, out) or ("", None)
        logprobs = self.logprobs(out.logprobs if scored is None else scored + (out.logprobs or []), index)
        thinking, _ = self.answer(out)
        content, called = self.tool_calls(out)
        if self.chat_echo:
            content = self.chat_echo + (content or "")
        if self.chat:
            message = {"role": "assistant", "content": content, **({"tool_calls": called} if called is not None else {}),
                       **({"reasoning_content": thinking} if self.reasoning is not None else {})}
            choice = {"index": index, "message": message, "logprobs": logprobs,
                      "finish_reason": self.calls.finish_reason if called is not None else finish_reason(out)}
        else:
            choice = {"index": index, "text": prompt + out.text, "logprobs": logprobs, "finish_reason": finish_reason(out)}
        if self.token_ids:
            choice["token_ids"] = out.token_ids
        if self.prompt_top is not None and not self.chat:
            choice["prompt_logprobs"] = self.ranked(out.prompt_logprobs)
        return choice

    def full(self, outs: list[Completion]) -> dict[str, Any]:
        """The non-streamed answer: every choice, in order (chat: the prompt's logprobs beside them, as vLLM's)."""
        prompt = {"prompt_logprobs": self.ranked(outs[0].prompt_logprobs)} if self.prompt_top is not None and self.chat \
            else {}
        return {**self._head(self.object), "choices": [self._choice(i, out) for i, out in enumerate(outs)],
                "usage": usage(outs, self.n), "speculative": speculative(outs), **prompt}

    def ranked(self, entries: list | None) -> list | None:
        """vLLM's ``prompt_logprobs``: null for the first token, then per token, by token id, its own
        and the top tokens' ``logprob``, ``rank`` (1: the most likely; the prompt token's as the worker
        counted it, among the top ones or not) and ``decoded_token``."""
        if entries is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for token, text, logprob, top, rank in entries[1:]:
            ranked = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": text}}
            for r, (tid, t_text, value) in enumerate(top[:self.prompt_top], 1):
                ranked.setdefault(str(tid), {"logprob": value, "rank": r, "decoded_token": t_text})
            out.append(ranked)
        return out

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False,
              token_ids: list[int] | None = None, index: int = 0, logprobs: list | None = None,
              kind: str = "content") -> dict[str, Any]:
        """One streamed event of choice ``index``: ``text`` (a delta of the answer, or ``kind``
        ``reasoning``: of the thinking), its ``token_ids`` and ``logprobs`` (the broker's entries),
        and at the end the finish ``reason``."""
        shaped = self.logprobs(logprobs, index)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None and not role:
                delta["reasoning_content" if kind == "reasoning" else "content"] = text
            choice = {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": shaped, "finish_reason": reason}
        if self.token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return self._counted({**self._head("chat.completion.chunk" if self.chat else self.object), "choices": [choice]},
                             index)

    def _counted(self, event: dict[str, Any], index: int) -> dict[str, Any]:
        """A streamed event, with its choice's usage so far where every event carries it (vLLM's
        ``continuous_usage_stats``)."""
        if self.prompt_counts is not None:
            prompt, made = self.prompt_counts[index], self.made[index]
            event["usage"] = {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}
        return event

    def answer(self, out: Completion) -> tuple[str | None, str]:
        """A finished output's thinking (None: none, or no reasoning parser) and its answer."""
        if self.reasoning is None:
            return None, out.text
        thinking, answer = reasoning.split(out.text, self.reasoning)
        return thinking, answer or ""

    def tool_calls(self, out: Completion) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A finished output's content (its answer) and the tool calls it makes, where the request
        has tools (``api/tools.py``); no calls where it was cut short."""
        _, text = self.answer(out)
        if self.calls is None or out.finish_reason == "length":
            return (text or None) if self.reasoning is not None else text, None
        return self.calls.split(text)

    def held(self, out: Completion, index: int, gate: CallStream) -> dict[str, Any] | None:
        """A stream's event of what a choice's chunks held back (``gate``: what of its answer went
        out): the rest of its tool calls, or the rest of its answer (none for a named function,
        whose arguments went out as they came, or where calls went out that the finished output
        turns out not to make)."""
        if gate.forced is not None:
            return None
        _, called = self.tool_calls(out)
        if called is None:
            rest = self.answer(out)[1][gate.sent:]
            return self.chunk(rest, index=index) if rest and not gate.streamed else None
        return self.call_chunk(index, deltas) if (deltas := gate.rest(called)) else None

    def call_chunk(self, index: int, calls: list[dict[str, Any]], logprobs: list | None = None,
                   token_ids: list[int] | None = None) -> dict[str, Any]:
        """A chat stream's event of tool-call deltas for choice ``index``."""
        choice = {"index": index, "delta": {"tool_calls": calls}, "logprobs": self.logprobs(logprobs, index),
                  "finish_reason": None}
        if self.token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return self._counted({**self._head("chat.completion.chunk"), "choices": [choice]}, index)

    def last(self, out: Completion, index: int = 0) -> dict[str, Any]:
        """The event that ends choice ``index``: its finish reason and speculative stats."""
        called = self.tool_calls(out)[1] is not None
        return {**self.chunk(None if self.chat else "", self.calls.finish_reason if called else finish_reason(out),
                             index=index), "speculative": speculative([out])}

    def usage_chunk(self, outs: list[Completion]) -> dict[str, Any]:
        """``stream_options.include_usage``: an event with no choices and the usage."""
        return {**self._head("chat.completion.chunk" if self.chat else self.object), "choices": [],
                "usage": usage(outs, self.n)}


def _token(entry: list) -> dict[str, Any]:
    """A chat logprob's token: its text, log-probability and UTF-8 bytes."""
    return {"token": entry[1], "logprob": entry[2], "bytes": list(entry[1].encode())}


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    return b"data: " + (obj.encode() if isinstance(obj, str) else orjson.dumps(obj)) + b"\n\n"
