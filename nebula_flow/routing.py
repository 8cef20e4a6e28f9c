"""Routing among several drafters: each round's draft goes to the drafter expected to commit the
most tokens per unit of cost for this request (CoSine's routing of requests to specialised
drafters, decided per round from what the request has shown). Pure.

A drafter is a kind of draft model: every draft worker registers with one (its ``--drafter``
name, by default its model's folder name), and the draft workers of one drafter share its KV.
Drafters differ in what they are good at (a general small model, one trained on code, a
prompt-lookup n-gram drafter that costs almost nothing but only helps where the output repeats
the context) and in what a draft step costs.

Per drafter, a request keeps its own acceptance (``speclen.Acceptance``); a drafter's worth for
it is ``speclen.best_round``'s expected tokens per decode step with that acceptance and that
drafter's measured costs. Before a request has tried a drafter it starts from the pool's
experience of that drafter (unseeded requests; ``POOL_DECAY``) or from the prior, and its own
counts are always weighed with the pool's rate (``shrunk``), so one unlucky round does not
condemn a good drafter until its next look. A drafter the request has gone
``EXPLORE_AFTER`` rounds without is tried again (an exploration round), so one that did badly for
it earlier, or joined later, gets another look; each exploration of a drafter that then loses
doubles the rounds until its next one, so a drafter that never pays for a request costs it a
handful of rounds, not one in every few.

Drafters are named by their workers (``drafter_name``); ``ngram`` specs name the model-free
prompt-lookup drafter (``workers/ngram.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from nebula_flow import ahead, speclen
from nebula_flow.lookup import is_ngram
from nebula_flow.protocol import DRAFTER_CHARS
from nebula_flow.request import DRAFT
from nebula_flow.speclen import PRIOR, Acceptance

if TYPE_CHECKING:
    from nebula_flow.request import Request
    from nebula_flow.roles import WorkerState
    from nebula_flow.scheduler import Scheduler

POOL_DECAY = 0.98  # per round, the pool's experience of a drafter (all requests' rounds: ~50 remembered)
POOL_WEIGHT = 4.0  # the pool's rate counts as this many rounds beside a request's own (``shrunk``)
EXPLORE_AFTER = 8  # rounds without a drafter before a request tries it again (doubling each time it loses)
def drafter_name(name: str | None, model: str | None) -> str:
    """A draft worker's drafter: ``name`` if given, else ``ngram`` for the n-gram drafter, else the
    model folder's name (workers that load the same checkpoint share a drafter, and its KV)."""
    if name:
        return name
    if model and is_ngram(model):
        return "ngram"
    return re.sub(f"[^{DRAFTER_CHARS}]", "_", Path(model.rstrip("/")).name)[:64] or "draft" if model else "draft"



def starting_acceptance(pool: Acceptance | None) -> Acceptance:
    """What a request knows of a drafter it has not tried: the pool's recent experience of it,
    or the prior. The pool's rate comes with the prior's weight, not the pool's many rounds, so
    the request's own rounds take over at once."""
    return shrunk(Acceptance(accepted=0.0, rejected=0.0), pool, sum(PRIOR)) if pool is not None else Acceptance()


def shrunk(own: Acceptance, pool: Acceptance | None, weight: float = POOL_WEIGHT) -> Acceptance:
    """A request's acceptance of a drafter as routing weighs it: its own decayed counts plus the
    pool's rate as ``weight`` pseudo-rounds. One unlucky round (no draft token of k accepted,
    a quarter of rounds at 75 % acceptance) then does not make the better drafter look worse than
    a cheap weak one for the rounds until its next look."""
    if pool is None:
        return own
    return replace(own, accepted=own.accepted + pool.rate * weight, rejected=own.rejected + (1 - pool.rate) * weight)


def choose_drafter(drafters: list[str], round_no: int, last_used: dict[str, int], gaps: dict[str, int],
                   worth: Callable[[str], float]) -> tuple[str, bool]:
    """(drafter, explore) for a request's round ``round_no`` (1, 2, ...): the one of most ``worth``, unless
    another has gone unused (``last_used``: drafter -> round; never: round 0) for its gap (``gaps``,
    default ``EXPLORE_AFTER``): then the one unused longest, whose gap doubles. The best's gap goes
    back to ``EXPLORE_AFTER``. Ties go to the name that sorts first, so the choice is a function of
    the request's history. Updates ``gaps``. ``explore``: the round is a look at a drafter that is
    not the best by its estimate (it should draft at least one token, or it shows nothing)."""
    if not drafters:
        raise ValueError("no drafters to choose from")
    names = sorted(drafters)
    if len(names) == 1:
        return names[0], False
    values = {d: worth(d) for d in names}
    best = max(names, key=lambda d: values[d])  # (max keeps the first of equals: sorted order)
    gaps[best] = EXPLORE_AFTER
    due = [d for d in names if d != best and round_no - last_used.get(d, 0) >= gaps.get(d, EXPLORE_AFTER)]
    if not due:
        return best, False
    explore = min(due, key=lambda d: last_used.get(d, 0))
    gaps[explore] = 2 * gaps.get(explore, EXPLORE_AFTER)
    return explore, True


def route(sched: Scheduler, req: Request, max_alts: int) -> tuple[str, bool, tuple[int, int] | None]:
    """(The scheduler's.) This round's drafter for ``req``, whether it is an exploration (``routing``), and with
    ``adaptive_k`` and several drafters the (k, alts) its worth was weighed at (else None);
    makes ``req.acceptance`` that drafter's."""
    names = list(sched.drafters)
    drafter, explore, plans = names[0], False, {}
    if len(names) > 1:
        # the pool's experience of each drafter (not for a seeded sample: it must not depend on
        # other requests): where a request starts one it has not tried, and what its own weighs with
        pools = {d: None if req.reproducible else sched.drafter_acceptance.get((d, req.params.greedy)) for d in names}
        for d in names:
            if d not in req.by_drafter:
                req.by_drafter[d] = starting_acceptance(pools[d])

        def worth(d: str) -> float:
            costs, verify = sched.costs_for(req, d)
            acc = shrunk(req.by_drafter[d], pools[d])
            if sched.policy.adaptive_k:
                costs = ahead.planned_costs(sched, req, acc, costs)
                worth, k, alts = speclen.best_round(acc, sched.policy.k, costs, max_alts, verify)
                plans[d] = (k, alts)
                return worth
            return speclen.round_worth(acc, sched.policy.k, max_alts, costs, verify)

        drafter, explore = choose_drafter(names, req.round, req.drafter_used, req.explore_gaps, worth)
    req.acceptance = req.by_drafter.setdefault(drafter, req.acceptance)
    return drafter, explore, plans.get(drafter)


def routed_to(sched: Scheduler, req: Request, w: WorkerState) -> bool:
    """Whether routing lets ``w`` take ``req``'s task: a draft routed to a drafter goes to that
    drafter's workers while it has any."""
    return req.phase != DRAFT or req.drafter is None or w.drafter == req.drafter or req.drafter not in sched.drafters
