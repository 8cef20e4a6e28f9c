"""Validate the simulator against the live system on emulated devices.

1. Measures this host's message hop: one colocated emulated worker alone, the time it waits
   between batches (result -> broker -> next batch) is two hops.
2. Runs the live deployment (``nebula-flow bench`` on the emulated config) for each mode,
   medians over repeats.
3. Simulates the same configuration and workload, once with the scenario's own host costs and
   once with the measured hop, and prints request-round rates side by side.

    python tools/validate_sim.py [--scenario configs/sim/emulated-2d2t.toml] [--repeats 5] [--concurrency N] [--json]
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nebula_flow.bench import DEFAULT_PROMPTS, BenchWorkload, bench_mode, run_once  # noqa: E402
from nebula_flow.client import Client  # noqa: E402
from nebula_flow.config import load_config, read_toml  # noqa: E402
from nebula_flow.deploy import Deployment  # noqa: E402
from nebula_flow.sim.engine import simulate  # noqa: E402
from nebula_flow.sim.scenario import load_scenario  # noqa: E402


def measure_hop_s(deploy: str, wl: BenchWorkload, repeats: int = 3) -> float:
    """Half the idle gap per batch of a lone colocated worker: one broker <-> worker hop."""
    cfg = load_config(deploy)
    cfg.mode, cfg.draft.workers, cfg.target.workers = "colocated", 0, 1
    cfg.broker.client_port = cfg.broker.worker_port = 0
    per_worker = max(1, cfg.target.max_batch)
    lone = BenchWorkload(wl.prompts[:per_worker], wl.max_new_tokens, per_worker)
    gaps = []
    with Deployment(cfg) as dep, Client(dep.address) as c:
        run_once(dep.address, lone)  # warm-up
        for _ in range(repeats):
            s0 = c.status()
            res = run_once(dep.address, lone)
            s1 = c.status()
            batches = sum(s1["batch_sizes"]["colocated"].values()) - sum(s0["batch_sizes"]["colocated"].values())
            busy = s1["workers"][0]["busy_s"] - s0["workers"][0]["busy_s"]
            gaps.append((res["wall_s"] - busy) / max(batches, 1))
    return sorted(gaps)[len(gaps) // 2] / 2


@click.command()
@click.option("--scenario", default=str(REPO / "configs" / "sim" / "emulated-2d2t.toml"), show_default=True)
@click.option("--modes", default="pooled,paired,colocated,autoregressive", show_default=True)
@click.option("--repeats", default=5, show_default=True, help="Live repeats per mode (medians).")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="Concurrent requests, and as many requests in all (default: the scenario's workload), "
                   "e.g. 192 to saturate the emulated deployment.")
@click.option("--json", "as_json", is_flag=True)
def main(scenario: str, modes: str, repeats: int, concurrency: int | None, as_json: bool) -> None:
    sc = load_scenario(scenario)
    if concurrency is not None:  # (the live bench and the simulator get the same closed-loop workload)
        sc = replace(sc, workload=replace(sc.workload, requests=concurrency, concurrency=concurrency))
    raw = read_toml(scenario, "scenario")
    deploy = str((Path(scenario).resolve().parent / raw["deploy"]).resolve())
    w = sc.workload
    wl = BenchWorkload([DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(w.requests)], w.output_tokens,
                  w.concurrency or w.requests)
    names = [m.strip() for m in modes.split(",") if m.strip()]

    def log(message: str) -> None:
        click.echo(message, err=True)

    hop = measure_hop_s(deploy, wl)
    log(f"[validate] measured message hop on this host: {hop * 1e6:.0f} us")
    measured = replace(sc, host=replace(sc.host, message_latency_us=hop * 1e6))
    rows = {}
    for mode in names:
        cfg = load_config(deploy)
        live = bench_mode(cfg, mode, wl, repeats, log=log)["zmq"]
        rows[mode] = {"live_round_rate": live["round_rate"],
                      "live_repeats": [r["round_rate"] for r in live["repeats"]],
                      "sim_round_rate": simulate(sc, mode)["round_rate"],
                      "sim_measured_hop_round_rate": simulate(measured, mode)["round_rate"]}
        r = rows[mode]
        log(f"[validate] {mode}: live {r['live_round_rate']:.0f}, simulated {r['sim_round_rate']:.0f} "
            f"(with measured hop {r['sim_measured_hop_round_rate']:.0f}) rounds/s")
    out = {"scenario": scenario, "hop_us": hop * 1e6, "scenario_hop_us": sc.host.message_latency_us, "modes": rows}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"{'mode':<16}{'live':>9}{'sim':>9}{'sim/live':>10}{'sim (hop)':>11}{'sim/live':>10}")
    for mode, r in rows.items():
        live = r["live_round_rate"]
        click.echo(f"{mode:<16}{live:>9.0f}{r['sim_round_rate']:>9.0f}{r['sim_round_rate'] / live:>9.2f}x"
                   f"{r['sim_measured_hop_round_rate']:>11.0f}{r['sim_measured_hop_round_rate'] / live:>9.2f}x")
    click.echo(f"(scenario hop {sc.host.message_latency_us:.0f} us; measured hop {hop * 1e6:.0f} us)")


if __name__ == "__main__":
    main()
