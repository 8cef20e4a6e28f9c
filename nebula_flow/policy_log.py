"""A written record of what a scheduling policy was told and what it decided, and its replay.

The live broker (``--policy-log PATH``) and the simulator both drive ``Scheduler``; with a
``RecordingScheduler`` in its place, every event it is fed (a worker registers, pulls, a
request arrives, a draft or verify comes back, a round starts, a request finishes) and every
non-empty ``dispatch`` decision is appended to a list. ``replay`` feeds such a record to
another policy object and compares its decisions with the recorded ones: the check that the
simulator and the broker run the same policy, and a debugging aid for operators ("would the
new policy have decided the same on yesterday's traffic?").

Records are JSON arrays, one per line (JSONL)::

    ["policy", mode, {knob: value}]      (policy.PolicyConfig.to_table)
    ["register", worker, role, capacity, slot, drafter, draft_capacity]
    ["unregister", worker, [requeued rids]]
    ["pull", worker, credits, idle, now]
    ["admit", rid, prompt_len, max_new_tokens, greedy, seeded, affinity, priority, waits_for]
                                         (affinity: where its prompt's start was likely held,
                                         {holder key: [worker, positions]}: ``prefixes.py``;
                                         priority: its ``SamplingParams.priority``; waits_for: [the
                                         request computing its prompt's start that it waited for,
                                         the tokens they share], or null)
    ["draft_done", rid, worker, n_draft]
    ["prefilled", rid, worker, valid]    (a chunk of a prompt computed; the task queued again)
    ["retry", rid, worker]               (the worker lacked the task's tokens: the task queued again)
    ["end_round", rid, worker, committed, via_alt, draft_accepted, fused, ended, hit, second]
                                         (committed: tokens the verify committed; ended: the request
                                         finished there, by EOS, length or a stop string; hit: the
                                         pre-drafted branch that assumed them, or null; second: a
                                         fused round's second chain's tokens committed, or null)
    ["second_done", rid, worker, n_draft, prefilled]
                                         (fused drafters: a second draft came back; n_draft null: it
                                         failed; prefilled: positions a prompt chunk reached, or null)
    ["predrafted", rid, worker, [[assumed, drafted], ...], hit]
                                         (draft-ahead: a pre-draft's branches, by their lengths; hit:
                                         the one that assumed what its verify committed, when that
                                         verify has already ended, or null)
    ["step_costs", worker, role, [seconds by new rows]]
    ["pull_rate", worker, seconds, positions]
                                         (a worker's KV pull counters, which price moving KV to it)
    ["finish", rid]                      (a cancelled or failed request)
    ["dispatch", [[worker, [[rid, attempt], ...]], ...]]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_flow import ahead
from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.request import Request
from nebula_flow.scheduler import Scheduler

PLACEHOLDER = 0  # token ids do not matter to a policy: only counts do


def decisions(batches: list[tuple[int, list[Request]]]) -> list[list[Any]]:
    """A dispatch result in record form: who got which request, at which attempt."""
    return [[wid, [[r.rid, r.attempt] for r in batch]] for wid, batch in batches]


class RecordingScheduler(Scheduler):
    """``Scheduler`` that also appends its inputs and decisions to ``self.records``."""

    def __init__(self, mode: str, policy: PolicyConfig | None = None) -> None:
        super().__init__(mode, policy)
        self.records: list[list[Any]] = [["policy", mode, self.policy.to_table()]]
        self._quiet = False  # inside admit or end_round: their inner steps are not events of their own

    def register(self, worker_id: int, role: str, capacity: int, drafter: str | None = None,
                 draft_capacity: int | None = None) -> int:
        slot = super().register(worker_id, role, capacity, drafter, draft_capacity)
        w = self.workers[worker_id]
        self.records.append(["register", worker_id, role, capacity, slot, w.drafter, w.draft_capacity])
        return slot

    def unregister(self, worker_id: int) -> list[int]:
        requeued = super().unregister(worker_id)
        self.records.append(["unregister", worker_id, requeued])
        return requeued

    def pull(self, worker_id: int, credits: int, idle: bool, now: float) -> None:
        super().pull(worker_id, credits, idle, now)
        self.records.append(["pull", worker_id, credits, idle, now])

    def admit(self, req: Request) -> None:
        record = ["admit", req.rid, len(req.prompt), req.params.max_new_tokens, req.params.greedy,
                  req.params.seed is not None]
        self.records.append(record)
        self._quiet = True  # admit starts the first round itself
        try:
            super().admit(req)
        finally:
            self._quiet = False
        waits = None if req.waits_for is None else [req.waits_for, dict(self.prefixes.followers[req.waits_for])[req.rid]]
        # (not the source request: KV, not policy; a request that waits is placed as it starts)
        record += [{key: list(where[:2]) for key, where in req.affinity.items()}, req.params.priority, waits]

    def end_round(self, req: Request, worker_id: int, committed: list[int], via_alt: bool = False,
                  draft_accepted: int | None = None, fused: int | None = None, eos_ids: tuple[int, ...] = (),
                  stop_text: Callable[[Request], bool] | None = None, second: int | None = None) -> list[int]:
        st = req.ahead if req.ahead is not None and req.ahead.round == req.round else None
        hit = next((i for i, b in enumerate(st.branches) if b.assumes == committed), None) if st and st.branches else None
        self._quiet = True
        try:
            kept = super().end_round(req, worker_id, committed, via_alt, draft_accepted, fused, eos_ids, stop_text, second)
        finally:
            self._quiet = False
        self.records.append(["end_round", req.rid, worker_id, len(committed), via_alt, draft_accepted, fused,
                             req.finish_reason is not None, hit, second])
        return kept

    def second_done(self, req: Request, worker_id: int, draft: list[int] | None, prefilled: int | None = None) -> None:
        self.records.append(["second_done", req.rid, worker_id, None if draft is None else len(draft), prefilled])
        super().second_done(req, worker_id, draft, prefilled)

    def predrafted(self, req: Request, worker_id: int, branches: list[ahead.Branch]) -> None:
        self.records.append(["predrafted", req.rid, worker_id, [[len(b.assumes), len(b.draft)] for b in branches],
                             ahead.last_match(req.ahead, branches, req)])
        super().predrafted(req, worker_id, branches)

    def draft_done(self, req: Request, worker_id: int, draft: list[int], q: dict) -> None:
        self.records.append(["draft_done", req.rid, worker_id, len(draft)])
        super().draft_done(req, worker_id, draft, q)

    def retry(self, req: Request, worker_id: int) -> None:
        self.records.append(["retry", req.rid, worker_id])
        super().retry(req, worker_id)

    def prefilled(self, req: Request, worker_id: int, valid: int) -> None:
        self.records.append(["prefilled", req.rid, worker_id, valid])
        super().prefilled(req, worker_id, valid)

    def observe_costs(self, worker_id: int, role: str, seconds: list[float | None], by_batch: bool = False) -> None:
        self.records.append(["batch_costs" if by_batch else "step_costs", worker_id, role, list(seconds)])
        super().observe_costs(worker_id, role, seconds, by_batch)

    def observe_pulls(self, worker_id: int, seconds: object, positions: object) -> None:
        self.records.append(["pull_rate", worker_id, seconds, positions])
        super().observe_pulls(worker_id, seconds, positions)

    def finish(self, rid: int) -> Request | None:
        if not self._quiet:
            self.records.append(["finish", rid])
        return super().finish(rid)

    def dispatch(self) -> list[tuple[int, list[Request]]]:
        out = super().dispatch()
        if out:  # an empty dispatch changes nothing, so leaving it out loses nothing
            self.records.append(["dispatch", decisions(out)])
        return out

    def save(self, path: str | Path) -> None:
        with Path(path).open("w") as f:
            for rec in self.records:
                f.write(json.dumps(rec) + "\n")


def policy_of(records: list[list[Any]]) -> Scheduler:
    """A fresh policy configured as the one that wrote ``records``."""
    _, mode, table = records[0]
    return Scheduler(mode, PolicyConfig.from_table(table, "policy log"))


def load(path: str | Path) -> list[list[Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy log not found: {path}")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not recs or recs[0][0] != "policy":
        raise ValueError(f"{path}: not a policy log (first record must be ['policy', ...])")
    return recs


@dataclass
class ReplayReport:
    events: int
    decisions: int
    mismatches: list[dict[str, Any]]

    @property
    def identical(self) -> bool:
        return not self.mismatches


class Recalled:
    """A replay's ``PrefixRoutes``: where each request's prefix was likely held, as recorded (a
    record's token ids are placeholders)."""

    def __init__(self) -> None:
        self.next: dict[str, tuple[int, int]] = {}
        self.waits: list[int] | None = None
        self.followers: dict[int, list[tuple[int, int]]] = {}

    def place(self, req: Request, alive: object, share: float) -> bool:
        req.affinity, req.waits_for = dict(self.next), None if self.waits is None else self.waits[0]
        if self.waits is not None:  # (placed as it starts: where the request it waited for holds their shared tokens)
            self.followers.setdefault(self.waits[0], []).append((req.rid, self.waits[1]))
        return self.waits is not None

    def learn(self, req: Request) -> None:
        """(Nothing to learn: the record says where.)"""


def replay(records: list[list[Any]], policy: Scheduler) -> ReplayReport:
    """Feed ``records`` to ``policy`` and compare each of its decisions with the recorded one."""
    events = n_decisions = 0
    policy.prefixes = recalled = Recalled()
    mismatches: list[dict[str, Any]] = []
    for i, rec in enumerate(records):
        kind, args = rec[0], rec[1:]
        reqs = policy.requests
        if kind == "policy":
            continue
        events += 1
        if kind == "register":
            slot = policy.register(args[0], args[1], args[2], *args[4:6])  # drafter, draft capacity: absent in older logs
            if slot != args[3]:
                mismatches.append({"record": i, "event": rec, "got_slot": slot})
        elif kind == "unregister":
            got = policy.unregister(args[0])
            if got != args[1]:
                mismatches.append({"record": i, "event": rec, "got": got})
        elif kind == "pull":
            policy.pull(args[0], args[1], args[2], args[3])
        elif kind == "admit":
            # (older logs lack some of the last five)
            rid, prompt_len, max_new, greedy, seeded, affinity, priority, waits = \
                (*args, *(True, False, {}, 0, None)[len(args) - 3:])
            recalled.next, recalled.waits = {key: tuple(where) for key, where in affinity.items()}, waits
            # (the policy plans greedy, sampled and seeded requests apart: token trees, costs, routing)
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0 if greedy else 1.0,
                                    seed=0 if seeded else None, priority=priority)
            policy.admit(Request(rid, str(rid), [PLACEHOLDER] * prompt_len, params, seed=0))
        elif kind == "draft_done":
            policy.draft_done(reqs[args[0]], args[1], [PLACEHOLDER] * args[2], {})
        elif kind == "prefilled":
            policy.prefilled(reqs[args[0]], args[1], args[2])
        elif kind == "retry":
            policy.retry(reqs[args[0]], args[1])
        elif kind == "end_round":
            rid, wid, committed, via_alt, draft_accepted, fused, ended, hit, second = (*args, None, None)[:9]  # (older: no hit)
            st = reqs[rid].ahead
            # (placeholders hold no EOS and no text: a request the broker ended ends here by "stop"; a
            # pre-drafted branch that assumed the committed tokens assumes the placeholders)
            tokens = st.branches[hit].assumes if hit is not None else [PLACEHOLDER] * committed
            policy.end_round(reqs[rid], wid, list(tokens), via_alt, draft_accepted, fused,
                             stop_text=lambda _r, hit=ended: hit, second=second)
        elif kind == "second_done":
            policy.second_done(reqs[args[0]], args[1], None if args[2] is None else [PLACEHOLDER] * args[2], args[3])
        elif kind == "predrafted":
            rid, wid, shapes, hit = args
            req = reqs[rid]
            last = req.output[len(req.output) - req.tokens_per_round[-1]:] if req.tokens_per_round else []
            drafter = policy.workers[wid].drafter if wid in policy.workers else None
            # (branch i assumes tokens no verify commits, -1 - i, but for the one the record says matched)
            policy.predrafted(req, wid, [ahead.Branch(last if i == hit else [-1 - i] * n, [PLACEHOLDER] * m,
                                                      worker=wid, drafter=drafter)
                                         for i, (n, m) in enumerate(shapes)])
        elif kind == "step_costs":
            policy.observe_costs(*args)
        elif kind == "pull_rate":
            policy.observe_pulls(*args)
        elif kind == "batch_costs":
            policy.observe_costs(*args, by_batch=True)
        elif kind == "finish":
            policy.finish(args[0])
        elif kind == "dispatch":
            n_decisions += 1
            got = decisions(policy.dispatch())
            if got != args[0]:
                mismatches.append({"record": i, "expected": args[0], "got": got})
        else:
            raise ValueError(f"record {i}: unknown event {kind!r}")
    return ReplayReport(events, n_decisions, mismatches)
