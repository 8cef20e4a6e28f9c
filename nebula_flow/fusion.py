"""Fused model drafters (CoSine's fusion of several drafters in one round): a round routed to one
drafter may also go to a second model drafter at once; both draft on their own workers, in
parallel, and the second's draft joins the round's token tree as a chain beside the first's, so
one verify pass checks both. Pure policy over the scheduler's state (no sockets, no clock), shared
by the broker and the simulator.

The first draft (the drafter routing chose) stays the round's draft: its acceptance, its
proposal q and its KV are the round's as without fusion. The second is a chain of fixed tokens
(``specdec._sample_tree``): for a sampled request its tokens are drawn from its own model with
the request's ``uniform(seed, position, STREAM_DRAFT)``, never from the target's accept draws, so
the output still follows the target's distribution exactly, and a seeded request's output is a
function of its history whatever the placement. Greedy output stays the target's own.

Confidence decides the tree and whether to fuse at all: routing's most worthy drafter drafts
first (its q drives the accept tests), the second is the next most worthy model drafter, and a
round is fused only where the expected tokens per cost with the second chain's verify rows beat
the round without them (``fused_worth``; ``fuse_drafters = 2`` fuses every round, for tests and
benchmarks). A request learns what the second chain wins beyond the first (``Gain``), starting
from the pool's recent experience of that drafter's chains (unseeded requests), or before there is
any from what two independent drafters would win; the second's own acceptance is counted too, so
routing learns it as from its own rounds.

The second draft is a draft task (same wire kind; its attempt is negative, so it is never taken for
the first's): its worker pulls that drafter's KV and keeps it, trimmed after the verify to the
tokens of its chain the round committed. The verify waits for both drafts, but only for one that
is already running: if the first draft comes back while the second is still queued, the second is
dropped and the round verifies at once (except a seeded sample's, whose output must not depend on
timing). A second whose worker dies goes back to its topic with a new attempt; with no worker of its
drafter left it is dropped (the round verifies without it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from nebula_flow import routing, speclen
from nebula_flow.lookup import is_ngram
from nebula_flow.roles import holder_key
from nebula_flow.speclen import DECAY, Acceptance

if TYPE_CHECKING:
    from nebula_flow.request import Request
    from nebula_flow.roles import WorkerState
    from nebula_flow.scheduler import Scheduler

TOPIC = "second"
PRIOR_ROUNDS = 2.0  # where a second chain's gain starts (the pool's experience, or the independent estimate): this many rounds


@dataclass
class Second:
    """A round's second draft: its drafter and k, the attempt its task runs under (negative), the
    worker running it, its tokens once back, and whether the round's verify waits for it."""

    round: int
    drafter: str
    k: int
    attempt: int
    worker: int | None = None
    draft: list[int] | None = None
    holding: bool = False


@dataclass
class Gain:
    """Decayed tokens a second drafter's chain won beyond the first's, and the rounds it was verified."""

    won: float = 0.0
    rounds: float = 0.0

    def mean(self, prior: float) -> float:
        return (self.won + prior * PRIOR_ROUNDS) / (self.rounds + PRIOR_ROUNDS)

    def update(self, won: int, decay: float = DECAY) -> None:
        self.won, self.rounds = self.won * decay + won, self.rounds * decay + 1


@dataclass
class FusionStats:
    """Counters for ``status`` and ``/metrics``: second drafts asked for (``tasks``), re-queued after
    their worker died, dropped (still queued when the first came back, or no worker of the drafter
    left), fused rounds verified, the tokens second chains won beyond the first draft, and per
    drafter the fused rounds whose committed path went furthest along its chain (``won_by``; ties,
    where both chains got as far, are counted for neither). ``pool``: what each drafter's second
    chains won lately, for greedy and sampled requests apart (where a request starts; not reported)."""

    tasks: int = 0
    requeued: int = 0
    dropped: int = 0
    rounds: int = 0
    tokens_won: int = 0
    won_by: dict[str, int] = field(default_factory=dict)
    pool: dict[tuple[str, bool], Gain] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "pool"}


def on(sched: Scheduler) -> bool:
    return sched.policy.fuse_drafters > 0 and sched.mode == "pooled"


def independent_gain(a1: float, k1: int, a2: float, k2: int) -> float:
    """Mean tokens a chain of ``k2`` tokens each accepted with probability ``a2`` wins beyond a
    chain of ``k1`` at ``a1`` when the two fail independently: sum over depths j of P(the second
    reaches j and the first does not). Real drafters fail together more often (hard tokens are hard
    for both): an upper bound, which each request's own rounds then correct (``Gain``)."""
    return sum((1 - (a1 ** j if j <= k1 else 0.0)) * a2 ** j for j in range(1, k2 + 1))


