"""The scheduling policy: pure bookkeeping over the request pool, its topics and its workers.

No sockets, no torch, no clock of its own (``now`` is passed in), so the live broker and a
simulator drive the same object. The broker feeds it events (a worker registers, pulls,
returns a result, dies; a request arrives or is cancelled) and sends what ``dispatch``
decides.

Modes (the same code, one switch):

* ``pooled``: M-for-N. Any draft worker takes any draft task, any target worker any verify
  task; every batch is rebuilt from the shared topics.
* ``paired``: draft worker i feeds target worker i only; a request is bound to one pair.
* ``colocated``: a worker holds both models; a request is bound to one worker, which runs
  whole rounds (``round`` tasks) for it.
* ``autoregressive``: target only; every round is a verify with no draft (one token).

Worker-triggered batching: a worker's ``PULL`` waits here until tasks it may take exist;
idle workers are served before workers that are prefetching behind a running batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nebula_flow.request import DONE, DRAFT, ROUND, VERIFY, Request

MODES: dict[str, tuple[str, ...]] = {
    "pooled": ("draft", "target"),
    "paired": ("draft", "target"),
    "colocated": ("colocated",),
    "autoregressive": ("target",),
}
PHASE_ROLE = {DRAFT: "draft", VERIFY: "target", ROUND: "colocated"}


@dataclass
class WorkerState:
    worker_id: int
    role: str
    slot: int
    capacity: int
    inflight: set[int] = field(default_factory=set)
    pull_credits: int = 0  # > 0 while a PULL waits
    pull_idle: bool = False
    pull_since: float = 0.0


class Scheduler:
    """Request pool + topics + workers for one mode; decides who runs what next."""

    def __init__(self, mode: str, k: int, locality: bool = False, migrate: bool = False) -> None:
        """``locality``: prefer tasks whose KV the pulling worker holds (it never waits for a
        particular worker). ``migrate``: never give a request the worker that ran its previous
        task of that role while another exists (forces KV movement, for tests and benchmarks)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if k < 0:
            raise ValueError("k must be >= 0")
        self.mode, self.k = mode, k
        self.locality, self.migrate = locality, migrate
        self.requests: dict[int, Request] = {}
        self.topics: dict[str, deque[int]] = {role: deque() for role in ("draft", "target", "colocated")}
        self.workers: dict[int, WorkerState] = {}

    # -- workers ---------------------------------------------------------------------------
    def register(self, worker_id: int, role: str, capacity: int) -> int:
        """Add a worker; returns its slot (its pair index, or colocated index)."""
        if role not in MODES[self.mode]:
            raise ValueError(f"mode {self.mode} has no {role!r} workers (roles: {', '.join(MODES[self.mode])})")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        used = {w.slot for w in self.workers.values() if w.role == role}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.workers[worker_id] = WorkerState(worker_id, role, slot, capacity)
        for req in self.requests.values():
            if req.slot is None:
                self._bind(req)
        return slot

    def unregister(self, worker_id: int) -> list[int]:
        """Drop a worker; its in-flight tasks go back to the front of their topics."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        requeued = []
        for rid in sorted(w.inflight):
            req = self.requests.get(rid)
            if req is not None and req.phase != DONE:
                self.topics[PHASE_ROLE[req.phase]].appendleft(rid)
                requeued.append(rid)
        for req in self.requests.values():
            for role, (holder, _) in list(req.holders.items()):
                if holder == worker_id:
                    del req.holders[role]
        return requeued

    def pull(self, worker_id: int, credits: int, idle: bool, now: float) -> None:
        w = self.workers[worker_id]
        w.pull_credits, w.pull_idle, w.pull_since = max(1, credits), idle, now

    # -- requests --------------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        self.requests[req.rid] = req
        self._bind(req)
        self.start_round(req)

    def start_round(self, req: Request) -> None:
        """Queue the next round of ``req``: a draft, a draft-less verify, or a whole round."""
        req.round += 1
        req.draft, req.q = [], {}
        req.k = 0 if self.mode == "autoregressive" else max(0, min(self.k, req.remaining - 1))
        if self.mode == "colocated":
            req.phase = ROUND
        else:
            req.phase = DRAFT if req.k > 0 else VERIFY
        self.topics[PHASE_ROLE[req.phase]].append(req.rid)

    def draft_done(self, req: Request, worker_id: int, draft: list[int], q: dict) -> None:
        req.draft, req.q, req.phase = draft, q, VERIFY
        req.proposed += len(draft)
        req.holders["draft"] = (worker_id, len(req.prompt) + len(req.output) + max(0, len(draft) - 1))
        self.workers[worker_id].inflight.discard(req.rid)
        self.topics["target"].append(req.rid)

    def verify_done(self, req: Request, worker_id: int, accepted: int) -> None:
        """Record a verify (or whole round); the caller then commits and calls start_round/finish."""
        req.accepted += accepted
        valid = len(req.prompt) + len(req.output) + accepted
        role = "colocated" if req.phase == ROUND else "target"
        req.holders[role] = (worker_id, valid)
        if "draft" in req.holders:
            holder, draft_valid = req.holders["draft"]
            req.holders["draft"] = (holder, min(draft_valid, valid))
        self.workers[worker_id].inflight.discard(req.rid)

    def finish(self, rid: int) -> Request | None:
        """Remove a request (done or cancelled) from the pool and from any topic."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        if req.phase != DONE:
            topic = self.topics[PHASE_ROLE[req.phase]]
            if rid in topic:
                topic.remove(rid)
        req.phase = DONE
        for w in self.workers.values():
            w.inflight.discard(rid)
        return req

    def accepts_result(self, worker_id: int, rid: int, attempt: int, kind: str) -> Request | None:
        """The request a result belongs to, or None when the result is stale or foreign."""
        req = self.requests.get(rid)
        w = self.workers.get(worker_id)
        if req is None or w is None or rid not in w.inflight or req.attempt != attempt or req.phase != kind:
            return None
        return req

    # -- the decision ----------------------------------------------------------------------
    def dispatch(self) -> list[tuple[int, list[Request]]]:
        """Serve waiting PULLs from the topics: idle workers first, then by arrival.

        With ``locality`` on, a first pass gives every waiting worker the tasks whose KV it
        already holds. In the second pass an idle worker takes any remaining task (a task is
        never kept for its holder while a worker sits idle), but a busy worker that is only
        prefetching takes no task another live worker holds: moving that KV would buy nothing.
        """
        waiting = sorted((w for w in self.workers.values() if w.pull_credits > 0),
                         key=lambda w: (not w.pull_idle, w.pull_since, w.worker_id))
        batches: dict[int, list[Request]] = {}
        for first_pass in ((True, False) if self.locality else (False,)):
            for w in waiting:
                room = w.pull_credits - len(batches.get(w.worker_id, []))
                if room > 0:
                    batches.setdefault(w.worker_id, []).extend(self._take(w, room, first_pass))
        out = []
        for w in waiting:
            batch = batches.get(w.worker_id)
            if batch:
                w.pull_credits = 0
                out.append((w.worker_id, batch))
        return out

    def _take(self, w: WorkerState, room: int, held_only: bool) -> list[Request]:
        topic = self.topics[w.role]

        def wanted(req: Request) -> bool:
            holder = self._holder(req)
            if held_only:
                return holder == w.worker_id
            if self.locality and not w.pull_idle and holder != w.worker_id and holder in self.workers:
                return False  # leave it for its holder or an idle worker
            return True

        chosen = []
        for rid in topic:  # stop at ``room``: a long topic costs nothing when its head is eligible
            req = self.requests[rid]
            if self._eligible(req, w) and wanted(req):
                chosen.append(rid)
                if len(chosen) == room:
                    break
        if not chosen:
            return []
        if all(topic[i] == rid for i, rid in enumerate(chosen)):  # a prefix: the common case
            for _ in chosen:
                topic.popleft()
        else:
            taken = set(chosen)
            self.topics[w.role] = deque(rid for rid in topic if rid not in taken)
        batch = []
        for rid in chosen:
            req = self.requests[rid]
            req.attempt += 1
            w.inflight.add(rid)
            batch.append(req)
        return batch

    def _holder(self, req: Request) -> int | None:
        return req.holders.get(PHASE_ROLE[req.phase], (None, 0))[0]

    def _eligible(self, req: Request, w: WorkerState) -> bool:
        if self.mode in ("paired", "colocated"):
            return req.slot == w.slot
        if self.migrate and self._holder(req) == w.worker_id:
            return not any(o.role == w.role and o.worker_id != w.worker_id for o in self.workers.values())
        return True

    def _bind(self, req: Request) -> None:
        """Paired/colocated: bind a request to the least-loaded slot that exists now."""
        if self.mode not in ("paired", "colocated"):
            return
        role = MODES[self.mode][-1]
        slots = sorted({w.slot for w in self.workers.values() if w.role == role})
        if not slots:
            return
        load = {s: 0 for s in slots}
        for r in self.requests.values():
            if r.slot in load:
                load[r.slot] += 1
        req.slot = min(slots, key=lambda s: (load[s], s))

    def depth(self) -> dict[str, int]:
        return {role: len(q) for role, q in self.topics.items() if role in MODES[self.mode]}
