"""How many draft tokens a simulated verify accepts.

Either per-position conditional acceptance rates (``rates[i]`` = P(draft i accepted | drafts
0..i-1 accepted), the last rate repeated for deeper positions), or a histogram of committed
tokens per round from a real run (``nebula-flow status --json`` → ``tokens_per_round_hist``; its
``accepted_by_position``/``proposed_by_position`` give the rates). Every draw is a pure function
of (seed, request, round), so a scenario's result does not depend on event order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nebula_flow.specdec import uniform

STREAM_SIM = 7  # keeps simulator draws apart from the decoding streams in ``specdec``


class Acceptance:
    def __init__(self, rates: list[float] | None = None, histogram: dict[int, float] | None = None,
                 seed: int = 0) -> None:
        if (rates is None) == (histogram is None):
            raise ValueError("give acceptance rates or a histogram, not both")
        if rates is not None and (not rates or any(not 0.0 <= r <= 1.0 for r in rates)):
            raise ValueError("acceptance rates must be in [0, 1]")
        if histogram is not None:
            if not histogram or any(n < 1 or c < 0 for n, c in histogram.items()) or sum(histogram.values()) <= 0:
                raise ValueError("a tokens-per-round histogram maps counts >= 1 to frequencies >= 0")
        self.rates, self.seed = rates, seed
        self.histogram = sorted(histogram.items()) if histogram else None

    @classmethod
    def from_status(cls, path: str | Path, seed: int = 0) -> Acceptance:
        """Per-position rates measured by a live broker (``nebula-flow status --json > file``)."""
        raw = json.loads(Path(path).read_text())
        prop, acc = raw.get("proposed_by_position") or [], raw.get("accepted_by_position") or []
        if not prop or not prop[0]:
            raise ValueError(f"{path}: no proposed_by_position counts (was the run speculative?)")
        rates = [a / p if p else 0.0 for p, a in zip(prop, acc)]
        # accepted_by_position[i] counts rounds that accepted i+1 drafts: make it conditional.
        cond = [rates[0]] + [rates[i] / rates[i - 1] if rates[i - 1] else 0.0 for i in range(1, len(rates))]
        return cls(rates=[min(1.0, r) for r in cond], seed=seed)

    @classmethod
    def from_config(cls, raw: dict[str, Any], seed: int, base: Path | None = None) -> Acceptance:
        if "status" in raw:
            p = Path(raw["status"])
            return cls.from_status(base / p if base and not p.is_absolute() else p, seed)
        if "histogram" in raw:
            return cls(histogram={int(n): float(c) for n, c in raw["histogram"].items()}, seed=seed)
        if "per_position" in raw:
            return cls(rates=[float(r) for r in raw["per_position"]], seed=seed)
        return cls(rates=[float(raw.get("rate", 0.7))], seed=seed)

    def accepted(self, rid: int, round_: int, k: int) -> int:
        """Draft tokens accepted out of ``k`` in round ``round_`` of request ``rid``."""
        if k <= 0:
            return 0
        key = (self.seed * 1_000_003 + rid) & ((1 << 62) - 1)
        if self.histogram is not None:
            total = sum(c for _, c in self.histogram)
            u, acc = uniform(key, round_, STREAM_SIM) * total, 0.0
            for n, c in self.histogram:
                acc += c
                if u < acc:
                    return min(n - 1, k)
            return min(self.histogram[-1][0] - 1, k)
        n = 0
        while n < k and uniform(key, round_ * 64 + n, STREAM_SIM) < self.rates[min(n, len(self.rates) - 1)]:
            n += 1
        return n

    def expected_tokens_per_round(self, k: int) -> float:
        """Mean committed tokens per round at depth ``k`` (accepted drafts + the bonus token)."""
        if self.histogram is not None:
            total = sum(c for _, c in self.histogram)
            return sum(min(n, k + 1) * c for n, c in self.histogram) / total
        mean, p = 1.0, 1.0
        for i in range(k):
            p *= self.rates[min(i, len(self.rates) - 1)]
            mean += p
        return mean
