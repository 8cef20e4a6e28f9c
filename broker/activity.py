"""The broker's activity line: every ``stats_log_s`` while it serves, one log line of what the last
interval did (as vLLM's and SGLang's engines log their throughput), so that an operator watching a
deployment's log sees it work, or stall, without asking ``status``. Silent while idle."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from nebula_flow.log_relay import ACTIVITY_MARKER
from nebula_flow.roles import WorkerState, unserved

log = logging.getLogger("nebula_flow.broker")

# counters whose change over an interval the line reports (``intake._close``: requests_<finish reason>)
WATCHED = ("tokens_out", "rounds", "requests_length", "requests_stop", "requests_failed", "requests_cancelled")


@dataclass
class ActivityLog:
    every_s: float  # 0: off
    last: float  # when the last interval began
    mode: str  # the deployment's (which stages its rounds need: ``roles.unserved``)
    seen: dict[str, int] = field(default_factory=dict)  # the counters then
    seen_errors: dict[str, int] = field(default_factory=dict)  # the errors by code then

    def line(self, now: float, counters: Mapping[str, int], errors: Mapping[str, int], pool: int,
             topics: Mapping[str, int], workers: Collection[WorkerState]) -> str | None:
        """The line for the interval that ends at ``now``, when one is due and anything happened (or
        requests wait in the pool); None otherwise. It says so where no registered worker takes a
        stage the requests need (they wait: the HTTP API's /health answers 503 meanwhile)."""
        if self.every_s <= 0 or now - self.last < self.every_s:
            return None
        now_seen = {name: counters.get(name, 0) for name in WATCHED}
        delta = {name: value - self.seen.get(name, 0) for name, value in now_seen.items()}
        # (refused messages by code: a client's request refused, or a worker's message after a broker restart)
        refused = Counter({code: n - self.seen_errors.get(code, 0) for code, n in errors.items()}) - Counter()
        span, self.last, self.seen, self.seen_errors = now - self.last, now, now_seen, dict(errors)
        if not any(delta.values()) and not refused and not pool:
            return None
        per_round = f"{delta['tokens_out'] / delta['rounds']:.2f}" if delta["rounds"] else "-"
        ended = [f"{delta['requests_length'] + delta['requests_stop']} finished"] + [
            f"{delta[key]} {word}" for key, word in (("requests_cancelled", "cancelled"), ("requests_failed", "failed"))
            if delta[key]]
        queued = ", ".join(f"{topic} {depth}" for topic, depth in topics.items() if depth) or "none"
        errors_text = ", ".join(f"{code} {n}" for code, n in refused.most_common(4))
        return (f"last {span:.0f} s: {delta['tokens_out'] / span:.1f} tokens/s out, {per_round} tokens/round, "
                f"requests {', '.join(ended)}; {pool} in the pool, tasks queued: {queued}; {len(workers)} worker{'' if len(workers) == 1 else 's'}"
                + (f"; errors: {errors_text}" if errors_text else "")
                + (f"; NOT SERVING: {why}" if (why := unserved(self.mode, [(w.role, w.slot) for w in workers])) else ""))

    def log(self, now: float, counters: Mapping[str, int], errors: Mapping[str, int], pool: int,
            topics: Mapping[str, int], workers: Collection[WorkerState]) -> None:
        if text := self.line(now, counters, errors, pool, topics, workers):
            log.info("%s%s", ACTIVITY_MARKER, text)

    @staticmethod
    def draining(now: float, in_flight: int, drain_s: float) -> float:
        """Say that stopping began (whatever ``every_s``: serve relays it); returns ``now``."""
        log.info("%sdraining: new requests are refused; %d in flight may finish within %g s", ACTIVITY_MARKER,
                 in_flight, drain_s)
        return now

    @staticmethod
    def stopped(cut_off: int, drain_s: float) -> None:
        """Say how the drain ended: every request in flight finished, or ``cut_off`` did not in time."""
        log.info("%sstopped: %s", ACTIVITY_MARKER, f"{cut_off} in flight did not finish within drain_s {drain_s:g} s "
                 "(each fails with shutting_down)" if cut_off else "every request in flight finished")
