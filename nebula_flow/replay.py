"""Open-loop trace replay through the client library: timed arrivals, per-request records,
a summary, and plots.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nebula_flow.client import AsyncClient, Completion, NebulaError
from nebula_flow.stats import percentiles
from nebula_flow.traces import PromptSource, TraceRequest


@dataclass
class Record:
    """One replayed request, as written to the JSONL output."""

    index: int
    arrival_s: float  # scheduled, relative to the replay start
    sent_s: float = 0.0
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    tokens: int = 0
    rounds: int = 0
    tokens_per_round: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    priority: int = 0  # the trace's (a broker with priority_scheduling orders rounds by it)
    cached_tokens: int = 0  # of its prompt's, copied or pulled from other requests' KV (the prefix cache)


class Progress:
    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled, self.done, self.errors, self.inflight, self.tokens = total, enabled, 0, 0, 0, 0
        self.t0 = time.monotonic()

    def show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
                         f"{self.inflight} in flight, {self.errors} errors, {self.tokens / max(elapsed, 1e-9):.1f} tokens/s  ")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def replay(address: str, reqs: list[TraceRequest], prompts: PromptSource | None, concurrency: int | None = None,
                 progress: bool = True, timeout_s: float = 600.0, api: str | None = None,
                 api_key: str | None = None) -> tuple[list[Record], float]:
    """Send every request at its arrival time (open loop, optionally capped in concurrency), to the
    broker through the client library, or through the HTTP API at ``api``."""
    from nebula_flow.api.http_client import HttpClient

    cap = asyncio.Semaphore(concurrency) if concurrency else None
    bar = Progress(len(reqs), progress)
    records = [Record(i, r.arrival_s, max_new_tokens=r.max_new_tokens, priority=r.params.get("priority", 0))
               for i, r in enumerate(reqs)]
    t0 = time.monotonic()

    async with HttpClient(api, api_key, timeout_s) if api else AsyncClient(address, timeout_s=timeout_s) as client:
        async def one(rec: Record, req: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - t0)))
            if cap is not None:
                await cap.acquire()
            rec.sent_s = time.monotonic() - t0
            kwargs: dict[str, Any] = dict(req.params, max_new_tokens=req.max_new_tokens)
            if req.prompt is not None:
                kwargs["prompt"] = req.prompt
            else:
                kwargs["token_ids"] = req.prompt_tokens if req.prompt_tokens is not None else \
                    prompts.blocks(req.blocks, req.prompt_len) if req.blocks else prompts.take(req.prompt_len)
                rec.prompt_tokens = len(kwargs["token_ids"])
            bar.inflight += 1
            try:
                async for item in client.stream(**kwargs):
                    if isinstance(item, Completion):
                        rec.ttft_s, rec.latency_s = item.ttft_s, item.latency_s
                        rec.chunk_times_s = [round(t, 6) for t in item.chunk_times_s]
                        rec.tokens, rec.rounds = len(item.token_ids), item.rounds
                        rec.tokens_per_round, rec.finish_reason = item.tokens_per_round, item.finish_reason
                        rec.prompt_tokens = rec.prompt_tokens or item.stats.get("prompt_tokens", 0)
                        rec.cached_tokens = int(item.stats.get("cached_tokens", 0))
                    else:
                        bar.tokens += len(item.token_ids)
            except (NebulaError, ValueError) as exc:
                rec.error = str(exc)
                bar.errors += 1
            finally:
                bar.inflight -= 1
                bar.done += 1
                bar.show()
                if cap is not None:
                    cap.release()

        await asyncio.gather(*(one(rec, req) for rec, req in zip(records, reqs)))
    bar.show(final=True)
    return records, time.monotonic() - t0


def summarize(records: list[Record], wall_s: float, report: dict[str, Any] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.latency_s is not None]
    tokens = sum(r.tokens for r in ok)
    rounds = sum(r.rounds for r in ok)
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok), "wall_s": wall_s,
        "tokens": tokens, "tokens_per_s": tokens / max(wall_s, 1e-9), "requests_per_s": len(ok) / max(wall_s, 1e-9),
        "round_rate": rounds / max(wall_s, 1e-9), "tokens_per_round": tokens / max(rounds, 1),
        "ttft_s": percentiles([r.ttft_s for r in ok]), "inter_chunk_s": percentiles(gaps),
        "prompt_cached": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "latency_s": percentiles([r.latency_s for r in ok]), "shaping": report or {},
        # (a trace of several priorities: each one's completed requests apart, most urgent first)
        **({"by_priority": {str(p): {"completed": len(group), "ttft_s": percentiles([r.ttft_s for r in group]),
                                     "latency_s": percentiles([r.latency_s for r in group])}
                            for p in sorted({r.priority for r in records})
                            for group in [[r for r in ok if r.priority == p]]}}
           if len({r.priority for r in records}) > 1 else {}),
    }


def write_outputs(out: Path, records: list[Record], summary: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "requests.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return plot(out, records)


def plot(out: Path, records: list[Record]) -> list[Path]:
    """Latency CDF, throughput over time, histogram of tokens committed per round (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.error is None and r.latency_s is not None]
    lat = sorted(r.latency_s for r in ok)
    tokens_at: dict[int, int] = {}
    for r in ok:
        for t, n in zip(r.chunk_times_s, r.tokens_per_round):
            tokens_at[int(r.sent_s + t)] = tokens_at.get(int(r.sent_s + t), 0) + n
    secs = list(range(max(tokens_at) + 1)) if tokens_at else []
    per_round = [n for r in ok for n in r.tokens_per_round]

    def figure(name: str, draw, xlabel: str, ylabel: str, title: str) -> Path:  # noqa: ANN001
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        fig.savefig(out / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return out / name

    return [
        figure("latency_cdf.png", lambda ax: ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))]),
               "latency (s)", "fraction of requests", "Latency CDF"),
        figure("throughput.png", lambda ax: ax.plot(secs, [tokens_at.get(x, 0) for x in secs]),
               "time (s)", "tokens/s", "Throughput over time"),
        figure("acceptance.png", lambda ax: per_round and ax.hist(
            per_round, bins=range(1, max(per_round) + 2), align="left", rwidth=0.8),
               "tokens committed per round", "rounds", "Acceptance"),
    ]
