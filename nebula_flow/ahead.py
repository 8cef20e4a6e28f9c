"""Draft-ahead (SwiftSpec's drafting off the critical path): while round r verifies, a draft worker
that would otherwise idle pre-drafts round r + 1 for the verify outcomes most likely to come back.
Pure policy over the scheduler's state (no sockets, no clock), shared by the broker and the simulator.

A round-r draft d1..dk commits d1..dj plus one token of the target's (0 <= j <= k). The pre-draft
(an ``ahead`` task) covers up to ``draft_ahead`` outcomes, most likely first (``outcome_plan``):
the whole draft accepted plus the draft's own next token as its guess of the bonus token, then
d1..dj plus the draft's best other token at position j + 1 as its guess of the target's
correction, for j = 0, 1, ..., k - 1, then the whole draft plus its second guess of the bonus
token (k + 2 in all); then the same with the draft's next guesses at each position (SwiftSpec's
parallel tree of pre-drafts), up to ``AHEAD_GUESSES`` of the bonus token. For each outcome it
drafts the round after it (``k`` tokens, with the policy's runner-ups and fused chain), exactly
as a fresh round on those tokens would: every draw is ``uniform(seed, position, stream)``, so a
pre-draft on the prefix that is then committed *is* that round's draft.

When round r's verify commits an outcome that was pre-drafted, round r + 1 skips its draft: its
verify is queued at once with that branch, and the next pre-draft is queued for it (``take``). A
pre-draft still running when the verify returns may still hit, as long as round r + 1's draft has
not been handed to a worker (``done``). Pre-drafts are only handed to idle draft workers that got
no draft task at that PULL (``dispatch``), so they never take a draft's place, and only made while
the pool is light (``LIGHT_PER_TARGET``), covering fewer outcomes as each draft worker's share of
the pool grows (``outcomes``); those of an outcome that did not happen are dropped (``wasted``), and
a queued one whose round ended is cancelled. Adaptive k plans with the draft steps pre-drafts hide
(``planned_costs``).

A hit keeps the output identical to the same run without draft-ahead: the branch's draft is used
only where round r + 1 would draft the same thing (same drafter, its ``k`` no longer than the
branch's draft, the same runner-ups and fused chain asked for); otherwise round r + 1 drafts as usual.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from nebula_flow import speclen
from nebula_flow.protocol import AHEAD_GUESSES
from nebula_flow.request import DRAFT, Request
from nebula_flow.speclen import Acceptance

if TYPE_CHECKING:
    from nebula_flow.roles import WorkerState
    from nebula_flow.scheduler import Scheduler

MODES = ("pooled", "paired")  # where draft workers are idle while their rounds verify
# Draft-ahead buys latency below saturation and costs throughput above it: a hit's verify goes out
# ahead of its cohort's, splitting batches the targets then run half full (``merge_batches``), and
# its pre-draft batch delays the drafts that arrive meanwhile. Measured 2026-12-04 on a 2-core AMD
# EPYC VM (AVX2; configs/emulated-2d2t.toml: 2 draft + 2 target workers, pooled, draft_ahead = 6
# against 0, closed loop, no bound, two runs each, at 4957bb4: emulated caches no longer copy rows
# on the host): tokens/s 1.20x and 1.07x at 4 concurrent requests, 1.13x and 1.04x at 8, 0.88x and
# 0.95x at 16 (on 2026-12-02, before that fix: 1.05x at 8, 0.88x at 16, ~0.6x at 32 and 64). So
# pre-drafts are made only while the pool holds at most LIGHT_PER_TARGET requests per target worker.
LIGHT_PER_TARGET = 4
# A pre-draft batch runs to its end, so a draft that arrives meanwhile waits behind it; with more
# requests per draft worker that happens more, and pre-drafts then cover fewer outcomes, so their
# forwards hold fewer rows (and fewer requests' pre-drafts wait for a batch). Measured 2026-12-07 on
# the 2-core AMD EPYC VM (AVX-512; configs/emulated-2d2t.toml, 8 requests in flight, tokens/s against
# draft_ahead = 0): k = 6 with 22 outcomes 0.90x -> 0.95x live (0.93x -> 1.03x simulated); k = 4 with
# 16 outcomes 1.18x -> 1.17x live (1.23x -> 1.22x simulated); at most 4 requests in flight, unchanged.
FULL_COVER_PER_DRAFTER = 2


def outcome_plan(draft_len: int, wanted: int) -> list[tuple[int, int]]:
    """The verify outcomes a pre-draft of a ``draft_len``-token draft covers, most likely first, as
    (j, r): the first j draft tokens accepted, then the draft's r-th guess of the target's token
    there (after a rejection its guesses are its best tokens other than the rejected one; after the
    whole draft, its own next token first). Ordered by guess, then by accept length: each guess of
    the draft is less likely right than the one before, wherever it is made."""
    plan = [(draft_len, 1)]
    for level in range(2, AHEAD_GUESSES + 1):
        plan += [(j, level - 1) for j in range(draft_len)] + [(draft_len, level)]
    return plan[:wanted]


@dataclass
class Branch:
    """One pre-drafted outcome: the tokens round r's verify must commit, and round r + 1's draft
    after them (its proposal q for a sampled request, runner-ups, fused chain), by ``worker``."""

    assumes: list[int]
    draft: list[int]
    q: dict[str, Any] = field(default_factory=dict)
    runner_ups: list[int] = field(default_factory=list)
    chains: list[list[int]] = field(default_factory=list)
    worker: int = 0
    drafter: str | None = None


@dataclass
class Ahead:
    """A request's pre-draft of the round after ``round`` (whose draft is ``draft``): queued, in
    flight on ``worker``, or returned (``branches``); ``k``, ``alts``, ``fuse``: what it drafts, for
    how many ``outcomes`` of the verify (``outcomes``, when it was queued)."""

    round: int
    draft: list[int]
    attempt: int
    k: int
    alts: int
    fuse: int
    outcomes: int
    worker: int | None = None
    branches: list[Branch] | None = None


@dataclass
class AheadStats:
    """Counters for ``status`` and ``/metrics``: pre-draft tasks queued, branches made, rounds whose
    draft a branch was (``hits``; ``late_hits`` of them: the branch came after the verify), branches
    never used (``wasted``), pre-drafts dropped before they ran (``cancelled``) and those not made
    because the pool was too loaded for them to pay (``skipped``); ``hits_by_outcome``: the hits by
    the outcome's place in ``outcome_plan`` (how many outcomes ``draft_ahead`` needs to cover)."""

    tasks: int = 0
    branches: int = 0
    hits: int = 0
    late_hits: int = 0
    wasted: int = 0
    cancelled: int = 0
    skipped: int = 0
    hits_by_outcome: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def hit(self, outcome: int) -> None:
        self.hits += 1
        self.hits_by_outcome += [0] * (outcome + 1 - len(self.hits_by_outcome))
        self.hits_by_outcome[outcome] += 1


