"""Where a simulated deployment's device time goes: drafts, verifies, and verifies that prefill a
prompt, per mode, and how fast each mode would be if its workers never idled.

Why: a mode's throughput at saturation is its work over its devices. Splitting the work by kind
shows what a policy can still win (idle time, smaller draft batches) and what it cannot (the
verify work every mode does alike), so a goal such as "elastic 1.2x colocated" can be checked
against what the scenario allows before anyone tunes for it.

    python tools/sim_device_time.py [--scenario configs/sim/paper-2d2t.toml] [--modes colocated,elastic]
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nebula_flow.sim import engine  # noqa: E402
from nebula_flow.sim.scenario import load_scenario  # noqa: E402

spent: collections.Counter = collections.Counter()


def _count_forwards() -> None:
    """Wrap the simulator's two costings of a batch so each adds its seconds and rows by kind."""
    draft_time, verify_time = engine.Simulator._draft_time, engine.Simulator._verify_time

    def counted_draft(self, w, tasks, ends):  # noqa: ANN001, ANN202
        took = draft_time(self, w, tasks, ends)
        spent["draft_s"] += took
        spent["draft_batches"] += 1
        spent["draft_rows"] += len(tasks)
        return took

    def counted_verify(self, w, tasks, outcomes, ends):  # noqa: ANN001, ANN202
        prefills = any(w.caches["target"].get(t.req.rid, 0) == 0 for t in tasks)  # (read before it runs)
        took = verify_time(self, w, tasks, outcomes, ends)
        spent["prefill_verify_s" if prefills else "verify_s"] += took
        spent["verify_batches"] += 1
        spent["verify_rows"] += len(tasks)
        return took

    engine.Simulator._draft_time, engine.Simulator._verify_time = counted_draft, counted_verify


@click.command()
@click.option("--scenario", default=str(REPO / "configs/sim/paper-2d2t.toml"), show_default=True)
@click.option("--modes", default="colocated,elastic", show_default=True, help="Comma-separated; ratios against the first.")
def main(scenario: str, modes: str) -> None:
    _count_forwards()
    sc = load_scenario(scenario)
    first = None
    print(f"{'mode':<16}{'wall s':>8}{'device s':>10}{'draft s':>9}{'verify s':>10}{'prefill s':>11}"
          f"{'rows/draft':>12}{'rows/verify':>13}{'util':>6}{'never idle s':>14}{'vs first':>10}")
    for mode in modes.split(","):
        spent.clear()
        result = engine.Simulator(sc, mode).run()
        wall, util = result["wall_s"], result["utilization"]  # (the engine's own busy share)
        first = first or wall
        print(f"{mode:<16}{wall:>8.2f}{wall * len(result['workers']):>10.1f}{spent['draft_s']:>9.2f}"
              f"{spent['verify_s']:>10.2f}{spent['prefill_verify_s']:>11.2f}"
              f"{spent['draft_rows'] / max(spent['draft_batches'], 1):>12.1f}"
              f"{spent['verify_rows'] / max(spent['verify_batches'], 1):>13.1f}{util:>6.2f}"
              f"{wall * util:>14.2f}{first / wall:>9.2f}x")  # (never idle: its busy time spread over all workers)


if __name__ == "__main__":
    main()
