"""Planning at several loads: the same arrangements under light, medium and saturating traffic.

Saturation is the scenario's own workload (all requests at once, or a closed loop); a trace is
replayed so fast that it is all at once. Lighter loads are open loops at a fraction of the
*capacity*: the request rate the best fixed arrangement (every mode but elastic) sustains at
saturation. Without a trace, Poisson arrivals at that rate; with one, the trace's own arrivals,
time-scaled so their mean rate is that rate (its bursts kept).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nebula_flow.sim.scenario import Scenario, Workload

LOADS = {"light": 0.3, "medium": 0.7, "saturation": None}  # fraction of capacity; None: the scenario's own
ALL_AT_ONCE = 1e9  # a trace's time scale that puts every arrival at its start


def parse_loads(spec: str) -> list[str]:
    """``light,medium,saturation`` (any of them, in that order or another); ValueError names the bad one."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in LOADS]
    if bad or not names:
        raise ValueError(f"loads must be among {', '.join(LOADS)}, got {spec!r}")
    return names


def at_rate(sc: Scenario, rate: float | None) -> Workload:
    """The scenario's requests arriving open loop at ``rate`` requests/s on average (None: saturation)."""
    wl = sc.workload
    if wl.trace:
        if rate is None:
            return replace(wl, time_scale=ALL_AT_ONCE)
        times = [a.at for a in replace(wl, time_scale=1.0).arrivals(sc.seed)]
        native = (len(times) - 1) / max(max(times) - min(times), 1e-9)  # the trace's own mean rate
        return replace(wl, time_scale=rate / native)
    return wl if rate is None else replace(wl, poisson_rate=rate, concurrency=None)


def plan_at_loads(sc: Scenario, devices: int, loads: list[str], log: Callable[[str], None] | None = None,
                  ) -> dict[str, Any]:
    """``planner.plan`` at each load: {"capacity_rps", "capacity_from", "saturated": rows,
    "loads": {load: {"rate_rps", "rows"}}}."""
    from nebula_flow.sim.planner import plan

    if log:
        log("  saturation (the scenario's own workload):")
    saturated = plan(replace(sc, workload=at_rate(sc, None)), devices, log)
    best = next(r for r in saturated if r["mode"] != "elastic")
    capacity = best["requests"] / best["wall_s"]
    out: dict[str, Any] = {"capacity_rps": capacity, "capacity_from": f"{best['mode']} {best['shape']}",
                           "saturated": saturated, "loads": {}}
    for name in loads:
        fraction = LOADS[name]
        if fraction is None:
            out["loads"][name] = {"rate_rps": None, "rows": saturated}
            continue
        rate = fraction * capacity
        if log:
            log(f"  {name}: {rate:,.1f} requests/s ({fraction:.0%} of {out['capacity_from']}'s capacity)")
        out["loads"][name] = {"rate_rps": rate, "rows": plan(replace(sc, workload=at_rate(sc, rate)), devices, log)}
    return out


def loads_table(result: dict[str, Any]) -> str:
    """Per load: each arrangement's tokens/s and latency, and elastic against the best fixed one."""
    out = [f"capacity (the best fixed arrangement at saturation, {result['capacity_from']}): "
           f"{result['capacity_rps']:,.2f} requests/s"]
    out.append(f"{'load':<12}{'mode':<16}{'devices':<24}{'tokens/s':>11}{'lat p50':>9}{'lat p99':>9}")
    for name, entry in result["loads"].items():
        for r in entry["rows"]:
            out.append(f"{name:<12}{r['mode']:<16}{r['shape']:<24}{r['tokens_per_s']:>11,.0f}"
                       f"{r['latency_p50_s']:>8.2f}s{r['latency_p99_s']:>8.2f}s")
        elastic = [r for r in entry["rows"] if r["mode"] == "elastic"]
        fixed = [r for r in entry["rows"] if r["mode"] != "elastic"]
        if elastic and fixed:
            e, f = max(elastic, key=lambda r: r["tokens_per_s"]), fixed[0]
            out.append(f"{name:<12}elastic / best fixed ({f['mode']} {f['shape']}): {e['tokens_per_s'] / f['tokens_per_s']:.2f}x "
                       f"tokens/s, p99 latency {e['latency_p99_s']:.2f} s vs {f['latency_p99_s']:.2f} s")
    return "\n".join(out)
