"""Sharing the pool among the workers of one role, and moving KV only where it pays (pure: no clock).

Dispatch serves the worker idle the shortest first, and with ``locality`` a worker first takes the
tasks whose KV it holds. Alone, those two rules let one worker keep every request it ever held: at
each batch's end it takes all of its own back, and while it is busy its held tasks wait for it
(``Scheduler.holds_back``: no small batch beside a bigger running one). A worker that joined later
(one ``serve`` restarted after a death, or one added under load) then sat idle beside it until new
requests came. Two rules share the pool:

* **Release** (``release``; pooled and autoregressive): the tasks a busy worker picked but may not
  take yet go to the idle workers instead of waiting for it.
* **Spreading** (``spreads``; elastic): where several elastic workers are idle at once, each takes its
  own rounds only up to its share of the pool (``share``) until the others have had their turn; a
  last pass gives each what is left of its own, so no task waits because of it. (Tried for pooled
  and autoregressive workers too: simulated with prompts sharing documents, autoregressive p99
  latency 6.8 -> 10.1 s; release alone gives a restarted one its part there.)

Either moves a task's KV to the worker that takes it only while the moves cost less than one batch
of that worker's own (``Steals``), priced by the seconds per KV position workers measured pulling
(``observe_pulls``): on a fast link the pool rebalances, on a slow one the tasks stay with their
holder. An idle elastic worker's whole rounds are priced the same way (``nebula_flow/elastic.py``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING

from nebula_flow import elastic
from nebula_flow.elastic import estimate, worker_table
from nebula_flow.request import DRAFT, ROUND, Request
from nebula_flow.roles import WorkerState

if TYPE_CHECKING:
    from nebula_flow.scheduler import Scheduler

# (paired and colocated bind each request to one slot; not elastic: a round an idle elastic worker takes makes it
# the request's home for good, and on mixed devices a slow one took requests from a fast one's next batch:
# simulated hetero-2d2t with 4 elastic workers, 0.97x)
RELEASE_MODES = ("pooled", "autoregressive")


def serve(sched: Scheduler, waiting: list[WorkerState], picks: dict[int, list[int]], taken: set[int]) -> None:
    """The passes of a dispatch (``Scheduler.dispatch``) over the ``waiting`` workers, in their order: with
    ``locality`` the tasks each holds first, then any; spreading, a last pass of held tasks; then ``release``.
    ``picks``: worker -> the queued tasks it takes, ``taken``: all of them, both filled in."""
    passes, spread = (True, False) if sched.policy.locality else (False,), spreads(sched, waiting)
    for i, held_only in enumerate(passes + ((True,) if spread else ())):
        sched.sharing = spread if i < len(passes) else frozenset()  # (the last: each what is left of its own)
        serve_pass(sched, waiting, picks, taken, held_only)
    sched.sharing = frozenset()
    release(sched, waiting, picks, taken)


def serve_pass(sched: Scheduler, waiting: list[WorkerState], picks: dict[int, list[int]], taken: set[int],
               held_only: bool) -> None:
    """One pass over the ``waiting`` workers in turn: each takes what it may of what is left (an elastic
    worker's stage is chosen at its first turn, from the tasks left to it: ``elastic.stage``)."""
    for w in waiting:
        w.stage = w.stage or elastic.stage(sched, w, taken, sched._choose)
        room = sched._room(w, w.stage) - len(picks.get(w.worker_id, []))
        if room > 0 and w.stage is not None:
            got = sched._choose(w, room, held_only, taken)
            picks.setdefault(w.worker_id, []).extend(got)
            taken.update(got)


def spreads(sched: Scheduler, waiting: Sequence[WorkerState]) -> frozenset[int]:
    """The workers that share their held rounds by turns in this dispatch (``Scheduler.sharing``): the
    elastic ones among ``waiting`` where more than one is idle. (Forced migration, a test knob, moves
    every task anyway: the holder may not take back what the others leave.)"""
    if sched.mode != "elastic" or sched.policy.migrate:
        return frozenset()
    elastic_workers = [w for w in waiting if w.role == "any"]
    idle = sum(w.pull_idle for w in elastic_workers)
    return frozenset(w.worker_id for w in elastic_workers) if idle > 1 else frozenset()


def share(sched: Scheduler, w: WorkerState, stage: str, room: int) -> int:
    """How many more tasks ``w`` takes, of a ``stage`` batch with ``room`` left, before the others of its
    role have had theirs: its even share of the pool, less what it runs and took already."""
    peers = sum(o.role == w.role for o in sched.workers.values())
    return -(-len(sched.requests) // max(1, peers)) - (sched._room(w, stage) - room) - len(w.inflight)


def release(sched: Scheduler, waiting: list[WorkerState], picks: dict[int, list[int]], taken: set[int]) -> None:
    """Give the tasks that busy workers picked but may not take yet (``Scheduler.holds_back``) to the
    idle workers with room, as far as ``Steals`` allows; the rest stay picked by their busy worker."""
    if sched.mode not in RELEASE_MODES or sched.policy.migrate:
        return
    idle = [w for w in waiting if w.pull_idle]  # (first: most dispatches have none, and it costs less)
    held = [w for w in waiting if sched.holds_back(w, picks.get(w.worker_id))] if idle else []
    if not held:
        return
    released = {rid for w in held for rid in picks[w.worker_id]}
    taken -= released
    sched.sharing = frozenset(w.worker_id for w in held)
    try:
        serve_pass(sched, idle, picks, taken, held_only=False)
    finally:
        sched.sharing = frozenset()
    moved = {rid for w in idle for rid in picks.get(w.worker_id, ())} & released
    for w in held:
        picks[w.worker_id] = [rid for rid in picks[w.worker_id] if rid not in moved]
    taken |= released


def observe_pulls(sched: Scheduler, worker_id: int, seconds: object, positions: object) -> None:
    """A worker's KV pulls so far (its RESULT's ``kv.pull_s`` and ``kv.pulled``): what moving a position
    to it costs (``Steals``). Anything but numbers, or no pulls yet: left as it was."""
    if worker_id in sched.workers and type(positions) is int and positions > 0 and type(seconds) in (int, float):
        sched.pull_rates[worker_id] = max(0.0, float(seconds)) / positions


class Steals:
    """What idle worker ``w`` may take of others' queued tasks in one batch: tasks whose KV another
    live worker holds, while the moves add up to no more than one batch of its own (the forwards of
    the bucket below a full batch's rows: a verify, or a draft's k steps), about what the tasks would
    otherwise wait for their holders. A batch's pulls run one after another before it starts, so on a
    fast link a rebalance pays, on a slow one it does not. A move costs the positions held elsewhere
    that the task needs (an elastic round: both models'), at the seconds per position ``w`` measured
    pulling (or the median worker's); before any pull is measured, the whole budget: one such task
    per batch, which measures the link. None while results of ``w``'s own are still to come (it is
    not short of work: its PULL overtook them). No measured batch: no bound. The budget and the
    rate are priced at the first task held elsewhere (most picks meet none)."""

    def __init__(self, sched: Scheduler, w: WorkerState) -> None:
        self.sched, self.w, self.moving = sched, w, 0.0

    @cached_property
    def budget(self) -> float:
        k = self.sched.policy.k
        drafts = self.w.role == "draft"
        rows = self.w.capacity * (1 if drafts else k + 1)
        batch = estimate(worker_table(self.sched, self.w, "draft" if drafts else "target"),
                         1 << (max(rows, 1).bit_length() - 1))
        return math.inf if batch is None else batch * (max(k, 1) if drafts else 1)

    @cached_property
    def rate(self) -> float:
        pulls = self.sched.pull_rates
        return pulls.get(self.w.worker_id) or (statistics.median(pulls.values()) if pulls else 0.0)

    def take(self, req: Request) -> bool:
        """Whether ``w`` takes ``req``'s task, held by another live worker (its moves are then counted)."""
        if self.w.inflight:
            return False
        if not self.rate:
            moves = self.budget if self.budget < math.inf else 0.0
        else:
            moves = self.rate * sum(n for wid, n in (req.holders.get(key, (None, 0)) for key in self._keys(req))
                                    if wid is not None and wid != self.w.worker_id)
        if self.moving + moves > self.budget:
            return False
        self.moving += moves
        return True

    def _keys(self, req: Request) -> set[str]:
        """The ``holders`` keys of the KV ``w`` needs for ``req``'s task: a draft worker's, the draft
        model's; a target worker's, the target's; an elastic worker's, both for a draft or a round."""
        own = {self.sched.task_holder_key(req)} if req.phase in (DRAFT, ROUND) else set()
        return own if self.w.role == "draft" else {"target"} | (own if self.w.role == "any" else set())
