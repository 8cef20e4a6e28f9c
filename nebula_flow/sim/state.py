"""What the simulator knows of each simulated worker and each task it runs (a snapshot of the
request at dispatch, as a TASKS message carries it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nebula_flow.elastic import BatchCosts
from nebula_flow.request import Request
from nebula_flow.sim.costs import CostModel
from nebula_flow.sim.prefix_cache import SimPrefixCache

PLACEHOLDER = 0  # simulated requests carry token counts, not token ids
Outcome = tuple[int, bool, int, int | None]  # a verified round: accepted, via_alt, draft's own, fused gain


@dataclass(frozen=True)
class Prefilled:
    """A task's result when its forward computed only a chunk of its prompt: the KV now held."""

    valid: int


@dataclass
class SimTask:
    """What a TASKS message tells a worker about one request (a snapshot at dispatch)."""

    req: Request
    kind: str
    attempt: int
    round: int
    length: int  # committed tokens (prompt + output): the KV the task must cover
    k: int
    holder: tuple[int, int] | None  # (worker, valid) of the KV for this task's role
    alts: int = 0  # runner-ups to the first draft token asked for (token tree)
    fuse: int = 0  # the longest fused chain asked for
    drafter: str | None = None  # verify tasks: the drafter whose draft it verifies
    target_holder: tuple[int, int] | None = None  # an elastic round: its target KV's (``holder``: its draft KV's)
    draft_len: int = 0  # a pre-draft (draft-ahead): the draft being verified, whose outcomes it drafts after
    outcomes: int = 0  # a pre-draft: how many outcomes it covers
    second: tuple[str, int] | None = None  # a fused round's verify: the second chain's drafter and tokens
    second_accepted: int | None = None  # ... and its tokens the round committed (``sim/fused.py``)
    alone: bool = False  # no other stream of its pool flowed when sent: it prefills whole (``budget.prefills_whole``)
    steps: int = 1  # a draft-less verify: the tokens it decodes, a forward each (``nebula_flow/steps.py``)


@dataclass
class SimWorker:
    wid: int
    role: str
    capacity: int
    costs: dict[str, CostModel]  # model role ("draft"/"target") -> cost model on this device
    drafter: str | None = None  # draft workers of a ``[[drafters]]`` pool: its name
    draft_capacity: int | None = None  # elastic workers: a draft batch's most tasks (the draft pool's max_batch)
    reported: bool = False  # forward times sent to the broker (with the first result)
    reported_at: float = float("-inf")  # batch forward times last sent (at most once a second, as live)
    batch_costs: dict[str, BatchCosts] = field(default_factory=lambda: {"draft": BatchCosts(), "target": BatchCosts()})
    computing: list[SimTask] | None = None
    pending: list[SimTask] | None = None
    pull_out: str | None = None  # None, "busy" or "idle": as in the live worker loop
    prefetch_free: float = 0.0
    kv_ready: float = 0.0
    caches: dict[str, dict[int, int]] = field(default_factory=lambda: {"draft": {}, "target": {}})
    busy_s: float = 0.0
    stall_s: float = 0.0
    tasks: int = 0
    batches: int = 0
    kv_bytes: int = 0
    pulls: int = 0
    pulled: int = 0  # KV positions received from peers ...
    pull_s: float = 0.0  # ... and the link time they took (a live worker's ``kv.pulled``, ``kv.pull_s``)
    recomputed: int = 0  # positions computed again because no peer held them
    prefixes: dict[str, SimPrefixCache] | None = None  # model role -> its prefix cache (prompts that share a start)
    prefix_cached: int = 0  # new requests' positions found in its prefix cache ...
    prefix_pulled: int = 0  # ... and pulled from the peer placement named
    pull_saved: int = 0  # positions of KV that follows a request its prefix cache held (not pulled)
