"""`simulate`: the live scheduling policy on a virtual clock (nebula_flow/sim/)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from nebula_flow.cli.common import IntList, split_pool_settings, with_settings
from nebula_flow.config import ConfigError
from nebula_flow.roles import MODES

if TYPE_CHECKING:
    from nebula_flow.sim.scenario import Scenario


@click.command()
@click.argument("scenario", type=click.Path(), required=False)
@click.option("--modes", help="Comma-separated modes (default: the scenario's); ratios are against the first. A mode "
              "may end in @KNOB=VALUE (repeatable) to set a [policy] knob for it alone, as in bench, e.g. "
              "pooled@draft_ahead=0,pooled@draft_ahead=6; @prefix_cache=false turns the workers' prefix cache off "
              "(where the workload's prompts share their start: colocated@prefix_cache=false,colocated).")
@click.option("--concurrency", type=click.IntRange(min=1), help="Override the workload's concurrency (closed loop: "
              "at most this many requests in flight), e.g. 1 for a single stream.")
@click.option("--urgent", type=click.IntRange(min=2), metavar="N", help="Override the workload's urgent_every: "
              "requests 1, N+1, 2N+1, ... are urgent (priority -1 in modes with priority_scheduling), their latency "
              "printed beside the others', as in bench.")
@click.option("--draft-workers", type=click.IntRange(1), help="Override the draft pool size.")
@click.option("--target-workers", type=click.IntRange(1), help="Override the target pool size.")
@click.option("--sweep", is_flag=True, help="Also scale both pools together (draft:target ratio kept) and "
              "report capacity against worker count.")
@click.option("--sweep-workers", type=IntList(), help="Draft pool sizes for --sweep, e.g. 1,2,4,8 (default: the scenario's [sweep]).")
@click.option("--sweep-targets", type=IntList(), help="Target pool sizes: with it --sweep runs every draft x target pair (a grid) "
              "instead of keeping the scenario's draft:target ratio.")
@click.option("--gpus", "devices", type=int, help="Also plan N devices: pooled with every draft/target split, "
              "paired N/2 + N/2, colocated, autoregressive and elastic on all N, ranked by tokens/s.")
@click.option("--loads", help="With --gpus: plan at these loads (light, medium, saturation): saturation is the "
              "scenario's workload, light and medium open-loop arrivals at 30 % and 70 % of the best fixed "
              "arrangement's capacity (a trace: its arrivals time-scaled to that rate).")
@click.option("--seed", type=click.IntRange(0), help="Override the scenario's seed (acceptance draws, prompt lengths, arrivals).")
@click.option("--out", type=click.Path(), help="Write result.json and PNG plots (modes, scaling) into this folder.")
@click.option("--json", "as_json", is_flag=True, help="Print {\"modes\": {...}, \"sweep\": [...]} as JSON.")
@click.option("--broker-shards", type=click.IntRange(min=1), help="Override the scenario's [host] broker_shards: "
              "brokers sharing the requests, each taking its share of the broker's per-message and per-task costs.")
@click.option("--check-policy-log", type=click.Path(exists=True, dir_okay=False),
              help="Instead of simulating: replay a broker's --policy-log into the simulator's policy and "
              "say whether every decision is identical.")
def simulate(scenario, modes, concurrency, urgent, draft_workers, target_workers, sweep, sweep_workers, sweep_targets, devices, loads, seed,
             out, as_json, broker_shards, check_policy_log) -> None:  # noqa: ANN001
    """Simulate a deployment: the live scheduling policy on a virtual clock, with profiled or
    roofline device costs. SCENARIO is a TOML file (see configs/sim/)."""
    from dataclasses import replace

    if check_policy_log:
        from nebula_flow import policy_log

        records = policy_log.load(check_policy_log)
        report = policy_log.replay(records, policy_log.policy_of(records))
        click.echo(f"{report.events} events, {report.decisions} dispatch decisions: "
                   + ("all identical" if report.identical else f"{len(report.mismatches)} differ"))
        for m in report.mismatches[:5]:
            click.echo(f"  {m}")
        sys.exit(0 if report.identical else 1)
    if not scenario:
        raise click.UsageError("give a SCENARIO file (e.g. configs/sim/paper-2d2t.toml)")
    if loads and devices is None:
        raise click.UsageError("--loads plans devices: give --gpus N too")
    from nebula_flow.bench import table, urgent_lines
    from nebula_flow.sim import engine, planner, report
    from nebula_flow.sim.scenario import describe, load_scenario

    try:
        sc = load_scenario(scenario)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if seed is not None:
        sc = replace(sc, seed=seed, acceptance=sc.acceptance.with_seed(seed))
    if broker_shards is not None:
        sc = replace(sc, host=replace(sc.host, broker_shards=broker_shards))
    if concurrency is not None:
        sc = replace(sc, workload=replace(sc.workload, concurrency=concurrency))
    if urgent is not None:
        sc = replace(sc, workload=replace(sc.workload, urgent_every=urgent))
    names = [m.strip() for m in modes.split(",") if m.strip()] if modes else sc.modes
    bad = [m for m in names if m.split("@")[0] not in MODES]
    if bad or not names:
        raise click.ClickException(f"unknown modes {bad}; choose from {', '.join(MODES)} (then @KNOB=VALUE)")
    if twice := sorted({m for m in names if names.count(m) > 1}):  # (results are keyed by mode)
        raise click.ClickException(f"modes given more than once: {', '.join(twice)}")
    def log(m):
        return (click.echo(m, err=True))
    result: dict = {"scenario": describe(sc), "modes": {}}
    for mode in names:
        t0 = time.monotonic()
        base, *settings = mode.split("@")
        try:
            result["modes"][mode] = engine.simulate(with_mode_settings(sc, settings, mode), base,
                                                    draft_workers, target_workers)
        except (ValueError, RuntimeError) as exc:
            raise click.ClickException(f"{mode}: {exc}") from None
        r = result["modes"][mode]
        hits = f", {r['ahead_hit_rate']:.0%} of rounds pre-drafted" if r["draft_ahead"]["tasks"] else ""
        if r["fusion"]["rounds"]:
            hits += f", {r['fusion']['rounds'] / max(r['rounds'], 1):.0%} of rounds fused"
        log(f"[simulate] {mode}: {r['round_rate']:,.1f} rounds/s, {r['tokens_per_s']:,.1f} tokens/s "
            f"({r['requests']} requests{hits}, {time.monotonic() - t0:.1f} s of simulation)")
    first = names[0]
    result["ratios"] = {m: r["round_rate"] / result["modes"][first]["round_rate"] for m, r in result["modes"].items()}
    if sweep:
        sizes = list(sweep_workers) if sweep_workers else None
        targets = list(sweep_targets) if sweep_targets else None
        log(f"[simulate] sweep ({first}):")
        base, *settings = first.split("@")
        result["sweep"] = planner.sweep(with_mode_settings(sc, settings, first), base, sizes,
                                       log=log, targets=targets)
    if devices is not None:
        if devices < 2:
            raise click.BadParameter("--gpus needs at least 2 devices")
        log(f"[simulate] plan for {devices} devices:")
        if loads:
            from nebula_flow.sim.loads import parse_loads, plan_at_loads

            try:
                names = parse_loads(loads)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--loads") from None
            result["plan_by_load"] = plan_at_loads(sc, devices, names, log=log)
            result["plan"] = result["plan_by_load"]["saturated"]
        else:
            result["plan"] = planner.plan(sc, devices, log=log)
    if out:
        folder = Path(out)
        paths = report.plot(folder, result["modes"], result.get("sweep"), sc.name)
        (folder / "result.json").write_text(json.dumps(result, indent=2))
        log(f"[simulate] wrote {folder / 'result.json'} and {', '.join(p.name for p in paths)}")
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(table(result["modes"]))
    if sc.workload.urgent_every:
        click.echo(urgent_lines(result["modes"]))
    if sweep:
        click.echo(report.sweep_table(result["sweep"]))
    if devices is not None:
        click.echo(report.plan_table(result["plan"]))
    if "plan_by_load" in result:
        from nebula_flow.sim.loads import loads_table

        click.echo(loads_table(result["plan_by_load"]))




COMMANDS = [simulate]


def with_mode_settings(sc: Scenario, settings: list[str], where: str) -> Scenario:
    """``sc`` with a mode's ``@KNOB=VALUE`` settings: ``prefix_cache`` (the workers', as bench's
    ``POOL_KNOBS``) and the policy's knobs."""
    from dataclasses import replace

    switches, rest = split_pool_settings(settings, where)
    return replace(sc, prefix_cache=switches.get("prefix_cache", sc.prefix_cache),
                   policy=with_settings(sc.policy, rest, where))