def fused_worth(acc: Acceptance, k: int, alts: int, gain: float, costs: tuple[float, float, float],
                second_costs: tuple[float, float, float], verify: tuple[float | None, ...]) -> float:
    """Expected tokens per decode step of a round of ``k`` drafts (and ``alts`` runner-ups) with a
    second drafter's chain of ``k`` tokens beside it that wins ``gain`` tokens on average: its rows
    lengthen the verify; its draft runs beside the first, costing only what it takes longer."""
    draft_step, _, round_cost = costs
    tokens = speclen.expected_tokens(acc.rate, k) + ((1 - acc.rate) * acc.alt_rate if alts else 0.0) + gain
    drafting = max(k * draft_step, k * second_costs[0])
    return tokens / (round_cost - 1 + speclen.verify_cost(1 + k + alts + k, costs, verify) + drafting)


def plan(sched: Scheduler, req: Request) -> None:
    """Round ``req.round`` drafts with ``req.drafter``: also ask a second model drafter for a
    chain beside it, where that pays (or always, ``fuse_drafters = 2``)."""
    req.second = None
    if not on(sched) or req.k <= 0 or req.drafter is None or is_ngram(req.drafter) or req.drafter not in sched.drafters:
        return
    others = sorted(d for d in sched.drafters if d != req.drafter and not is_ngram(d))
    if not others:
        return
    costs, verify = sched.costs_for(req, req.drafter)
    best, best_worth = None, speclen.round_worth(req.acceptance, req.k, req.alts, costs, verify)
    for d in others:
        pool = None if req.reproducible else sched.drafter_acceptance.get((d, req.params.greedy))
        acc2 = routing.shrunk(req.by_drafter.setdefault(d, routing.starting_acceptance(pool)), pool)
        prior = independent_gain(req.acceptance.rate, req.k, acc2.rate, req.k)
        seen = None if req.reproducible else sched.fusion_stats.pool.get((d, req.params.greedy))
        gain = req.second_gain.get(d, Gain()).mean(seen.mean(prior) if seen is not None else prior)
        worth = fused_worth(req.acceptance, req.k, req.alts, gain, costs, sched.costs_for(req, d)[0], verify)
        if sched.policy.fuse_drafters == 2 and best is None or worth > best_worth:
            best, best_worth = d, worth
    if best is None:
        return
    stats = sched.fusion_stats
    stats.tasks += 1
    req.second = Second(req.round, best, req.k, -stats.tasks)
    sched.topics[TOPIC].append(req.rid, req.holders.get(holder_key("draft", best), (None, 0))[0], req.params.priority)


def holds_verify(sched: Scheduler, req: Request) -> bool:
    """The first draft of ``req``'s round is in: whether its verify waits for the second (only for
    one already running; a queued one is dropped now, it would only delay the round; but a seeded
    sample's waits for it even so: which chains its tree holds decides which sample it draws, and
    that must not depend on timing)."""
    second = req.second
    if second is None or second.round != req.round or second.draft is not None:
        return False
    if second.worker is None and not req.reproducible:
        _drop(sched, req)
        return False
    second.holding = True
    return True


def dispatch(sched: Scheduler, waiting: list[WorkerState], picks: dict[int, list[int]]) -> dict[int, set[int]]:
    """Hand queued second drafts to the draft workers of their drafter with room left after this
    dispatch's drafts, those holding the drafter's KV first; they join the worker's batch (added to
    ``picks``). Returns, per worker, the requests whose second draft it takes. A worker never takes
    both drafts of one request (a result names its request, and the attempt tells them apart)."""
    topic, out, taken = sched.topics[TOPIC], {}, set()
    for w in waiting:
        if not topic or w.role != "draft" or w.pull_credits <= 0 or w.stage != "draft":
            continue
        mine = picks.setdefault(w.worker_id, [])
        room = min(w.pull_credits, w.capacity) - len(mine)
        if room <= 0:
            continue
        chosen = set()
        for rid in topic.held_by([w.worker_id, None, *(h for h in topic.holders() if h != w.worker_id)]):
            req = sched.requests[rid]
            if rid not in taken and req.second.drafter == w.drafter and rid not in w.inflight and rid not in mine:
                chosen.add(rid)
                mine.append(rid)
                if len(chosen) == room:
                    break
        taken |= chosen
        if chosen:
            out[w.worker_id] = chosen
    return out


def commit(sched: Scheduler, w: WorkerState, req: Request) -> Request:
    """``w`` takes ``req``'s second draft (``dispatch`` chose it; a worker's batch the scheduler held
    back leaves it queued)."""
    sched.topics[TOPIC].remove(req.rid)
    req.second.worker = w.worker_id
    w.second[req.rid] = req.second.attempt
    return req


def is_second(w: WorkerState, req: Request) -> bool:
    """Whether ``w`` runs ``req``'s second draft (rather than its first)."""
    return req.rid in w.second and req.second is not None and req.second.worker == w.worker_id


def accepts(sched: Scheduler, worker_id: int, rid: int, attempt: int) -> Request | None:
    """The request a second draft's result belongs to, or None when it is not one (or stale)."""
    w = sched.workers.get(worker_id)
    return sched.requests.get(rid) if attempt < 0 and w is not None and w.second.get(rid) == attempt else None


