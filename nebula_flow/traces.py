"""Workload traces: JSONL and the Azure LLM inference CSV, turned into timed requests.

JSONL, one request per line::

    {"arrival_s": 0.5, "prompt": "def f(x):", "max_new_tokens": 64, "temperature": 0.8, "seed": 3}
    {"arrival_s": 1.0, "prompt_tokens": [1, 2, 3], "max_new_tokens": 16}
    {"arrival_s": 1.2, "prompt_len": 300, "max_new_tokens": 16}      # prompt cut from the corpus
    {"arrival_s": 1.3, "prompt_len": 50, "max_new_tokens": 16, "priority": -1}  # (a broker with priority_scheduling)

Azure CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``): arrivals relative to the first row;
prompts of ``ContextTokens`` tokens are cut from a corpus (the Python standard library's
sources, tokenized with the served model's tokenizer), since the trace holds no text.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos", "priority")


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
            req = TraceRequest(float(raw.get("arrival_s", 0.0)), int(raw.get("max_new_tokens", 64)),
                               raw.get("prompt"), raw.get("prompt_tokens"), raw.get("prompt_len"),
                               {k: raw[k] for k in SAMPLING_KEYS if k in raw})
        except (ValueError, TypeError, AttributeError) as exc:
            raise TraceError(f"{path}:{n}: {exc}") from None
        if sum(x is not None for x in (req.prompt, req.prompt_tokens, req.prompt_len)) != 1:
            raise TraceError(f"{path}:{n}: give exactly one of prompt, prompt_tokens, prompt_len")
        out.append(req)
    return out


def _load_csv(path: Path) -> list[TraceRequest]:
    out, t0 = [], None
    with path.open() as f:
        for n, row in enumerate(csv.DictReader(f), 2):
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                t0 = t0 or ts
                out.append(TraceRequest((ts - t0).total_seconds(), int(row["GeneratedTokens"]),
                                        prompt_len=int(row["ContextTokens"])))
            except (KeyError, ValueError) as exc:
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
    window = [r for r in reqs if r.arrival_s >= s.start_s and (s.end_s is None or r.arrival_s <= s.end_s)]
    window = window[: s.limit] if s.limit else window
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

    def take(self, n: int) -> list[int]:
        if n >= len(self.ids):
            return (self.ids * (n // len(self.ids) + 1))[:n]
        start = self.rng.randrange(0, len(self.ids) - n)
        return self.ids[start:start + n]
