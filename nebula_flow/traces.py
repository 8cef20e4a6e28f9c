"""Workload traces: JSONL and the Azure LLM inference CSV, turned into timed requests.

JSONL, one request per line::

    {"arrival_s": 0.5, "prompt": "def f(x):", "max_new_tokens": 64, "temperature": 0.8, "seed": 3}
    {"arrival_s": 1.0, "prompt_tokens": [1, 2, 3], "max_new_tokens": 16}
    {"arrival_s": 1.2, "prompt_len": 300, "max_new_tokens": 16}      # prompt cut from the corpus
    {"arrival_s": 1.3, "prompt_len": 50, "max_new_tokens": 16, "priority": -1}  # (a broker with priority_scheduling)

Every line is checked before a request is sent: a field not named here (OpenAI's ``max_tokens``,
a typo) or a value the broker would refuse is a ``TraceError`` naming the line.

Azure CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``): arrivals relative to the first row;
prompts of ``ContextTokens`` tokens are cut from a corpus (the Python standard library's
sources, tokenized with the served model's tokenizer), since the trace holds no text.

Mooncake's JSONL (the traces of Kimi's serving, FAST '25; ``timestamp`` in milliseconds)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

It holds no text either, but says which prompts share a start: each hash id stands for a block of
``HASH_BLOCK`` tokens, and requests whose ``hash_ids`` begin alike begin with the same tokens. A
prompt is its blocks' tokens (each id a stretch of the corpus of its own, the same for every
request that names it), cut to ``input_length``: the prefix cache and placement by prefix see the
sharing the trace records.
"""

from __future__ import annotations

import csv
import difflib
import json
import math
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from nebula_flow.params import SamplingParams, is_int

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos", "priority")
LINE_KEYS = frozenset({"arrival_s", "prompt", "prompt_tokens", "prompt_len", "max_new_tokens", *SAMPLING_KEYS})
HASH_BLOCK = 512  # tokens a Mooncake trace's hash id stands for


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the line."""


@dataclass
class TraceRequest:
    arrival_s: float
    max_new_tokens: int
    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    prompt_len: int | None = None  # synthesize a prompt of this many tokens
    params: dict[str, Any] = field(default_factory=dict)
    blocks: list[int] | None = None  # with prompt_len: its prompt is these blocks' tokens (Mooncake's hash_ids)


def load_trace(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace not found: {path}")
    reqs = _load_csv(path) if path.suffix.lower() == ".csv" else _load_jsonl(path)
    if not reqs:
        raise TraceError(f"{path}: no requests")
    return sorted(reqs, key=lambda r: r.arrival_s)


def _load_jsonl(path: Path) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict):
                raise ValueError(f"a line must be a JSON object, got {type(raw).__name__}")
            out.append(_mooncake(raw) if "hash_ids" in raw else _request(raw))
        except (ValueError, TypeError) as exc:  # (InvalidParams is a ValueError)
            raise TraceError(f"{path}:{n}: {exc}") from None
    return out


def _request(raw: dict[str, Any]) -> TraceRequest:
    """A line of our own format, checked whole before anything is sent: a line the broker would refuse
    (or a name it does not know, such as OpenAI's ``max_tokens``) stops the replay at its line number."""
    if unknown := sorted(set(raw) - LINE_KEYS):
        hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, LINE_KEYS, 1, 0.6))
                 else repr(k) for k in unknown]
        raise ValueError(f"unknown field {', '.join(hints)}; known: {', '.join(sorted(LINE_KEYS))}")
    arrival = raw.get("arrival_s", 0.0)
    if not _number(arrival) or not 0 <= arrival < math.inf:
        raise ValueError(f"arrival_s must be a number of seconds >= 0, got {arrival!r}")
    req = TraceRequest(float(arrival), raw.get("max_new_tokens", 64), raw.get("prompt"), raw.get("prompt_tokens"),
                       raw.get("prompt_len"), {k: raw[k] for k in SAMPLING_KEYS if k in raw})
    if sum(x is not None for x in (req.prompt, req.prompt_tokens, req.prompt_len)) != 1:
        raise ValueError("give exactly one of prompt, prompt_tokens, prompt_len")
    if req.prompt is not None and (not isinstance(req.prompt, str) or not req.prompt):
        raise ValueError(f"prompt must be a non-empty string, got {req.prompt!r:.60}")
    if req.prompt_tokens is not None and (not isinstance(req.prompt_tokens, list) or not req.prompt_tokens or not all(
            _count(t, 0) for t in req.prompt_tokens)):
        raise ValueError("prompt_tokens must be a non-empty list of token ids (integers >= 0)")
    if req.prompt_len is not None and not _count(req.prompt_len, 1):
        raise ValueError(f"prompt_len must be an integer >= 1, got {req.prompt_len!r}")
    SamplingParams.from_wire(dict(req.params, max_new_tokens=req.max_new_tokens), grammar=False)
    return req


def _number(v: Any) -> bool:  # noqa: ANN401
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: Any, least: int) -> bool:  # noqa: ANN401
    return is_int(v) and v >= least


