"""Planning with the simulator: capacity against pool sizes (``sweep``), and every way to run a
scenario's workload on a number of devices (``plan``), each a run of ``engine.simulate``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nebula_flow.sim.engine import simulate
from nebula_flow.sim.scenario import Scenario


def sweep(sc: Scenario, mode: str = "pooled", sizes: list[int] | None = None,
          log: Callable[[str], None] | None = None, targets: list[int] | None = None) -> list[dict[str, Any]]:
    """Capacity against pool sizes: draft pools of ``sizes`` with the scenario's draft:target
    ratio kept, or, given ``targets``, every (draft, target) pair of the two lists (a grid).
    ``proportional`` compares each row with the first, scaled by the total worker count."""
    sizes = sizes or sc.sweep_draft_workers
    ratio = sc.target.workers / sc.draft.workers
    pairs = ([(d, t) for d in sizes for t in targets] if targets
             else [(n, max(1, round(n * ratio))) for n in sizes])
    out: list[dict[str, Any]] = []
    for d, t in pairs:
        wl = sc.workload.scaled(t / sc.target.workers) if sc.sweep_scale_workload else sc.workload
        res = simulate(sc, mode, d, t, wl)
        row = {"draft_workers": d, "target_workers": t, "requests": res["requests"], "round_rate": res["round_rate"],
               "tokens_per_s": res["tokens_per_s"], "utilization": res["utilization"]}
        base = out[0] if out else row
        workers_ratio = (d + t) / (base["draft_workers"] + base["target_workers"])
        row["proportional"] = row["round_rate"] / (base["round_rate"] * workers_ratio)
        out.append(row)
        if log:
            log(f"  {d:>3} draft + {t:>3} target: {row['round_rate']:,.0f} rounds/s, "
                f"{row['proportional']:.3f} of proportional")
    return out


def plan(sc: Scenario, devices: int, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every way to run the scenario's workload on ``devices`` devices, best tokens/s first:
    pooled with each draft/target split, paired as equal pairs, colocated, autoregressive and
    elastic on all of them, and elastic beside each number of draft-only devices. Pools on two
    kinds of hardware plan the scenario's own devices (the draft pool's, then the target pool's).
    Both models fit on each device; the scenario's pools say what each costs where."""
    if devices < 2:
        raise ValueError("planning needs at least 2 devices")
    half = devices // 2
    options = [("pooled", d, devices - d, True) for d in range(1, devices)]
    if devices % 2 == 0:
        options.append(("paired", half, half, True))
    options += [("colocated", half, devices - half, True), ("autoregressive", half, devices - half, True)]
    # elastic: every device holds both models; draft-only devices beside elastic ones, each split
    options += [("elastic", half, devices - half, True)] + [("elastic", d, devices - d, False) for d in range(1, devices)]
    if sc.draft.hardware != sc.target.hardware:  # two kinds of device: the scenario's M + N, no other split
        m, n = sc.draft.workers, sc.target.workers
        if m + n != devices:
            raise ValueError(f"the scenario's devices are {m} {sc.draft.hardware} + {n} {sc.target.hardware}: "
                             f"plan {m + n}, not {devices}")
        options = [(mode, m, n, True) for mode in ("pooled", "paired", "colocated", "autoregressive", "elastic")
                   if mode != "paired" or m == n] + [("elastic", m, n, False)]
    rows = []
    for mode, d, t, all_elastic in options:
        res = simulate(replace(sc, draft=replace(sc.draft, elastic=all_elastic)), mode, d, t)
        shape = f"{d} draft + {t} target" if mode in ("pooled", "paired") else \
            f"{d} draft + {t} elastic" if mode == "elastic" and not all_elastic else f"{devices} workers"
        rows.append({"mode": mode, "draft_workers": d, "target_workers": t, "shape": shape,
                     "round_rate": res["round_rate"], "tokens_per_s": res["tokens_per_s"],
                     "requests": res["requests"], "wall_s": res["wall_s"],
                     "latency_p50_s": res["latency_s"]["p50"], "latency_p99_s": res["latency_s"]["p99"],
                     "utilization_by_role": res["utilization_by_role"]})
        if log:
            log(f"  {mode:<15}{shape:<22}{res['tokens_per_s']:>10,.0f} tokens/s  latency p50 {res['latency_s']['p50']:.2f} s, "
                f"p99 {res['latency_s']['p99']:.2f} s")
    return sorted(rows, key=lambda r: -r["tokens_per_s"])
