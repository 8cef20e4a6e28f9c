"""Elastic roles: what a worker that holds both models runs next (pure: no clock, no torch).

In ``elastic`` mode every worker that holds both models (role ``any``) pulls from both topics,
and at each PULL the scheduler gives it a draft batch, a verify batch, or whole rounds
(``choose_stage``). Below saturation it runs whole rounds, as a colocated worker does (no hop
splits a round, so a request's latency is a colocated one's). Once the queues fill, the stages
split: drafts wait until they fill one large batch merged across requests (a small model's
forward costs little more for many rows than for one) while every device verifies, which is
where the time goes when verification is the bottleneck. Whether merging pays is read from the
forward times each worker measured by batch rows (``BatchCosts``): on a CPU, where a forward
grows with its rows, it does not, and rounds stay whole.

Where a request's work goes (``home``, ``balance.Steals``): each request has a home, the elastic worker
it was bound to on arrival as colocated requests are (the least loaded), so every worker keeps a
full pipeline of its own requests and their KV stays put. A worker merges only its own requests'
drafts (another's draft KV would move there and back again). An idle worker with none of its own
takes others' work only while moving their KV costs less than a verify batch, priced by the
seconds per KV position the workers measured pulling (``balance.observe_pulls``): on a fast link that
rebalances, on a slow one (loopback TCP on a busy host) it would cost more than it saves. A
request run as a whole round elsewhere makes that worker its home.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from nebula_flow import speclen
from nebula_flow.request import VERIFY, Request
from nebula_flow.roles import WorkerState

if TYPE_CHECKING:
    from nebula_flow.scheduler import Scheduler

BUCKETS = tuple(1 << i for i in range(13))  # forwards priced by their new rows: 1, 2, 4, ... 4096
WEIGHT = 0.2  # the newest forward's weight in its bucket's moving mean
MERGE_GAIN = 0.75  # stages split where a merged draft batch costs a task at most this much of a round's


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


def choose_stage(drafts: Sequence[tuple[int, int]], verifies: int, bare: int, rooms: tuple[int, int],
                 draft_table: Sequence[float | None] | None, split_at: int = 0) -> str | None:
    """What an elastic worker runs next with the tasks it could take from each topic: ``"draft"``
    (a draft batch), ``"target"`` (a verify batch), ``"round"`` (draft-topic tasks as whole rounds,
    drafted and verified in one batch on this worker, as a colocated worker runs them), or None
    (nothing queued).

    ``drafts``: per queued draft, (its first forward's rows, k), as ``draft_seconds``; ``verifies``:
    queued verifications of a draft; ``bare``: queued draft-less ones (a request's last round, run
    as a round); ``rooms``: the most tasks of a draft batch and of a verify (or round) batch;
    ``draft_table``: this device's draft forwards by rows (``BatchCosts.table``); ``split_at``: the
    policy's ``elastic_split`` (> 0: split once that many drafts are queued, whatever the costs).

    Whole rounds, unless the queued drafts fill a draft batch larger than a round batch and the
    measured costs say merging them pays (``merging_pays``): then the stages split, the drafts run
    as one batch merged across requests, and every device verifies the rest of the time, which is
    where a saturated deployment's time goes. Queued verifications go before rounds: they finish
    rounds already started. A whole round has no hop or queue inside it: a request's latency is a
    colocated worker's."""
    if not drafts and not verifies and not bare:
        return None
    if split_at and len(drafts) >= split_at or not split_at and len(drafts) >= rooms[0] > rooms[1] \
            and merging_pays(draft_table, drafts[: rooms[0]], rooms[1]):
        return "draft"
    return "target" if verifies else "round"


def merging_pays(draft_table: Sequence[float | None] | None, drafts: Sequence[tuple[int, int]], round_batch: int) -> bool:
    """Whether drafting ``drafts`` in one batch costs a task at most ``MERGE_GAIN`` of what it costs in
    a round's batch of ``round_batch`` (unmeasured: assumed, the common case of a small draft model
    on a GPU; a CPU's forward grows with its rows, and there rounds stay whole)."""
    merged, alone = draft_seconds(draft_table, drafts), draft_seconds(draft_table, drafts[:round_batch])
    if merged is None or alone is None:
        return True
    return merged / len(drafts) <= MERGE_GAIN * alone / min(round_batch, len(drafts))


def stage_of(drafts: list[Request], verifies: list[Request], rooms: tuple[int, int], held: Callable[[Request], int],
             draft_table: Sequence[float | None] | None, split_at: int = 0) -> str | None:
    """``choose_stage`` for the queued requests an elastic worker could take from each topic;
    ``held``: the positions of a request's KV for its queued task some worker holds (pulled, not
    computed)."""
    drafted = sum(1 for r in verifies if r.draft)
    return choose_stage([(max(1, len(r.prompt) + len(r.output) - held(r)), r.k) for r in drafts], drafted,
                        len(verifies) - drafted, rooms, draft_table, split_at)


def home(req: Request, held: int | None, homes: Mapping[int, int], workers: Mapping[int, WorkerState]) -> int | None:
    """The worker an elastic request's queued task stays with while that worker is busy: a draft
    whose KV a draft-only worker holds stays with it (pooled drafting); a draft or round otherwise
    with the request's home, the elastic worker it was bound to as colocated requests are (the
    least loaded when it came, or the last to run it as a whole round), so every elastic worker
    keeps a full pipeline of its own requests and their KV stays put; a verify with its target KV's
    holder. ``held``: the holder of the KV the task needs."""
    if req.phase == VERIFY or held is not None and held in workers and workers[held].role == "draft":
        return held
    return homes.get(req.slot, held) if req.slot is not None else held


def choose_rounds(sched: Scheduler, w: WorkerState, room: int, held_only: bool, taken: set[int]) -> list[int]:
    """Up to ``room`` queued whole rounds for elastic worker ``w``: with drafts (the draft topic's) and
    draft-less (the target topic's: a request's last round, or one adaptive k leaves without a draft).
    The draft-less go first, unless the others are more urgent (``priority_scheduling``): second, they
    waited as long as drafts kept coming, a request's last token behind every other request's rounds."""
    order = [(sched.topics["target"], True), (sched.topics["draft"], False)]
    if order[1][0].head_priority() < order[0][0].head_priority():
        order.reverse()
    chosen: list[int] = []
    for topic, draftless in order:
        if len(chosen) < room and len(topic):
            chosen += sched._choose_from(topic, w, "round", room - len(chosen), held_only, taken, bare=draftless)
    return chosen


def worker_table(sched: Scheduler, w: WorkerState, role: str) -> list[float | None] | None:
    """``w``'s forward times by batch rows for ``role``'s model, or the median worker's until it has some."""
    return sched.batch_costs.get((w.worker_id, role)) or speclen.median_table(
        [t for (_, r), t in sched.batch_costs.items() if r == role])


def stage(sched: Scheduler, w: WorkerState, taken: set[int], choose: Callable[..., list[int]]) -> str | None:
    """What an elastic worker's PULL is served this time (``choose_stage``), priced by its own draft
    batch costs; ``choose``: the scheduler's pick of the queued tasks it could take from a topic."""
    if w.role != "any":
        return None
    rooms = sched._room(w, "draft"), sched._room(w, "target")
    drafts, verifies = ([sched.requests[rid] for rid in choose(w, room, False, taken, topic)]
                        for room, topic in zip(rooms, ("draft", "target")))  # (verifies: and draft-less rounds)
    chosen = stage_of(drafts, verifies, rooms, lambda r: r.holders.get(sched.task_holder_key(r), (None, 0))[1],
                      worker_table(sched, w, "draft"), sched.policy.elastic_split)
    # (drafts merge only its own: with none of its own, an idle worker may take others' whole rounds)
    return chosen or ("round" if w.pull_idle and choose(w, rooms[1], False, taken, "round") else None)


def unregister(sched: Scheduler, w: WorkerState) -> None:
    """``w`` left: its requests have no home until a worker runs them as a round (or one takes its slot)."""
    sched.homes = {slot: wid for slot, wid in sched.homes.items() if wid != w.worker_id}
