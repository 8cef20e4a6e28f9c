"""Summaries of measured samples, shared by the bench, replay and the simulator."""

from __future__ import annotations


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90 and p99 of ``values`` (nearest rank; zeros for no values)."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)

    def pick(q: float) -> float:
        return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def is_urgent(urgent_every: int, i: int) -> bool:
    """Whether request ``i`` (from 0) of a bench or simulated workload is urgent: every ``urgent_every``-th
    from the first (0: none)."""
    return bool(urgent_every) and i % urgent_every == 0