def _mooncake(raw: dict[str, Any]) -> TraceRequest:
    """A line of Mooncake's format: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    if missing := [k for k in ("timestamp", "input_length", "output_length") if k not in raw]:
        raise ValueError(f"a line with hash_ids (Mooncake's format) needs {', '.join(missing)} too")
    blocks, length = raw["hash_ids"], raw["input_length"]
    if not isinstance(blocks, list) or not blocks or not all(is_int(b) for b in blocks):
        raise ValueError("hash_ids must be a non-empty list of integers")
    if not _count(length, 1) or length > len(blocks) * HASH_BLOCK:
        raise ValueError(f"input_length must be from 1 to {HASH_BLOCK} x len(hash_ids), got {length!r}")
    stamp, output = raw["timestamp"], raw["output_length"]
    if not _number(stamp) or not 0 <= stamp < math.inf:
        raise ValueError(f"timestamp must be a number of milliseconds >= 0, got {stamp!r}")
    if not _count(output, 0):
        raise ValueError(f"output_length must be an integer >= 0, got {output!r}")
    return TraceRequest(stamp / 1000, output, prompt_len=length, blocks=blocks)


def _load_csv(path: Path) -> list[TraceRequest]:
    out, t0 = [], None
    with path.open() as f:
        for n, row in enumerate(csv.DictReader(f), 2):
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                t0 = t0 or ts
                prompt_len, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                if prompt_len < 1 or output < 0:
                    raise ValueError(f"ContextTokens {prompt_len} (must be >= 1), GeneratedTokens {output} (>= 0)")
                out.append(TraceRequest((ts - t0).total_seconds(), output, prompt_len=prompt_len))
            except (KeyError, ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{n}: expected TIMESTAMP,ContextTokens,GeneratedTokens ({exc})") from None
    return out


@dataclass
class Shaping:
    """How a trace is fitted to a deployment; ``report`` says what was changed."""

    time_scale: float = 1.0  # arrival times are divided by this (2 = twice as fast)
    limit: int | None = None
    start_s: float = 0.0
    end_s: float | None = None
    poisson_rate: float | None = None  # replace arrivals with a Poisson process of this rate
    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    seed: int = 0


def shape(reqs: list[TraceRequest], s: Shaping, context: int) -> tuple[list[TraceRequest], dict[str, Any]]:
    if s.time_scale <= 0:
        raise TraceError("time scale must be > 0")
    first = reqs[0].arrival_s if reqs else 0.0  # (the window is from the trace's first request, as its options say)
    window = [r for r in reqs if r.arrival_s - first >= s.start_s and (s.end_s is None or r.arrival_s - first <= s.end_s)]
    window = window[: s.limit] if s.limit else window
    if not window:
        raise TraceError(f"no request of the trace's {len(reqs)} arrives from {s.start_s:g} s to "
                         f"{'the end' if s.end_s is None else f'{s.end_s:g} s'} after its first")
    report = {"requests": len(window), "clipped_prompts": 0, "clipped_outputs": 0, "time_scale": s.time_scale}
    rng = random.Random(s.seed)
    t = 0.0
    base = window[0].arrival_s if window else 0.0
    for r in window:
        if s.poisson_rate:
            t += rng.expovariate(s.poisson_rate)
            r.arrival_s = t
        else:
            r.arrival_s = (r.arrival_s - base) / s.time_scale
        if s.max_new_tokens and r.max_new_tokens > s.max_new_tokens:
            r.max_new_tokens = s.max_new_tokens
            report["clipped_outputs"] += 1
        r.max_new_tokens = max(1, r.max_new_tokens)
        limit = min(context - r.max_new_tokens, s.max_prompt_tokens or context)
        if r.prompt_len is not None and r.prompt_len > limit:
            r.prompt_len = max(1, limit)
            report["clipped_prompts"] += 1
        if r.prompt_tokens is not None and len(r.prompt_tokens) > limit:
            r.prompt_tokens = r.prompt_tokens[-max(1, limit):]
            report["clipped_prompts"] += 1
    return window, report


class PromptSource:
    """Cuts prompts of a given token length from a corpus, deterministically."""

    def __init__(self, tokenizer_dir: str, seed: int = 0, corpus_tokens: int = 200_000) -> None:
        from nebula_flow.corpus import corpus_files
        from nebula_flow.tokenizer import TextCodec

        codec = TextCodec(tokenizer_dir)
        files = corpus_files(None)
        random.Random(seed).shuffle(files)
        ids: list[int] = []
        for f in files:
            ids.extend(codec.encode(f.read_text(errors="replace")))
            if len(ids) >= corpus_tokens:
                break
        self.ids, self.rng = ids, random.Random(seed)

    def blocks(self, ids: list[int], n: int) -> list[int]:
        """The first ``n`` tokens of blocks ``ids``, each ``HASH_BLOCK`` tokens of the corpus that depend
        on its id alone (a Mooncake trace's prompt: requests naming the same blocks share them)."""
        corpus = self.ids if len(self.ids) >= HASH_BLOCK else self.ids * (HASH_BLOCK // len(self.ids) + 1)
        out: list[int] = []
        for block in ids[:-(-n // HASH_BLOCK)]:
            start = random.Random(f"block {block}").randrange(0, len(corpus) - HASH_BLOCK + 1)
            out.extend(corpus[start:start + HASH_BLOCK])
        return out[:n]

    def take(self, n: int) -> list[int]:
        if n >= len(self.ids):
            return (self.ids * (n // len(self.ids) + 1))[:n]
        start = self.rng.randrange(0, len(self.ids) - n)
        return self.ids[start:start + n]