def on(sched: Scheduler) -> bool:
    return sched.policy.draft_ahead > 0 and sched.mode in MODES


def queue(sched: Scheduler, req: Request, worker_id: int) -> None:
    """Round ``req.round``'s draft arrived from ``worker_id``: queue the pre-draft of the next round
    (to that worker, which holds the draft KV), where one is wanted."""
    if not on(sched) or not req.draft or req.remaining <= 1:
        return
    old, stats = req.ahead, sched.ahead_stats
    if old is not None and old.branches is None:  # (an older round's, still queued or running: it can no longer hit)
        forget(sched, req.rid)
        stats.cancelled += 1
        req.ahead = None
    if not _light(sched):
        stats.skipped += 1
        return
    p = sched.policy
    # (attempts count over all pre-drafts: a result of a dropped one never passes for a later one)
    req.ahead = Ahead(req.round, list(req.draft), stats.tasks + 1, p.k, p.first_alternatives, p.fuse_ngram,
                      outcomes(sched))
    sched.topics["ahead"].append(req.rid, worker_id, req.params.priority)
    stats.tasks += 1


def outcomes(sched: Scheduler) -> int:
    """How many outcomes a pre-draft queued now covers: ``draft_ahead`` while the pool holds at most
    ``FULL_COVER_PER_DRAFTER`` requests per draft worker, else that share of it (the most likely
    outcomes: ``outcome_plan``)."""
    drafters = sum(w.role == "draft" for w in sched.workers.values()) or 1
    per_drafter = -(-len(sched.requests) // drafters)
    return max(1, sched.policy.draft_ahead * FULL_COVER_PER_DRAFTER // max(FULL_COVER_PER_DRAFTER, per_drafter))


def _light(sched: Scheduler) -> bool:
    """Whether the pool is light enough for pre-drafts to pay: at most ``LIGHT_PER_TARGET`` requests
    per verifying worker."""
    targets = sum(w.role == "target" for w in sched.workers.values())
    return len(sched.requests) <= LIGHT_PER_TARGET * max(1, targets)


def dispatch(sched: Scheduler, waiting: list[WorkerState], picks: dict[int, list[int]]) -> None:
    """Hand queued pre-drafts to the idle draft workers that got no draft task this time: the ones
    whose draft KV they hold, then any whose holder is gone (a pre-draft is never worth moving KV
    for), each of its request's drafter (paired: of its pair). A batch holds at most a draft batch's
    rows (its capacity over the outcomes each pre-draft covers), so a draft that comes meanwhile waits
    no longer than behind a draft batch; a busy worker takes none (it is not idle in the meantime)."""
    topic = sched.topics["ahead"]
    if not topic:
        return
    widest = max(sched.requests[rid].ahead.outcomes for rid in topic)  # (a batch's rows: its pre-drafts' outcomes)
    for w in waiting:
        if w.role != "draft" or picks.get(w.worker_id) or w.pull_credits <= 0 or not w.pull_idle:
            continue
        room = min(w.pull_credits, max(1, w.capacity // widest))
        chosen = []
        for rid in topic.held_by([w.worker_id, None, *(h for h in topic.holders() if h not in sched.workers)]):
            req = sched.requests[rid]
            if req.drafter == w.drafter and (sched.mode != "paired" or req.slot == w.slot):
                chosen.append(rid)
                if len(chosen) == room:
                    break
        if chosen:
            w.stage, picks[w.worker_id] = "ahead", chosen


def commit(sched: Scheduler, w: WorkerState, rids: list[int]) -> list[Request]:
    """``w`` takes these pre-drafts."""
    batch = []
    for rid in rids:
        sched.topics["ahead"].remove(rid)
        req = sched.requests[rid]
        req.ahead.worker = w.worker_id
        w.ahead[rid] = req.ahead.attempt
        batch.append(req)
    return batch


def accepts(sched: Scheduler, worker_id: int, rid: int, attempt: int) -> Request | None:
    """The request an ahead result belongs to, or None when it is stale or foreign."""
    w = sched.workers.get(worker_id)
    return sched.requests.get(rid) if w is not None and w.ahead.get(rid) == attempt else None


def done(sched: Scheduler, req: Request, worker_id: int, branches: list[Branch]) -> None:
    """A pre-draft came back. Before its verify has: kept for it. After it, while the next round's
    draft still waits in its topic: that round takes a matching branch now (a late hit)."""
    del sched.workers[worker_id].ahead[req.rid]
    st = req.ahead
    st.worker, st.branches = None, branches
    sched.ahead_stats.branches += len(branches)
    if st.round == req.round:
        return  # (its verify has not come back)
    draft_queued = req.phase == DRAFT and req.round == st.round + 1 and req.rid in sched.topics["draft"]
    if draft_queued and (branch := _match(req, st)) is not None:
        sched.topics["draft"].remove(req.rid)
        sched.ahead_stats.late_hits += 1
        _apply(sched, req, st, branch)
        _counted(sched, req, True)
        return
    sched.ahead_stats.wasted += len(branches)
    req.ahead = None
    if len(req.ks) > st.round and req.ks[st.round] > 0:  # (the round after it drafted, or drafts, after its verify)
        _counted(sched, req, False)


def last_match(st: Ahead, branches: list[Branch], req: Request) -> int | None:
    """Which of ``branches`` assumes what round ``st.round`` committed, once it has (the policy log
    records it: its replay has no real tokens)."""
    if st.round == req.round or not req.tokens_per_round:
        return None
    return next((i for i, b in enumerate(branches) if b.assumes == _last_committed(req)), None)


def take(sched: Scheduler, req: Request) -> bool:
    """Round ``req.round`` is starting with a draft: True when a pre-drafted branch is its draft
    (its verify is then queued); else the pre-draft is dropped, unless it is still running (then
    whether it hits is told when it returns: ``done``)."""
    st = req.ahead
    if st is None or st.round != req.round - 1:
        return _counted(sched, req, False)
    if st.branches is None:
        if st.worker is not None:  # (running: it may still hit, late)
            return False
        forget(sched, req.rid)  # still queued: too late to help
        sched.ahead_stats.cancelled += 1
        req.ahead = None
        return _counted(sched, req, False)
    branch = _match(req, st)
    if branch is None:
        sched.ahead_stats.wasted += len(st.branches)
        req.ahead = None
        return _counted(sched, req, False)
    _apply(sched, req, st, branch)
    return _counted(sched, req, True)


def _counted(sched: Scheduler, req: Request, hit: bool) -> bool:
    """``hit``, recorded in the request's rate of pre-drafted rounds (adaptive k plans with it:
    ``planned_costs``) where draft-ahead is on (not for its first round: nothing came before it)."""
    if on(sched) and req.round > 1:
        req.acceptance.update_ahead(hit)
    return hit


def planned_costs(sched: Scheduler, req: Request, acc: Acceptance,
                  costs: tuple[float, float, float]) -> tuple[float, float, float]:
    """The costs adaptive k plans ``req``'s round with (``acc``: its acceptance of the drafter
    weighed): under draft-ahead, a draft step weighs only as often as the request's rounds were not
    pre-drafted (``speclen.hiding``). Not for a seeded sampled request: its k decides the sample it
    draws, and whether a pre-draft hits depends on timing."""
    if not on(sched) or req.reproducible:
        return costs
    return speclen.hiding(costs, acc.ahead_rate)


def _match(req: Request, st: Ahead) -> Branch | None:
    """The branch that is exactly the draft round ``req.round`` would make, if any: of the drafter
    routing chose (paired mode routes nothing: its pair's)."""
    if req.k == 0 or req.k > st.k or req.alts not in (0, st.alts) or req.fuse not in (0, st.fuse):
        return None
    committed = _last_committed(req)
    return next((b for b in st.branches if b.assumes == committed and req.drafter in (None, b.drafter)  # (None: not routed)
                 and len(b.draft) >= req.k), None)


def _last_committed(req: Request) -> list[int]:
    """The tokens ``req``'s last verify committed."""
    return req.output[len(req.output) - req.tokens_per_round[-1]:]


def _apply(sched: Scheduler, req: Request, st: Ahead, branch: Branch) -> None:
    """Round ``req.round``'s draft is ``branch``'s (its first ``req.k`` tokens)."""
    sched.ahead_stats.hit(next(i for i, b in enumerate(st.branches) if b is branch))
    sched.ahead_stats.wasted += len(st.branches) - 1
    req.ahead = None
    draft = branch.draft[:req.k]
    sched.use_draft(req, branch.worker, draft, cut_proposal(branch.q, len(draft)), drafter=branch.drafter)
    req.runner_ups = branch.runner_ups if req.alts else []
    req.chains = branch.chains if req.fuse else []


def cut_proposal(q: dict[str, Any], n: int) -> dict[str, Any]:
    """A sampled draft's proposal (flat, as it travels) for its first ``n`` tokens."""
    if not q:
        return q
    lens = list(q["q_len"][:n])
    end = int(sum(lens))
    return {"q_idx": np.asarray(q["q_idx"][:end]), "q_prob": np.asarray(q["q_prob"][:end]), "q_len": lens}


def forget(sched: Scheduler, rid: int) -> None:
    """``rid``'s pre-draft is dropped, queued or running (its request finished, or a newer one
    replaces it): a result that still comes for it is stale."""
    if rid in sched.topics["ahead"]:
        sched.topics["ahead"].remove(rid)
    for w in sched.workers.values():
        w.ahead.pop(rid, None)


def unregister(sched: Scheduler, w: WorkerState) -> None:
    """A draft worker left: its running pre-drafts are lost (nothing waits on them; their requests
    draft as usual). Branches it made stay usable: a draft is tokens, and a verify needs no draft KV."""
    for rid in w.ahead:
        req = sched.requests.get(rid)
        if req is not None and req.ahead is not None and req.ahead.worker == w.worker_id:
            req.ahead = None
