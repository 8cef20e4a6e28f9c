"""Draft-ahead in the simulator: a pre-draft's forwards, and the verify outcomes its branches bet
on, as ``ModelRunner.predraft`` makes them; the policy is the live one (``nebula_flow/ahead.py``).

Simulated tokens are placeholders, so a round's last committed token says which of the draft's
guesses the target's token was (``AcceptanceModel.guessed``), and a branch assumes the draft's
tokens plus the guess it drafted after: the live policy then matches branches to what a verify
committed exactly as it does with real tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from nebula_flow.ahead import Branch, outcome_plan
from nebula_flow.protocol import AHEAD_GUESSES
from nebula_flow.sim.acceptance import AcceptanceModel
from nebula_flow.sim.state import PLACEHOLDER, Outcome, SimTask, SimWorker

# The token a simulated round commits after its accepted drafts: which of the draft's guesses it was
# (1, 2, ...: ``AcceptanceModel.guessed``), or none (also after a runner-up or a fused chain won: no
# pre-draft covers those paths).
UNGUESSED = AHEAD_GUESSES + 1


def last_token(acceptance: AcceptanceModel, task: SimTask, outcome: Outcome) -> int:
    """The last token of a verified round (the target's own): which guess of the draft it was."""
    accepted, via_alt, _, fused = outcome
    if via_alt or fused:
        return UNGUESSED
    return acceptance.guessed(task.req.rid, task.round, accepted, task.k) or UNGUESSED


def outcomes(draft_len: int, wanted: int) -> list[list[int]]:
    """The outcomes a pre-draft of a ``draft_len``-token draft covers, most likely first, as the live
    runner orders them (``ahead.outcome_plan``): placeholders for the accepted draft tokens, then the
    rank of the draft's guess of the target's token after them."""
    return [[PLACEHOLDER] * j + [rank] for j, rank in outcome_plan(draft_len, wanted)]


Forward = Callable[..., float]  # Simulator._forward_s: (cost, batch, tokens, context, seen) -> seconds


def run(w: SimWorker, tasks: list[SimTask], forward_s: Forward,
        drafter: str | None) -> tuple[float, list[tuple[SimTask, list[Branch]]]]:
    """A batch of pre-drafts on draft worker ``w`` (of ``drafter``, as the policy names it): one
    forward re-scores each draft (with whatever of its KV is missing), then ``k`` forwards draft
    every outcome side by side. A task whose KV is not here is skipped (no branches), as live.
    Returns the seconds and each task's branches."""
    cost, cache = w.costs["draft"], w.caches["draft"]
    ready: list[SimTask] = []
    results: list[tuple[SimTask, list[Branch]]] = []
    for t in tasks:
        if cache.get(t.req.rid, 0) + t.draft_len + 1 >= t.length:
            ready.append(t)
        else:
            results.append((t, []))
    if not ready:
        return 0.0, results
    have = [min(cache.get(t.req.rid, 0), t.length - 1) for t in ready]
    scored = [t.length + t.draft_len for t in ready]
    bets = [outcomes(t.draft_len, t.outcomes) for t in ready]
    seconds = forward_s(cost, len(ready), sum(s - h for s, h in zip(scored, have)), sum(scored), w.batch_costs["draft"])
    for step in range(max(t.k for t in ready)):
        rows = sum(len(b) for t, b in zip(ready, bets) if t.k > step)
        context = sum(len(b) * (s + 1 + step) for t, b, s in zip(ready, bets, scored) if t.k > step)
        seconds += forward_s(cost, rows, rows, context, w.batch_costs["draft"])
    for t, s, assumed in zip(ready, scored, bets):
        cache[t.req.rid] = s + t.k - 1  # (the first outcome drafts on in the request's own cache)
        results.append((t, [Branch(a, [PLACEHOLDER] * t.k, worker=w.wid, drafter=drafter) for a in assumed]))
    return seconds, results
