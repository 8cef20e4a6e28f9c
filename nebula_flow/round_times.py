"""Where a request-round's time goes, as the broker sees it: ``status``'s ``round_times``.

A round runs from the end of the request's previous round (its admission, for the first) to
the end of its verify. Along that path the broker marks when each task is sent and when its
result comes back and has been handled; the worker says how it spent the time between the
task's arrival and its result's departure (``protocol.Result.timing``). The parts:

- ``queue``: a task ready but not yet sent (waiting for a worker to pull, or for the broker's
  loop to reach dispatch);
- ``hop``: a task's trip to a worker and its result's trip back, encoding and sockets included
  (the span the broker saw, less the worker's own span);
- ``broker``: handling a result (decoding, checking, the policy's end of round, streaming);
- ``worker_decode``, ``worker_queue`` (a batch behind the one computing), ``kv`` (waiting for
  pulled KV), ``draft_forward``, ``verify_forward`` (the forward passes; emulated devices' sleep),
  ``worker_python`` (the compute thread's other work: cache preparation, sampling, trees),
  ``worker_handoff`` (a finished batch's RESULT being encoded and sent);
- ``other``: what none of these covers.

A request's first round carries its prompt's prefill and is summed apart (``first``).
Times are sums over rounds; ``nebula-flow bench --breakdown`` divides them by the rounds run.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import add
from typing import Any

from nebula_flow.wire import malformed


@dataclass
class Timing:
    """How a worker spent one batch, in seconds, from its TASKS' arrival (``span_s`` in all) to
    its RESULT's departure: decoding the tasks, waiting behind the batch computing, waiting for
    pulled KV, draft and verify forward passes, the compute thread's other work, and the finished
    batch waiting to be sent. The broker's ``round_times`` adds them to each round the batch ran."""

    span_s: float = 0.0
    decode_s: float = 0.0
    queue_s: float = 0.0
    kv_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    python_s: float = 0.0
    handoff_s: float = 0.0

    def check(self) -> None:
        if min(vars(self).values()) < 0:
            raise malformed("timing parts must be >= 0")


# The worker's parts (``protocol.Timing`` fields, less ``span_s``) as named in the breakdown.
WORKER_PARTS = {"decode_s": "worker_decode", "queue_s": "worker_queue", "kv_s": "kv", "draft_s": "draft_forward",
                "verify_s": "verify_forward", "python_s": "worker_python", "handoff_s": "worker_handoff"}
PARTS = ("queue", "hop", "broker", *WORKER_PARTS.values(), "other")


# Each part's slot in a round's list of seconds (``_Round.parts``): plain list slots, because the
# broker marks several parts of every request-round (a Counter per round cost it ~10 us a round).
SLOT = {part: i for i, part in enumerate((*PARTS, "total"))}
WORKER_SLOTS = tuple((key, SLOT[part]) for key, part in WORKER_PARTS.items())
QUEUE, HOP, BROKER, OTHER, TOTAL = (SLOT[p] for p in ("queue", "hop", "broker", "other", "total"))
ZEROS = (0.0,) * len(SLOT)


class _Round:
    __slots__ = ("started", "last", "sent", "parts", "first")

    def __init__(self, started: float, first: bool = True) -> None:
        self.started = self.last = started  # (last: the latest mark on this round's path)
        self.sent = 0.0
        self.parts = [0.0] * len(SLOT)
        self.first = first


class RoundTimes:
    """Sums of each part of the rounds ended so far (``first``: rounds that carried a prefill)."""

    def __init__(self) -> None:
        self.open: dict[int, _Round] = {}
        self.sums = {"first": [0.0] * len(SLOT), "rounds": [0.0] * len(SLOT)}
        self.counts = {"first": 0, "rounds": 0}
        self.tokens = {"first": 0, "rounds": 0}
        self.waited: dict[int, float] = {}  # request -> seconds from its admission to its first task sent

    def admitted(self, rid: int, t: float) -> None:
        self.open[rid] = _Round(t)

    def sent(self, rid: int, t: float) -> None:
        r = self.open.get(rid)
        if r is not None:
            if r.first:
                self.waited.setdefault(rid, t - r.started)
            r.parts[QUEUE] += t - r.last
            r.last = r.sent = t

    def returned(self, rid: int, t: float, timing: Timing | None) -> None:
        """A result for ``rid`` arrived at ``t``; ``timing``: the worker's account of its span."""
        r = self.open.get(rid)
        if r is None:
            return
        parts = r.parts
        if timing is not None:
            for key, slot in WORKER_SLOTS:
                parts[slot] += getattr(timing, key)
        parts[HOP] += max(0.0, t - r.sent - (timing.span_s if timing is not None else 0.0))
        r.last = t

    def handled(self, rid: int, t: float) -> None:
        r = self.open.get(rid)
        if r is not None:
            r.parts[BROKER] += t - r.last
            r.last = t

    def ended(self, rid: int, t: float, tokens: int) -> None:
        """The round's verify is handled (``tokens`` committed): add its parts to the sums and
        start the next round."""
        r = self.open.get(rid)
        if r is None:
            return
        self.handled(rid, t)
        key = "first" if r.first else "rounds"
        parts = r.parts
        parts[OTHER] += max(0.0, (t - r.started) - sum(parts))
        parts[TOTAL] = t - r.started
        sums = self.sums[key]
        sums[:] = map(add, sums, parts)
        self.counts[key] += 1
        self.tokens[key] += tokens
        # the next round starts now, in the same record (zeroed in place: no new objects a round)
        r.started = r.last = t
        r.sent, r.first = 0.0, False
        parts[:] = ZEROS

    def closed(self, rid: int) -> float:
        """A request left: forget it; returns its queue time (admission to its first task sent)."""
        self.open.pop(rid, None)
        return self.waited.pop(rid, 0.0)

    def state(self) -> dict[str, Any]:
        return {key: {"rounds": self.counts[key], "tokens": self.tokens[key],
                      "seconds": {p: self.sums[key][i] for p, i in SLOT.items()}}
                for key in ("first", "rounds")}


def summary(rounds: float, per_round_s: dict[str, float], per_token_s: float) -> dict[str, Any]:
    """A breakdown: rounds, each part's seconds per round (with ``total``), each part's share of
    the round, and the rounds' time per token committed."""
    total = per_round_s.get("total", 0.0)
    return {"rounds": rounds, "per_round_s": per_round_s, "per_token_s": per_token_s,
            "share": {p: v / total for p, v in per_round_s.items() if p != "total"} if total > 0 else {}}


def breakdown(before: dict[str, Any], after: dict[str, Any], key: str = "rounds") -> dict[str, Any]:
    """Per round, in seconds, between two ``status`` states' ``round_times``: each part's mean
    and share of the round, and the rounds' time per token committed, over the rounds ended in
    between."""
    b, a = before.get("round_times", {}).get(key), after.get("round_times", {}).get(key)
    if a is None or a["rounds"] == (b["rounds"] if b else 0):
        return summary(0, {}, 0.0)
    n = a["rounds"] - (b["rounds"] if b else 0)
    tokens = a["tokens"] - (b["tokens"] if b else 0)
    secs = {p: a["seconds"][p] - (b["seconds"][p] if b else 0.0) for p in a["seconds"]}
    return summary(n, {p: s / n for p, s in secs.items()}, secs["total"] / tokens if tokens else 0.0)