def done(sched: Scheduler, req: Request, worker_id: int, draft: list[int] | None, prefilled: int | None = None) -> None:
    """A second draft came back: kept for the round's verify, queued now if it waited for this.
    None: it failed (the round verifies without it). ``prefilled``: its worker computed a chunk of the
    prompt (chunked prefill) and holds that many positions: it goes back to its topic for the rest,
    with a new attempt (a chunk's size depends on the batch it ran in: dropping it would make a seeded
    sample's tree depend on timing)."""
    del sched.workers[worker_id].second[req.rid]
    second = req.second
    if prefilled is not None:
        req.holders[holder_key("draft", second.drafter)] = (worker_id, prefilled)
        _requeue(sched, req, worker_id)
        return
    if draft is None:
        _drop(sched, req)
        return
    second.draft, second.worker = list(draft[:second.k]), None
    base = len(req.prompt) + len(req.output)
    req.holders[holder_key("draft", second.drafter)] = (worker_id, base + max(0, len(second.draft) - 1))
    if second.holding:
        second.holding = False
        sched.enqueue(req)


def chains(req: Request) -> list[list[int]]:
    """The second draft's chain for this round's token tree (none when there is no second)."""
    second = req.second
    return [second.draft] if second is not None and second.round == req.round and second.draft and req.draft else []


def verified(sched: Scheduler, req: Request, draft_accepted: int, via_alt: bool, second_accepted: int | None) -> None:
    """A fused round's verify is in (``second_accepted``: its chain's tokens on the committed path;
    None when the round verified no second chain): the second drafter's acceptance for the
    request and the pool, what it won beyond the first, and its KV's valid length."""
    second = req.second
    if second is None or second_accepted is None or not second.draft:
        return
    stats = sched.fusion_stats
    won = max(0, second_accepted - max(draft_accepted, int(via_alt)))
    stats.rounds += 1
    stats.tokens_won += won
    leader = second.drafter if won else req.drafter if draft_accepted > second_accepted else None
    if leader is not None:
        stats.won_by[leader] = stats.won_by.get(leader, 0) + 1
    req.second_gain.setdefault(second.drafter, Gain()).update(won)
    if not req.reproducible:  # (a seeded sample's plan must not depend on other requests)
        stats.pool.setdefault((second.drafter, req.params.greedy), Gain()).update(won, routing.POOL_DECAY)
    req.by_drafter.setdefault(second.drafter, Acceptance()).update(len(second.draft), second_accepted)
    if not req.reproducible:
        sched.drafter_acceptance.setdefault((second.drafter, req.params.greedy), Acceptance()).update(
            len(second.draft), second_accepted, routing.POOL_DECAY)
    req.drafter_used[second.drafter] = req.round
    key = holder_key("draft", second.drafter)
    if key in req.holders:
        holder, valid = req.holders[key]
        req.holders[key] = (holder, min(valid, len(req.prompt) + len(req.output) + second_accepted))


def _requeue(sched: Scheduler, req: Request, holder: int | None) -> None:
    """``req``'s second draft goes back to the front of its topic (``holder``: who holds the KV it
    needs) with a new attempt, so a result of the old one is stale."""
    sched.fusion_stats.tasks += 1
    req.second.worker, req.second.attempt = None, -sched.fusion_stats.tasks
    sched.topics[TOPIC].appendleft(req.rid, holder, req.params.priority)


def _drop(sched: Scheduler, req: Request) -> None:
    """The round goes without its second draft (queued when the first came back, or no worker of its
    drafter is left); a verify that waited for it is queued."""
    second, req.second = req.second, None
    sched.fusion_stats.dropped += 1
    if req.rid in sched.topics[TOPIC]:
        sched.topics[TOPIC].remove(req.rid)
    if second.worker is not None and second.worker in sched.workers:
        sched.workers[second.worker].second.pop(req.rid, None)
    if second.holding:
        sched.enqueue(req)


def forget(sched: Scheduler, rid: int) -> None:
    """``rid`` left the pool: its second draft, queued or running, is dropped (a late result is stale)."""
    if rid in sched.topics[TOPIC]:
        sched.topics[TOPIC].remove(rid)
    for w in sched.workers.values():
        w.second.pop(rid, None)


def unregister(sched: Scheduler, w: WorkerState) -> None:
    """A draft worker left: the second drafts it ran go back to their topic with new attempts, or are
    dropped where no worker of their drafter is left (then a verify waiting for one goes ahead)."""
    for rid in sorted(w.second):
        req = sched.requests.get(rid)
        if req is None or req.second is None:
            continue
        if req.second.drafter not in sched.drafters:
            _drop(sched, req)
            continue
        sched.fusion_stats.requeued += 1
        _requeue(sched, req, None)
    w.second.clear()
    for rid in list(sched.topics[TOPIC]):  # (queued ones whose drafter has no worker left)
        req = sched.requests[rid]
        if req.second.drafter not in sched.drafters:
            _drop(sched, req)
