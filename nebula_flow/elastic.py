"""Elastic roles: which stage a worker that holds both models runs next (pure: no clock, no torch).

In ``elastic`` mode every worker that holds both models (role ``any``) pulls from both topics,
and at each PULL the scheduler gives it either a draft batch or a verify batch. The choice is
the one that moves the most tasks per second of this device's time, priced by the forward times
the workers measured for the batches they ran (``BatchCosts``): each task needs both stages
once a round, so the device time a round costs is least when every batch is as efficient as its
queue allows. This makes drafting wait while its queue is short and verification has work, and
run as one large batch merged across requests once enough drafts are due (a small model's
forward costs little more for many rows than for one), and it sends every device to verify
when verification is the bottleneck.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nebula_flow.request import Request

BUCKETS = tuple(1 << i for i in range(13))  # forwards priced by their new rows: 1, 2, 4, ... 4096
WEIGHT = 0.2  # the newest forward's weight in its bucket's moving mean


def bucket(rows: int) -> int:
    """The index of the bucket a forward of ``rows`` new rows is counted in (nearest power of two below)."""
    return min(max(rows, 1).bit_length() - 1, len(BUCKETS) - 1)


class BatchCosts:
    """A model's forward time on one device by the forward's new rows in all (every sequence of the
    batch): what a batch of each size costs. A moving mean per power-of-two bucket of rows."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        b = bucket(rows)
        old = self.seconds.get(b)
        self.seconds[b] = seconds if old is None else old + WEIGHT * (seconds - old)

    def table(self) -> list[float | None]:
        """Seconds by bucket (index i: 2**i rows) up to the largest seen; None where not seen."""
        return [self.seconds.get(b) for b in range(max(self.seconds, default=-1) + 1)]


def estimate(table: Sequence[float | None] | None, rows: float) -> float | None:
    """The seconds of a forward of ``rows`` new rows from a ``BatchCosts.table`` (None: nothing seen):
    linear between the two measured buckets around it; past the largest, that bucket's time per
    row; below the smallest, the smallest's time (a forward never costs less than its fixed part)."""
    seen = [(BUCKETS[i], t) for i, t in enumerate(table or ()) if t is not None and t > 0]
    if not seen:
        return None
    rows = max(rows, 1.0)
    lo_rows, lo_t = seen[0]
    if rows <= lo_rows:
        return lo_t
    for hi_rows, hi_t in seen[1:]:
        if rows <= hi_rows:
            return lo_t + (hi_t - lo_t) * (rows - lo_rows) / (hi_rows - lo_rows)
        lo_rows, lo_t = hi_rows, hi_t
    return lo_t * rows / lo_rows


def draft_seconds(table: Sequence[float | None] | None, rows: Sequence[tuple[int, int]]) -> float | None:
    """A draft batch's seconds: one forward per draft position over the tasks still drafting.
    ``rows``: per task, (new rows of its first forward: the KV it lacks plus one, draft steps k)."""
    if not rows:
        return 0.0
    total = 0.0
    for step in range(max(k for _, k in rows)):
        new = sum(first if step == 0 else 1 for first, k in rows if k > step)
        t = estimate(table, new)
        if t is None:
            return None
        total += t
    return total


def choose_stage(drafts: Sequence[tuple[int, int]], verifies: Sequence[int], rooms: tuple[int, int],
                 draft_table: Sequence[float | None] | None, target_table: Sequence[float | None] | None) -> str | None:
    """``"draft"`` or ``"target"``: the stage an elastic worker runs with the tasks it could take
    from each topic (``drafts``: per task (first forward's rows, k), as ``draft_seconds``;
    ``verifies``: per task its new rows, the KV it lacks plus its token tree), ``rooms``: the most
    tasks of a draft batch and of a verify batch. None: neither has work.

    A full draft batch first, then a full verify batch: every round needs one task of each, so the
    device time a round costs is least when both run as full batches, and a draft batch grows for
    free while verification has a full batch to run (a small model's forward costs about as much
    for many rows as for one). With neither full (a light load), the stage whose batch does more
    tasks per second of this device, priced by the measured ``BatchCosts`` tables; before any
    forward is measured, the longer queue (verification on a tie)."""
    if not drafts or not verifies:
        return "draft" if drafts else "target" if verifies else None
    if len(drafts) >= rooms[0] or len(verifies) >= rooms[1]:
        return "draft" if len(drafts) >= rooms[0] else "target"
    draft_s = draft_seconds(draft_table, drafts)
    verify_s = estimate(target_table, sum(verifies))
    if draft_s is None or verify_s is None:
        return "draft" if len(drafts) > len(verifies) else "target"
    # tasks per second: a draft batch of len(drafts) in draft_s against a verify batch in verify_s
    return "draft" if len(drafts) * verify_s > len(verifies) * draft_s else "target"


def stage_of(drafts: list[Request], verifies: list[Request], rooms: tuple[int, int], held: Callable[[Request], int],
             draft_table: Sequence[float | None] | None, target_table: Sequence[float | None] | None) -> str | None:
    """``choose_stage`` for the queued requests an elastic worker could take from each topic;
    ``held``: the positions of a request's KV for its queued task some worker holds (pulled, not computed)."""
    def new_rows(r: Request) -> int:  # the committed positions its forward computes
        return max(1, len(r.prompt) + len(r.output) - held(r))

    return choose_stage([(new_rows(r), r.k) for r in drafts],
                        [new_rows(r) + len(r.draft) + len(r.runner_ups) + r.fuse for r in verifies], rooms,
                        draft_table, target_table)
