"""How many draft tokens a simulated verify accepts.

Either per-position conditional acceptance rates (``rates[i]`` = P(draft i accepted | drafts
0..i-1 accepted), the last rate repeated for deeper positions), or a histogram of committed
tokens per round from a real run (``nebula-flow status --json`` → ``tokens_per_round_hist``; its
``accepted_by_position``/``proposed_by_position`` give the rates). Every draw is a pure function
of (seed, request, round), so a scenario's result does not depend on event order.

Token trees (the policy's ``first_alternatives`` and ``fuse_ngram``), optional:

* ``alternative_rate``: P(a runner-up to the first draft token wins | that token was rejected),
  as ``speclen.AcceptanceModel`` learns it per request;
* ``fused_match``: P(a round that asks for a fused prompt-lookup chain finds one);
  ``fused_win``: P(the chain wins tokens beyond the draft | found); ``fused_gain``: the mean
  tokens it wins then (geometric, at least 1, at most what the chain's length leaves).

A live broker's status gives all four (``from_status``: its ``alternatives_*`` and ``fused_*``
counters).

Requests differ (``concentration``, optional, with rates): each request's first-position rate is
drawn from a Beta whose mean is the configured one and whose a + b is ``concentration`` (small:
requests far apart, as prose beside boilerplate code; 0: every request alike), its deeper rates
scaled with it. The draw is a pure function of (seed, request), like every other.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nebula_flow.protocol import AHEAD_GUESSES
from nebula_flow.specdec import uniform

STREAM_SIM = 7  # keeps simulator draws apart from the decoding streams in ``specdec``
STREAM_SIM_TREE = 9  # the token-tree draws (runner-ups, fused chains), apart from the draft's
STREAM_SIM_GUESS = 11  # whether the target's token was one the draft guessed (draft-ahead's hits)
TREE_KEYS = ("alternative_rate", "fused_match", "fused_win", "fused_gain")


def guess_rank(u: float, rates: Sequence[float]) -> int:
    """Which of a draft's ranked guesses is right (1-based; 0: none) for a uniform draw ``u``, guess
    r right with ``rates[r - 1]`` where those before it were not: the first iff ``u < rates[0]``.
    How the simulator and the emulated draft model a draft's next choices where its first was
    wrong (the bundled pair measures ~0.28, ~0.19 and ~0.09 on code: docs/benchmarks.md)."""
    missed = 1.0
    for rank, rate in enumerate(rates, 1):
        missed *= 1.0 - rate
        if u < 1.0 - missed:
            return rank
    return 0


def ranked_rates(rates: float | Sequence[float], where: str) -> list[float]:
    """A draft's guess rates after its first choice (``AHEAD_GUESSES - 1`` of them) from one rate
    for every rank or a list, its last repeated for the ranks it does not reach."""
    given = [rates] if isinstance(rates, int | float) and not isinstance(rates, bool) else list(rates)
    if not 1 <= len(given) <= AHEAD_GUESSES - 1 or not all(
            isinstance(r, int | float) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in given):
        raise ValueError(f"{where} must be a rate in [0, 1] or a list of 1 to {AHEAD_GUESSES - 1} of them, got {rates!r}")
    return [float(r) for r in given] + [float(given[-1])] * (AHEAD_GUESSES - 1 - len(given))


class AcceptanceModel:
    def __init__(self, rates: list[float] | None = None, histogram: dict[int, float] | None = None,
                 seed: int = 0, alternative_rate: float = 0.0, fused_match: float = 0.0,
                 fused_win: float = 0.0, fused_gain: float = 1.0, concentration: float = 0.0,
                 guess_rates: Sequence[float] | None = None) -> None:
        if not all(0.0 <= x <= 1.0 for x in (alternative_rate, fused_match, fused_win)) or fused_gain < 1.0:
            raise ValueError("alternative_rate, fused_match and fused_win must be in [0, 1], fused_gain >= 1")
        self.alternative_rate, self.fused_match, self.fused_win = alternative_rate, fused_match, fused_win
        # draft-ahead's bets: the draft's guesses after its first choice, right with these rates
        # rank by rank (default: alternative_rate at every rank, as a runner-up wins)
        self.guess_rates = ranked_rates(alternative_rate if guess_rates is None else guess_rates, "guess_rates")
        self.fused_gain = fused_gain
        if (rates is None) == (histogram is None):
            raise ValueError("give acceptance rates or a histogram, not both")
        if rates is not None and (not rates or any(not 0.0 <= r <= 1.0 for r in rates)):
            raise ValueError("acceptance rates must be in [0, 1]")
        if histogram is not None:
            if not histogram or any(n < 1 or c < 0 for n, c in histogram.items()) or sum(histogram.values()) <= 0:
                raise ValueError("a tokens-per-round histogram maps counts >= 1 to frequencies >= 0")
        self.rates, self.seed = rates, seed
        self.histogram = sorted(histogram.items()) if histogram else None
        if concentration < 0 or (concentration and (rates is None or not 0 < rates[0] < 1)):
            raise ValueError("concentration must be >= 0, and needs a first-position rate strictly between 0 and 1")
        self.concentration = concentration
        self._by_request: dict[int, list[float]] = {}

    @classmethod
    def from_status(cls, path: str | Path, seed: int = 0) -> AcceptanceModel:
        """Per-position rates measured by a live broker (``nebula-flow status --json > file``)."""
        raw = json.loads(Path(path).read_text())
        prop, acc = raw.get("proposed_by_position") or [], raw.get("accepted_by_position") or []
        if not prop or not prop[0]:
            raise ValueError(f"{path}: no proposed_by_position counts (was the run speculative?)")
        rates = [a / p if p else 0.0 for p, a in zip(prop, acc)]
        # accepted_by_position[i] counts rounds that accepted i+1 drafts: make it conditional.
        cond = [rates[0]] + [rates[i] / rates[i - 1] if rates[i - 1] else 0.0 for i in range(1, len(rates))]
        c = raw.get("counters") or {}

        def ratio(num: str, den: str, default: float) -> float:
            return c.get(num, 0) / c[den] if c.get(den) else default

        return cls(rates=[min(1.0, r) for r in cond], seed=seed,
                   alternative_rate=min(1.0, ratio("alternatives_accepted", "alternatives_contested", 0.0)),
                   fused_match=min(1.0, ratio("fused_chains", "fused_asked", 0.0)),
                   fused_win=min(1.0, ratio("fused_rounds_won", "fused_chains", 0.0)),
                   fused_gain=max(1.0, ratio("fused_tokens_accepted", "fused_rounds_won", 1.0)))

    @classmethod
    def from_config(cls, raw: dict[str, Any], seed: int, base: Path | None = None) -> AcceptanceModel:
        unknown = set(raw) - {"status", "histogram", "per_position", "rate", "concentration", "guess_rates", *TREE_KEYS}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        tree: dict[str, Any] = {key: float(raw[key]) for key in TREE_KEYS if key in raw}
        if "concentration" in raw:
            tree["concentration"] = float(raw["concentration"])
        if "guess_rates" in raw:  # (checked by the model: one rate, or a list rank by rank)
            tree["guess_rates"] = raw["guess_rates"]
        if "status" in raw:
            p = Path(raw["status"])
            measured = cls.from_status(base / p if base and not p.is_absolute() else p, seed)
            if not tree:
                return measured
            return cls(rates=measured.rates, seed=seed, **{**measured.tree(), **tree})  # (the scenario's wins)
        if "histogram" in raw:
            return cls(histogram={int(n): float(c) for n, c in raw["histogram"].items()}, seed=seed, **tree)
        if "per_position" in raw:
            return cls(rates=[float(r) for r in raw["per_position"]], seed=seed, **tree)
        return cls(rates=[float(raw.get("rate", 0.7))], seed=seed, **tree)

    def tree(self) -> dict[str, float]:
        """The token-tree parameters (``TREE_KEYS``)."""
        return {key: getattr(self, key) for key in TREE_KEYS}

    def with_seed(self, seed: int) -> AcceptanceModel:
        """The same model drawing from ``seed``."""
        other = copy.copy(self)
        other.seed, other._by_request = seed, {}
        return other

    def accepted(self, rid: int, round_: int, k: int, stream: int = STREAM_SIM) -> int:
        """Draft tokens accepted out of ``k`` in round ``round_`` of request ``rid`` (``stream``: a
        draw apart from the round's draft's, for a second drafter's chain)."""
        if k <= 0:
            return 0
        key = (self.seed * 1_000_003 + rid) & ((1 << 62) - 1)
        if self.histogram is not None:
            total = sum(c for _, c in self.histogram)
            u, acc = uniform(key, round_, stream) * total, 0.0
            for n, c in self.histogram:
                acc += c
                if u < acc:
                    return min(n - 1, k)
            return min(self.histogram[-1][0] - 1, k)
        rates = self.request_rates(rid)
        n = 0
        while n < k and uniform(key, round_ * 64 + n, stream) < rates[min(n, len(rates) - 1)]:
            n += 1
        return n

    def request_rates(self, rid: int) -> list[float]:
        """Request ``rid``'s per-position rates: the configured ones, or with ``concentration``
        its own draw around them."""
        if not self.concentration:
            return self.rates
        rates = self._by_request.get(rid)
        if rates is None:
            mean = self.rates[0]
            rng = np.random.Generator(np.random.PCG64([self.seed & ((1 << 63) - 1), rid, STREAM_SIM]))
            first = float(rng.beta(mean * self.concentration, (1 - mean) * self.concentration))
            rates = [first] + [min(1.0, r * first / mean) for r in self.rates[1:]]
            self._by_request[rid] = rates
        return rates

    def tree_round(self, rid: int, round_: int, k: int, alts: int, fuse: int) -> tuple[int, bool, int, int | None]:
        """A verified round with ``alts`` runner-ups and a fused chain of up to ``fuse`` tokens
        asked for: (accepted, via_alt, the draft's own accepted tokens, the chain's gain beyond the
        draft or None where no chain was found), as the broker reports a round to the policy."""
        drafted = self.accepted(rid, round_, k)
        key = (self.seed * 1_000_003 + rid) & ((1 << 62) - 1)

        def u(i: int) -> float:
            return uniform(key, round_ * 64 + i, STREAM_SIM_TREE)

        fused = None
        if fuse > 0 and u(0) < self.fused_match:
            fused, room = 0, fuse - drafted  # (the chain starts where the draft does)
            if room > 0 and u(1) < self.fused_win:
                fused = 1
                while fused < room and u(1 + fused) < 1 - 1 / self.fused_gain:
                    fused += 1
        if fused:
            return drafted + fused, False, drafted, fused
        via_alt = alts > 0 and k > 0 and drafted == 0 and u(63) < self.alternative_rate
        return drafted + via_alt, via_alt, drafted, fused

    def guessed(self, rid: int, round_: int, accepted: int, k: int) -> int:
        """Which of the draft's guesses the target's token after ``accepted`` of ``k`` draft tokens
        was (what a draft-ahead branch bets on; 0: none of them). After a rejection: its r-th best
        other token, right with ``guess_rates[r - 1]`` where those before it were not (default
        ``alternative_rate`` at every rank, as a runner-up wins). After the whole draft: its own next token first (accepted as any draft
        token at that depth), then its next guesses likewise."""
        key = (self.seed * 1_000_003 + rid) & ((1 << 62) - 1)
        first, second = (uniform(key, round_ * 64 + i, STREAM_SIM_GUESS) for i in (0, 1))
        if accepted < k:
            return guess_rank(first, self.guess_rates)
        if first < self.next_rate(rid, k):
            return 1
        rank = guess_rank(second, self.guess_rates)
        return rank + 1 if rank else 0

    def next_rate(self, rid: int, depth: int) -> float:
        """P(a draft token at ``depth`` is accepted | the ``depth`` before it were)."""
        if self.histogram is None:
            rates = self.request_rates(rid)
            return rates[min(depth, len(rates) - 1)]
        beyond = sum(c for n, c in self.histogram if n > depth + 1)
        reached = beyond + sum(c for n, c in self.histogram if n == depth + 1)
        return beyond / reached if reached else 0.0

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
