"""The broker's counters and the state ``nebula-flow status`` shows (and /metrics renders)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from nebula_flow.scheduler import Scheduler
from nebula_flow_broker.results import Verified


@dataclass
class WorkerInfo:
    identity: bytes
    role: str
    name: str
    last_seen: float
    kv_endpoint: str | None = None
    busy_s: float = 0.0
    tasks: int = 0
    kv: dict[str, Any] | None = None  # the worker's latest KV counters
    device: dict[str, Any] | None = None  # forwards run; emulated devices: predicted vs overrun seconds
    pid: int | None = None
    restarts: int = 0  # times its deployment started this worker again after a death
    key: str | None = None  # the CURVE public key it registered with (None without keys)
    batches: Counter[str] = field(default_factory=Counter)  # batches sent by stage (an elastic worker's: both)
    model: dict[str, Any] = field(default_factory=dict)  # what it serves, where: from its REGISTER (``served``)


SERVED_FACTS = {"path": str, "device": str, "numerics": str, "vocab_size": int, "max_model_len": int}


def served(facts: dict[str, Any]) -> dict[str, Any]:
    """The model facts a worker registered with that ``status`` shows from the start (before its
    first result brings its ``device`` counters): known keys of the right type, strings cut short."""
    return {key: value[:200] if isinstance(value, str) else value for key, kind in SERVED_FACTS.items()
            if isinstance(value := facts.get(key), kind) and not isinstance(value, bool)}


TREE_COUNTERS = ("alternatives_proposed", "alternatives_contested", "alternatives_accepted", "fused_asked",
                 "fused_chains", "fused_rounds_won", "fused_tokens_accepted")


@dataclass
class BrokerStats:
    # (the token-tree counters start at 0: status shows them whether or not a round used a tree)
    counters: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(TREE_COUNTERS, 0)))
    errors: Counter[str] = field(default_factory=Counter)
    # Each verified round's shape, (draft tokens, of them accepted, tokens committed) -> rounds: one
    # count a round; the per-position and per-round figures status shows are derived from it.
    outcomes: Counter[tuple[int, int, int]] = field(default_factory=Counter)
    drafter_counts: dict[str, Counter[str]] = field(default_factory=dict)  # drafter -> rounds, proposed, accepted
    batch_sizes: dict[str, Counter[int]] = field(default_factory=dict)

    def count_round(self, v: Verified, fuse_asked: bool, drafter: str | None) -> None:
        """Count what one verified round's token tree proposed and won."""
        self.outcomes[len(v.draft), v.draft_accepted, len(v.committed)] += 1
        if v.runner_ups or v.chains or fuse_asked:  # (most rounds are a plain chain: nothing more to count)
            c = self.counters
            c["alternatives_proposed"] += len(v.runner_ups)
            c["alternatives_contested"] += bool(v.runner_ups) and v.draft_accepted == 0  # (where a runner-up could win)
            c["alternatives_accepted"] += v.via_alt
            c["fused_asked"] += fuse_asked
            c["fused_chains"] += len(v.chains)
            c["fused_rounds_won"] += v.fused > 0
            c["fused_tokens_accepted"] += v.fused
        if drafter is not None:
            by = self.drafter_counts.get(drafter)
            if by is None:  # (not setdefault: that makes a Counter every round)
                by = self.drafter_counts[drafter] = Counter()
            by["rounds"] += 1
            by["proposed"] += len(v.draft)
            by["accepted"] += v.draft_accepted

    @property
    def proposed_by_position(self) -> list[int]:
        """Rounds whose draft had a token at each position (1st, 2nd, ...)."""
        return self._by_position(0)

    @property
    def accepted_by_position(self) -> list[int]:
        """Rounds that accepted the draft's token at each position."""
        return self._by_position(1)

    def _by_position(self, part: int) -> list[int]:
        out = [0] * max((drafted for drafted, _, _ in self.outcomes), default=0)  # (both lists as long as the longest draft)
        for outcome, rounds in self.outcomes.items():
            for i in range(outcome[part]):
                out[i] += rounds
        return out

    @property
    def tokens_per_round_hist(self) -> Counter[int]:
        """Rounds by the tokens they committed."""
        hist: Counter[int] = Counter()
        for (_, _, committed), rounds in self.outcomes.items():
            hist[committed] += rounds
        return hist

    def state(self, scheduler: Scheduler, workers: dict[int, WorkerInfo]) -> dict[str, Any]:
        """The parts of the status state that these counters and the policy hold."""
        return {
            "workers": [{"id": wid, "role": w.role, "name": w.name, "drafter": scheduler.workers[wid].drafter,
                         "busy_s": w.busy_s, "tasks": w.tasks, "slot": scheduler.workers[wid].slot,
                         "kv_endpoint": w.kv_endpoint, "kv": w.kv, "device": w.device, "pid": w.pid,
                         "restarts": w.restarts, "batches": dict(w.batches), "model": w.model}
                        for wid, w in workers.items()],
            "counters": dict(self.counters), "errors": dict(self.errors),
            # what adaptive k weighs now: draft step, verify row, round, in target decode steps
            "spec_costs": list(scheduler.costs), "verify_costs": list(scheduler.verify_costs),
            "drafters": self._drafters_state(scheduler),
            "proposed_by_position": self.proposed_by_position, "accepted_by_position": self.accepted_by_position,
            "tokens_per_round_hist": {str(k): v for k, v in self.tokens_per_round_hist.items()},
            "batch_sizes": {r: {str(k): v for k, v in h.items()} for r, h in self.batch_sizes.items()},
            "draft_ahead": scheduler.ahead_stats.to_dict(),  # (pre-drafts: nebula_flow/ahead.py)
            "fusion": scheduler.fusion_stats.to_dict(),  # (second drafts of fused rounds: nebula_flow/fusion.py)
        }

    def _drafters_state(self, s: Scheduler) -> dict[str, dict[str, Any]]:
        """Per drafter: its live workers, rounds drafted, drafts proposed and accepted; with several,
        the pool's recent acceptance of it (greedy, sampled) and the costs routing weighs (draft
        step, verify row, round)."""
        out = {}
        for name in sorted(set(s.drafters) | set(self.drafter_counts)):
            counts = self.drafter_counts.get(name, Counter())
            entry: dict[str, Any] = {"workers": s.drafters.get(name, 0), "rounds": counts["rounds"],
                                     "proposed": counts["proposed"], "accepted": counts["accepted"]}
            rates = {kind: acc.rate for kind, greedy in (("greedy", True), ("sampled", False))
                     if (acc := s.drafter_acceptance.get((name, greedy))) is not None}
            if rates:
                entry["acceptance"] = rates
            if name in s.drafter_costs:
                entry["spec_costs"] = list(s.drafter_costs[name][0])
            out[name] = entry
        return out
