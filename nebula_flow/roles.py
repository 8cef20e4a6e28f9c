"""Who takes which tasks: the modes, the worker roles each admits, the topics each role and stage
draws from, and where a request's KV is kept (pure data, shared by the scheduler, the broker,
the simulator and the deployment planner)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nebula_flow.request import DRAFT, ROUND, VERIFY

if TYPE_CHECKING:
    from nebula_flow.request import Request

# mode -> the worker roles it admits (any: holds both models and takes either stage; elastic)
MODES: dict[str, tuple[str, ...]] = {
    "pooled": ("draft", "target"),
    "paired": ("draft", "target"),
    "colocated": ("colocated",),
    "autoregressive": ("target",),
    "elastic": ("any", "draft", "target"),
}
PHASE_ROLE = {DRAFT: "draft", VERIFY: "target", ROUND: "colocated"}
# the topics a worker of each role takes tasks from, and the models it runs (whose costs it reports)
ROLE_TOPICS = {"draft": ("draft",), "target": ("target",), "colocated": ("colocated",), "any": ("draft", "target")}
# (elastic rounds: drafts; ahead: pre-drafts of the next round, draft-ahead)
STAGE_TOPIC = {"draft": "draft", "target": "target", "colocated": "colocated", "round": "draft", "ahead": "ahead"}
MODEL_ROLES = {"draft": ("draft",), "target": ("target",), "colocated": ("draft", "target"), "any": ("draft", "target")}
DEFAULT_DRAFTER = "draft"  # a draft worker that names no drafter


@dataclass
class WorkerState:
    """A worker as the policy sees it: its role, pair/colocated slot, batch capacity, tasks in
    flight and the PULL waiting at the broker."""

    worker_id: int
    role: str
    slot: int
    capacity: int
    inflight: set[int] = field(default_factory=set)
    pull_credits: int = 0  # > 0 while a PULL waits
    pull_idle: bool = False
    pull_since: float = 0.0
    drafter: str | None = None  # draft workers: which drafter (kind of draft model) it runs
    stage: str | None = None  # what its waiting PULL is served (a topic's tasks; elastic: chosen per PULL, or round)
    draft_capacity: int | None = None  # elastic workers: the most tasks of a draft batch (else ``capacity``)
    ahead: dict[int, int] = field(default_factory=dict)  # request -> attempt: the pre-drafts it runs (draft-ahead)
    second: dict[int, int] = field(default_factory=dict)  # request -> attempt: the second drafts it runs (fusion)


def holder_key(role: str, drafter: str | None = None) -> str:
    """The key of ``Request.holders`` for a role's KV: per drafter for drafts (drafters' KV differ)."""
    return f"draft/{drafter}" if role == "draft" and drafter not in (None, DEFAULT_DRAFTER) else role


def least_loaded_slot(mode: str, workers: Iterable[WorkerState], requests: Iterable[Request]) -> int | None:
    """Paired and colocated modes: the slot (pair, or colocated worker) that exists now with the
    fewest requests bound to it (ties: the lowest), or None while there is none; elastic mode: the
    elastic worker that is home to the fewest."""
    role = "any" if mode == "elastic" else MODES[mode][-1]
    load = dict.fromkeys(sorted({w.slot for w in workers if w.role == role}), 0)
    for r in requests:
        if r.slot in load:
            load[r.slot] += 1
    return min(load, key=lambda s: (load[s], s)) if load else None
