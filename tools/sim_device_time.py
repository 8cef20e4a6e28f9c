"""Where a simulated deployment's device time goes: drafts, verifies, and verifies that prefill a
prompt, per mode, and how fast each mode would be if its workers never idled.

Why: a mode's throughput at saturation is its work over its devices. Splitting the work by kind
shows what a policy can still win (idle time, smaller draft batches) and what it cannot (the
verify work every mode does alike), so a goal such as "elastic 1.2x colocated" can be checked
against what the scenario allows before anyone tunes for it.

    python tools/sim_device_time.py [--scenario configs/sim/paper-2d2t.toml] [--modes colocated,elastic]
        [--all-at-once]

A mode may carry settings as ``simulate``'s do (``elastic@elastic_split=1000000``, ``@prefix_cache=false``). ``--all-at-once``
replays a trace scenario's requests all at once (the planner's saturation). The last column is the
busy share of the run's last tenth: where a run's tail, a few long requests on a few workers, costs
wall time that no split of the work wins back.
"""

from __future__ import annotations

import collections
import sys
from dataclasses import replace
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nebula_flow.cli.simulate import with_mode_settings  # noqa: E402
from nebula_flow.sim import engine  # noqa: E402
from nebula_flow.sim.loads import at_rate  # noqa: E402
from nebula_flow.sim.scenario import load_scenario  # noqa: E402

spent: collections.Counter = collections.Counter()
busy: list[tuple[float, float]] = []  # (start, seconds) of every costed forward batch


def _count_forwards() -> None:
    """Wrap the simulator's two costings of a batch so each adds its seconds and rows by kind."""
    draft_time, verify_time = engine.Simulator._draft_time, engine.Simulator._verify_time

    def counted_draft(self, w, tasks, ends):  # noqa: ANN001, ANN202
        took = draft_time(self, w, tasks, ends)
        busy.append((self.now, took))
        spent["draft_s"] += took
        spent["draft_batches"] += 1
        spent["draft_rows"] += len(tasks)
        return took

    def counted_verify(self, w, tasks, outcomes, ends):  # noqa: ANN001, ANN202
        prefills = any(w.caches["target"].get(t.req.rid, 0) == 0 for t in tasks)  # (read before it runs)
        took = verify_time(self, w, tasks, outcomes, ends)
        busy.append((self.now, took))
        spent["prefill_verify_s" if prefills else "verify_s"] += took
        spent["verify_batches"] += 1
        spent["verify_rows"] += len(tasks)
        return took

    engine.Simulator._draft_time, engine.Simulator._verify_time = counted_draft, counted_verify


def _tail_share(wall: float, workers: int) -> float:
    """The busy share of the workers over the run's last tenth (a batch counted where it starts)."""
    return sum(t for start, t in busy if start >= 0.9 * wall) / (0.1 * wall * workers)


@click.command()
@click.option("--scenario", default=str(REPO / "configs/sim/paper-2d2t.toml"), show_default=True)
@click.option("--modes", default="colocated,elastic", show_default=True,
              help="Comma-separated, each MODE or MODE@KNOB=VALUE[@KNOB=VALUE...]; ratios against the first.")
@click.option("--all-at-once", is_flag=True, help="A trace scenario's requests all at once (the planner's saturation).")
def main(scenario: str, modes: str, all_at_once: bool) -> None:
    _count_forwards()
    sc = load_scenario(scenario)
    if all_at_once:
        sc = replace(sc, workload=at_rate(sc, None))
    first, specs = None, modes.split(",")
    width = max(16, *(len(spec) + 2 for spec in specs))
    print(f"{'mode':<{width}}{'wall s':>8}{'device s':>10}{'draft s':>9}{'verify s':>10}{'prefill s':>11}"
          f"{'rows/draft':>12}{'rows/verify':>13}{'util':>6}{'never idle s':>14}{'vs first':>10}{'last tenth':>12}")
    for spec in specs:
        mode, *settings = spec.split("@")
        spent.clear()
        busy.clear()
        result = engine.Simulator(with_mode_settings(sc, settings, spec), mode).run()
        wall, util = result["wall_s"], result["utilization"]  # (the engine's own busy share)
        first = first or wall
        print(f"{spec:<{width}}{wall:>8.2f}{wall * len(result['workers']):>10.1f}{spent['draft_s']:>9.2f}"
              f"{spent['verify_s']:>10.2f}{spent['prefill_verify_s']:>11.2f}"
              f"{spent['draft_rows'] / max(spent['draft_batches'], 1):>12.1f}"
              f"{spent['verify_rows'] / max(spent['verify_batches'], 1):>13.1f}{util:>6.2f}"
              f"{wall * util:>14.2f}{first / wall:>9.2f}x"  # (never idle: its busy time spread over all workers)
              f"{_tail_share(wall, len(result['workers'])):>12.2f}")


if __name__ == "__main__":
    main()
