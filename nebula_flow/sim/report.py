"""What ``nebula-flow simulate`` prints and draws: the bench's table, the sweep, PNG plots."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nebula_flow.stats import is_urgent, percentiles

if TYPE_CHECKING:
    from nebula_flow.request import Request
    from nebula_flow.sim.scenario import Workload


def latencies(done: list[Request], t_done: Mapping[int, float], workload: Workload) -> dict[str, Any]:
    """TTFT and latency percentiles of the finished requests; with ``urgent_every``, the urgent
    requests' and the others' apart too (``urgent_ttft_s``, ``other_latency_s``, ...: as the bench's)."""
    groups = {"": done}
    if workload.urgent_every:  # (request i has rid i + 1)
        groups["urgent_"] = [r for r in done if is_urgent(workload.urgent_every, r.rid - 1)]
        groups["other_"] = [r for r in done if not is_urgent(workload.urgent_every, r.rid - 1)]
    return {f"{who}{what}": percentiles([(r.t_first if what == "ttft_s" else t_done[r.rid]) - r.t_submit for r in reqs])
            for who, reqs in groups.items() for what in ("ttft_s", "latency_s")}


def sweep_table(rows: list[dict[str, Any]]) -> str:
    out = [f"{'draft':>6}{'target':>7}{'requests':>10}{'rounds/s':>12}{'tokens/s':>12}{'util':>7}{'vs proportional':>17}"]
    for r in rows:
        out.append(f"{r['draft_workers']:>6}{r['target_workers']:>7}{r['requests']:>10}{r['round_rate']:>12,.0f}"
                   f"{r['tokens_per_s']:>12,.0f}{r['utilization']:>7.2f}{r['proportional']:>16.3f}x")
    return "\n".join(out)


def plan_table(rows: list[dict[str, Any]]) -> str:
    best = rows[0]["tokens_per_s"]
    out = [f"{'mode':<16}{'devices':<24}{'tokens/s':>11}{'rounds/s':>11}{'lat p50':>9}{'vs best':>9}"]
    for r in rows:
        out.append(f"{r['mode']:<16}{r['shape']:<24}{r['tokens_per_s']:>11,.0f}{r['round_rate']:>11,.0f}"
                   f"{r['latency_p50_s']:>8.2f}s{r['tokens_per_s'] / best:>8.2f}x")
    return "\n".join(out)


def plot(out: Path, modes: dict[str, dict[str, Any]], sweep: list[dict[str, Any]] | None, title: str) -> list[Path]:
    """modes.png (request-round rate per mode) and, with a sweep, scaling.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if modes:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = list(modes)
        ax.bar(names, [modes[m]["round_rate"] for m in names])
        for i, m in enumerate(names):
            ax.annotate(f"{modes[m]['round_rate'] / modes[names[0]]['round_rate']:.2f}x",
                        (i, modes[m]["round_rate"]), ha="center", va="bottom")
        ax.set(ylabel="request-rounds/s", title=f"{title}: modes side by side")
        fig.savefig(out / "modes.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(out / "modes.png")
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        n = [r["draft_workers"] + r["target_workers"] for r in sweep]
        rate = [r["round_rate"] for r in sweep]
        ax.plot(n, rate, "o-", label="simulated")
        ax.plot(n, [rate[0] * x / n[0] for x in n], "--", label="proportional")
        ax.set(xscale="log", yscale="log", xlabel="workers (draft + target)", ylabel="request-rounds/s",
               title=f"{title}: scaling")
        ax.legend()
        ax.grid(alpha=0.3, which="both")
        fig.savefig(out / "scaling.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(out / "scaling.png")
    return paths
