"""Who takes which tasks: the modes, the worker roles each admits, the topics each role and stage
draws from, and where a request's KV is kept (pure data, shared by the scheduler, the broker,
the simulator and the deployment planner)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nebula_flow.request import DRAFT, ROUND, VERIFY

if TYPE_CHECKING:
    from nebula_flow.policy import PolicyConfig
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
# mode -> each stage its rounds cannot do without, and the roles that take it (``unserved``)
STAGES_NEEDED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "pooled": (("draft", ("draft",)), ("verify", ("target",))),
    "paired": (("draft", ("draft",)), ("verify", ("target",))),
    "colocated": (("round", ("colocated",)),),
    "autoregressive": (("verify", ("target",)),),
    "elastic": (("draft", ("any", "draft")), ("verify", ("any", "target"))),
}
# the topics a worker of each role takes tasks from, and the models it runs (whose costs it reports)
ROLE_TOPICS = {"draft": ("draft",), "target": ("target",), "colocated": ("colocated",), "any": ("draft", "target")}
# (elastic rounds: drafts; ahead: pre-drafts of the next round, draft-ahead)
STAGE_TOPIC = {"draft": "draft", "target": "target", "colocated": "colocated", "round": "draft", "ahead": "ahead"}
MODEL_ROLES = {"draft": ("draft",), "target": ("target",), "colocated": ("draft", "target"), "any": ("draft", "target")}
DEFAULT_DRAFTER = "draft"  # a draft worker that names no drafter
# A prompt token's work against an output token's, when binding requests to workers: a prompt is
# computed hundreds of tokens to a forward, an output token in a round of its own. On the paper's
# GPUs (RTX 4090, Qwen3-8B) a prefilled token costs ~0.15 ms of device time and an output token
# its request's share of a verify batch, ~0.4 ms; on a CPU the two are closer, so this is a round
# middle: what matters is that a 2,000-token prompt weighs more than a 30-token answer.
PROMPT_WEIGHT = 0.25


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


def unserved(mode: str, workers: Iterable[tuple[str, int]]) -> str | None:
    """Why requests of ``mode`` cannot progress with these registered ``workers`` (role, slot), or
    None where they can: a stage no worker takes, or (paired) no draft and target of one slot. What
    the HTTP API's ``/health`` answers 503 for and ``status`` warns of (all targets gone, say)."""
    workers = list(workers)
    roles = {role for role, _ in workers}
    for stage, takers in STAGES_NEEDED.get(mode, ()):
        if not roles & set(takers):
            return f"no worker takes the {stage} stage (role {' or '.join(takers)}): requests wait until one registers"
    if mode == "paired" and not {s for r, s in workers if r == "draft"} & {s for r, s in workers if r == "target"}:
        return "no draft and target worker of one slot (a pair): requests wait until one registers"
    return None


def unserved_in(state: Mapping[str, Any]) -> str | None:
    """``unserved`` for a broker's status (``Client.status``: its mode and registered workers)."""
    return unserved(state["mode"], [(w["role"], w["slot"]) for w in state.get("workers", [])])


def holder_key(role: str, drafter: str | None = None) -> str:
    """The key of ``Request.holders`` for a role's KV: per drafter for drafts (drafters' KV differ)."""
    return f"draft/{drafter}" if role == "draft" and drafter not in (None, DEFAULT_DRAFTER) else role


def bound_work(req: Request, key: str, slots: dict[int, int], slot: int | None, elsewhere: float = 0.0) -> float:
    """The work ``req`` brings ``slot`` (``outstanding``), less the prefill its placement expects to save
    there (where its prompt's start is likely held, ``prefixes.py``; holder ``key``; ``slots``: worker
    -> slot): all of it on that worker, ``elsewhere`` of it on any other (pulled there: 1 less the
    policy's ``prefix_pull_cost``; 0 without ``prefix_pulls``). Counted on the holder's worker alone,
    every request on one document queued there while the other workers idled (docs/benchmarks.md,
    "The simulator with shared prompt starts"). The same whether counted as it is bound or over the pool later:
    counted at full prompt while it waits, a chat's next turn made its own worker look busier than
    the other by a prompt it will not compute, and the next turn of another chat left the worker
    that held its KV."""
    work = outstanding(req)
    near, saved = req.affinity.get(key, (None, 0))[:2]
    share = 1.0 if slot is not None and slots.get(near) == slot else elsewhere
    if saved and share:
        held = max((valid for _, valid in req.holders.values()), default=0)
        work -= share * PROMPT_WEIGHT * max(0, min(saved, len(req.prompt)) - held)
    return work


def outstanding(req: Request) -> float:
    """The work a request still brings a worker, in output tokens: the output to come (at most; it
    may stop sooner) and its prompt positions no model's KV holds yet at ``PROMPT_WEIGHT`` each.
    Binding by requests alone left workers idle for the last sixth of a saturated replay of the
    Azure code trace (prompts of 100 to 8,000 tokens) while others still prefilled theirs."""
    held = 0
    for _, valid in req.holders.values():  # (a loop, not max() over a generator: it runs per request per admission)
        held = valid if valid > held else held
    return req.params.max_new_tokens - len(req.output) + PROMPT_WEIGHT * max(0, len(req.prompt) - held)


class Binder:
    """Where paired, colocated and elastic requests are bound: each to the slot (pair, colocated
    worker; elastic: the elastic worker that is its home) that exists now with the least work bound
    to it (``outstanding``; ties: the lowest). The work per slot is counted over the pool once per
    ``REFRESH``-th of its size in bindings and kept up in between by what each binding adds, so a
    burst of N arrivals, or a worker registering under a backlog of N, costs O(N), not O(N^2) (a
    worker registering under 5,000 waiting requests took 2 s of the broker's thread counting them
    one by one, 14 s weighing them). In between, the progress of running requests is not seen: a
    slot's work is what was counted plus what was bound to it since."""

    REFRESH = 16

    def __init__(self) -> None:
        self.load: dict[int, float] | None = None
        self.since = 0  # bindings since the work was counted

    def reset(self) -> None:
        """The slots changed (a worker came or went): count again at the next binding."""
        self.load = None

    def bind(self, mode: str, workers: Collection[WorkerState], requests: Collection[Request], which: Iterable[Request],
             policy: PolicyConfig) -> None:
        """Bind each of ``which`` (already in ``requests``, unbound); no slot exists: left unbound."""
        key = "colocated" if mode == "colocated" else "target"
        # (the share of a prompt start's prefill a slot whose worker does not hold it saves: ``bound_work``)
        elsewhere = 1.0 - policy.prefix_pull_cost if policy.prefix_pulls else 0.0
        role = "any" if mode == "elastic" else MODES[mode][-1]  # (the bound workers')
        slots = {w.worker_id: w.slot for w in workers if w.role == role}  # (worker -> its slot)
        if self.load is None or self.since * self.REFRESH >= len(requests):
            self.load, self.since = dict.fromkeys(sorted(set(slots.values())), 0.0), 0
            for r in requests:
                if r.slot in self.load:
                    self.load[r.slot] += bound_work(r, key, slots, r.slot, elsewhere)
        load = self.load
        for r in which if load else ():
            near = slots.get(r.affinity.get(key, (None,))[0])
            far = bound_work(r, key, slots, None, elsewhere)
            here = bound_work(r, key, slots, near, elsewhere) if near is not None else far
            r.slot = min(load, key=lambda s: (load[s] + (here if s == near else far), s))
            load[r.slot] += here if r.slot == near else far
            self.since += 1
