"""Fused model drafters in the simulator (``nebula_flow/fusion.py``): a second draft is a draft task
of its own drafter's workers, and a fused round's verify scores the second chain's rows beside the
draft's. How far the second chain gets is its drafter's acceptance model's draw, made apart from
the first draft's: the two drafters fail independently here, the most a second chain can win (real
drafters of one target tend to fail on the same tokens; a live run's ``fusion`` counters say how
much less it wins)."""

from __future__ import annotations

from nebula_flow import fusion
from nebula_flow.request import DRAFT, Request
from nebula_flow.roles import WorkerState, holder_key
from nebula_flow.sim.acceptance import AcceptanceModel
from nebula_flow.sim.state import Outcome, SimTask

STREAM_SIM_SECOND = 13  # the second chain's acceptance draws, apart from the first draft's


def second_task(r: Request, w: WorkerState) -> SimTask | None:
    """The task of ``r``'s second draft, where ``w`` runs that (else None: its first)."""
    if not fusion.is_second(w, r):
        return None
    s = r.second
    return SimTask(r, DRAFT, s.attempt, r.round, len(r.prompt) + len(r.output), s.k,
                   r.holders.get(holder_key("draft", s.drafter)), drafter=s.drafter)


def second_chain(r: Request) -> tuple[str, int] | None:
    """A verify task's second chain (drafter, tokens), where its round is fused."""
    chain = fusion.chains(r)
    return (r.second.drafter, len(chain[0])) if chain else None


def outcome(model: AcceptanceModel, t: SimTask, first: Outcome) -> Outcome:
    """A fused round's outcome: the first draft's (``first``), or further along the second chain
    where that got further; records the second chain's own accepted tokens on ``t``."""
    _, n = t.second
    t.second_accepted = model.accepted(t.req.rid, t.round, n, STREAM_SIM_SECOND)
    accepted, via_alt, draft_accepted, fused = first
    return (t.second_accepted, False, draft_accepted, fused) if t.second_accepted > accepted else first
