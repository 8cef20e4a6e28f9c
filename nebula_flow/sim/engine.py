"""The discrete-event simulator: a virtual clock, an event heap, the live scheduling policy.

The broker side is the live code: the same ``Scheduler`` object is fed the same events in the
same order as the live broker feeds it (admit, pull, draft_done, end_round) and its ``dispatch`` decides every batch.
Only the outside world is simulated:

* workers behave like ``workers/worker.py``: a PULL for ``max_batch`` tasks goes out whenever no
  batch is waiting and no PULL is outstanding (re-sent as "idle" when the worker goes idle),
  the KV of a batch is pulled as soon as the batch arrives (one transfer at a time, overlapped
  with the running batch), and a batch starts when compute is free and its KV has arrived;
* forward passes cost what the pool's cost model says, counted the way the model runner runs
  them (a draft task: one forward per draft position; a verify: one forward; a colocated
  round: both, on one device); with its first result a worker reports its forward times by
  rows (``observe_costs``: one sequence at the workload's mean context), as live workers do;
* several drafters (pooled mode, ``[[drafters]]``): their workers register with the drafter's
  name, the policy routes each round, and a verify draws from the acceptance model of the
  drafter that drafted it;
* each worker keeps per-request KV lengths; only missing positions are pulled or computed;
  where prompts share their start (a trace's ``hash_ids``, a scenario's ``shared_prefix``), the
  policy places by prefix as live and a worker starts a new request from its prefix cache or pulls
  the start from the peer placement names (``sim/prefix_cache.py``);
  with the policy's ``max_forward_tokens``, a forward computes at most that many uncached prompt
  tokens and long prompts are prefilled in chunks beside the other rows (``budget.plan_forward``, as the
  live runner plans them), each chunk a result that sends the task round again;
* draft-ahead (``draft_ahead``): an idle draft worker's pre-drafts cost the live runner's forwards,
  and their branches bet on the outcomes it covers (``sim/predraft.py``); whether a verify's last
  token was the draft's guess is the acceptance model's draw, and the live policy matches them;
* acceptance draws come from the scenario's acceptance model, token trees too: a verify scores
  its runner-ups' and fused chain's rows beside the draft's (a chain found only as often as the
  model says; a chain sharing the draft's prefix is counted in full), and a round reports the
  policy what the broker does (``AcceptanceModel.tree_round``);
* messages take ``message_latency_us``; the broker is one thread that can cost
  ``broker_service_us`` per message and ``broker_task_us`` per task it takes back or sends out,
  so a saturated broker queues messages as the live one does.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable
from typing import Any

from nebula_flow import ahead, budget, fusion, steps
from nebula_flow.config import DeployConfig, PoolConfig
from nebula_flow.elastic import BatchCosts
from nebula_flow.params import SamplingParams
from nebula_flow.prefixes import PrefixRoutes
from nebula_flow.request import AHEAD, DRAFT, ROUND, VERIFY, Request
from nebula_flow.roles import MODEL_ROLES, holder_key
from nebula_flow.scheduler import Scheduler
from nebula_flow.sim import fused, predraft
from nebula_flow.sim.acceptance import AcceptanceModel
from nebula_flow.sim.costs import CostModel
from nebula_flow.sim.prefix_cache import SimPrefixCache, prompt_of
from nebula_flow.sim.prefix_cache import report as prefix_report
from nebula_flow.sim.report import latencies
from nebula_flow.sim.scenario import Scenario, Workload, cost_on
from nebula_flow.sim.state import PLACEHOLDER, Outcome, Prefilled, SimTask, SimWorker
from nebula_flow.speclen import FIT_ROWS
from nebula_flow.stats import is_urgent

COSTS_EVERY_S = 1.0  # as workers/worker.py: forward-time tables go to the broker at most this often


class Simulator:
    def __init__(self, sc: Scenario, mode: str, draft_workers: int | None = None, target_workers: int | None = None,
                 workload: Workload | None = None, policy: type[Scheduler] = Scheduler) -> None:
        self.sc, self.mode = sc, mode
        self.workload = workload or sc.workload
        self.policy = policy(mode, sc.policy)
        self.lat = sc.host.message_latency_us * 1e-6
        self.heap: list[tuple[float, int, Callable, tuple]] = []
        self.seq = 0
        self.now = 0.0
        self.broker_free = 0.0  # the broker is busy until then
        self.inbox: list[tuple[Callable, tuple]] = []
        self.broker_busy_s = 0.0
        self.poll_scheduled = False
        # The worker processes a deployment of this mode starts: the live plan, not a copy of it.
        dep = DeployConfig(mode=mode, draft=PoolConfig(workers=draft_workers or sc.draft.workers,
                                                       max_batch=sc.draft.max_batch, elastic=sc.draft.elastic),
                           target=PoolConfig(workers=target_workers or sc.target.workers,
                                             max_batch=sc.target.max_batch, elastic=sc.target.elastic))
        self.workers: dict[int, SimWorker] = {}
        # The devices: the draft pool's M, then the target pool's N (every mode runs on the same ones;
        # the plan lists drafts first): each worker's models cost what they cost on its device.
        for i, (role, pool) in enumerate(dep.worker_plan(), 1):
            device = sc.draft if i <= dep.draft.workers else sc.target
            costs = {m: cost_on(sc.draft if m == "draft" else sc.target, device) for m in MODEL_ROLES[role]}
            self.workers[i] = SimWorker(i, role, pool.max_batch, costs,
                                        draft_capacity=sc.draft.max_batch if role == "any" else None)
        for d in sc.drafters if mode == "pooled" else ():  # (the baselines run [draft] alone, as live)
            for _ in range(d.pool.workers):
                wid = len(self.workers) + 1
                self.workers[wid] = SimWorker(wid, "draft", d.pool.max_batch, {"draft": d.pool.cost}, d.name)
        self.acceptance = {d.name: d.acceptance for d in sc.drafters}  # by drafter; else the scenario's
        self.rounds_by_drafter: dict[str, int] = {}
        self.reqs = self.workload.arrivals(sc.seed)
        self.closed = all(a.at is None for a in self.reqs)  # closed loop: a finish lets the next one in
        if any(a.blocks for a in self.reqs):  # (prompts that share their start: placement by prefix, prefix caches)
            if sc.policy.prefix_affinity:
                self.policy.prefixes = PrefixRoutes()
            for w in self.workers.values() if sc.prefix_cache else ():
                w.prefixes = {role: SimPrefixCache() for role in w.costs}
        self.next_req = 0
        self.inflight = 0
        self.done: list[Request] = []
        self.t_done: dict[int, float] = {}
        self.rounds = self.tokens = self.stale = 0
        self.cached_prompt = 0  # new requests' target positions found in a prefix cache or pulled

    # -- the event loop ----------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def to_broker(self, fn: Callable, *args: Any) -> None:
        """A message to the broker: in flight for a latency, then read at the broker's next poll."""
        self.at(self.now + self.lat, self._broker_receive, fn, args)

    def _broker_receive(self, fn: Callable, args: tuple) -> None:
        self.inbox.append((fn, args))
        if not self.poll_scheduled:
            self.poll_scheduled = True
            self.at(max(self.now, self.broker_free), self._broker_poll)

    def _broker_poll(self) -> None:
        """Like the live broker's loop: read every waiting message, then dispatch once."""
        self.poll_scheduled = False
        inbox, self.inbox = self.inbox, []
        tasks = 0
        for fn, args in inbox:
            fn(*args)
            tasks += len(args[1]) if fn == self._results else 1 if fn == self.policy.admit else 0
        dispatched = self.policy.dispatch()
        tasks += sum(len(b) for _, b in dispatched)
        host = self.sc.host
        # (shards share no per-round work and split the requests evenly: as one broker thread
        # that does each shard's share of the messages)
        self.broker_free = self.now + (host.broker_service_us * len(inbox) + host.broker_task_us * tasks) * 1e-6 / host.broker_shards
        self.broker_busy_s += self.broker_free - self.now
        for wid, batch in dispatched:
            if self.policy.workers[wid].stage == AHEAD:  # (pre-drafts: draft-ahead)
                tasks = [SimTask(r, AHEAD, r.ahead.attempt, r.ahead.round, len(r.prompt) + len(r.output), r.ahead.k,
                                 r.holders.get(holder_key("draft", r.drafter)), r.ahead.alts, r.ahead.fuse, r.drafter,
                                 draft_len=len(r.ahead.draft), outcomes=r.ahead.outcomes) for r in batch]
            else:  # (a fused round's second draft: sim/fused.py)
                alone = budget.sends_alone(batch, len(self.policy.requests), self.policy.streaming,
                                           self.policy.workers.values())
                steps.assign(self.policy, batch)  # (multi-step decoding, as the broker's ``task_specs``)
                tasks = [fused.second_task(r, self.policy.workers[wid]) or
                         SimTask(r, r.phase, r.attempt, r.round, len(r.prompt) + len(r.output), r.k,
                                 r.holders.get(self.policy.task_holder_key(r)), r.alts, r.fuse, r.drafter,
                                 r.holders.get("target") if r.phase == ROUND else None, second=fused.second_chain(r),
                                 alone=alone, steps=r.steps)
                         for r in batch]
            self.at(self.broker_free + self.lat, self._tasks_arrive, self.workers[wid], tasks)

    def run(self) -> dict[str, Any]:
        for w in self.workers.values():
            self.policy.register(w.wid, w.role, w.capacity, w.drafter, w.draft_capacity)
        for w in self.workers.values():
            self._worker_step(w)
        n_now = len(self.reqs) if self.workload.concurrency is None else min(self.workload.concurrency, len(self.reqs))
        if self.closed:  # the client sends its first requests one after another
            gap = self.workload.submit_gap_us * 1e-6
            for i in range(n_now):
                self.at(i * gap, self._client_submit)
        else:
            for i, a in enumerate(self.reqs):
                self.at(a.at, self._client_submit_index, i)
        while self.heap:
            self.now, _, fn, args = heapq.heappop(self.heap)
            fn(*args)
        if len(self.done) != len(self.reqs):
            raise RuntimeError(f"simulation stalled: {len(self.done)} of {len(self.reqs)} requests finished "
                               f"(topics {self.policy.depth()})")
        return self.result()

    # -- clients -----------------------------------------------------------------------------
    def _client_submit(self) -> None:
        if self.next_req < len(self.reqs):
            self._client_submit_index(self.next_req)

    def _client_submit_index(self, i: int) -> None:
        self.next_req = max(self.next_req, i + 1)
        a = self.reqs[i]
        urgent = -1 if self.policy.policy.priority_scheduling and is_urgent(self.workload.urgent_every, i) else 0
        prompt = prompt_of(i + 1, a.prompt_tokens, a.blocks, a.shared) if a.blocks else [PLACEHOLDER] * a.prompt_tokens
        req = Request(i + 1, str(i + 1), prompt,
                      SamplingParams(max_new_tokens=a.output_tokens, ignore_eos=True, priority=urgent), seed=self.sc.seed)
        req.t_submit = self.now
        self.to_broker(self.policy.admit, req)

    # -- broker handlers (the live broker's order of policy calls) ----------------------------
    def _results(self, wid: int, results: list[tuple[SimTask, Outcome | None]]) -> None:
        sender = self.workers[wid]
        if not sender.reported:  # (a live worker's RESULT carries its forward times; the broker takes them first)
            sender.reported = True
            for role, cost in sender.costs.items():
                self.policy.observe_costs(wid, role, self._step_table(cost))
        if self.now - sender.reported_at >= COSTS_EVERY_S:  # (the forwards it ran, priced by batch rows)
            sender.reported_at = self.now
            for role, costs in sender.batch_costs.items():
                if costs.seconds:
                    self.policy.observe_costs(wid, role, costs.table(), by_batch=True)
        self.policy.observe_pulls(wid, sender.pull_s, sender.pulled)  # (a live RESULT's ``kv`` counters)
        for task, outcome in results:
            if task.kind == AHEAD:  # (a pre-draft's branches: the broker's _predrafted)
                req = ahead.accepts(self.policy, wid, task.req.rid, task.attempt)
                if req is None:
                    self.stale += 1
                else:
                    self.policy.predrafted(req, wid, outcome)
                continue
            if task.kind == DRAFT and task.attempt < 0:  # (a second draft: the broker's _second)
                req = fusion.accepts(self.policy, wid, task.req.rid, task.attempt)
                if req is None:
                    self.stale += 1
                else:
                    chunk = outcome.valid if isinstance(outcome, Prefilled) else None
                    self.policy.second_done(req, wid, None if chunk is not None else [PLACEHOLDER] * task.k, chunk)
                continue
            req = self.policy.accepts_result(wid, task.req.rid, task.attempt, task.kind)
            if req is None:
                self.stale += 1
                continue
            if isinstance(outcome, Prefilled):
                self.policy.prefilled(req, wid, outcome.valid)
                continue
            if task.kind == DRAFT:
                self.policy.draft_done(req, wid, [PLACEHOLDER] * task.k, {})
                continue
            accepted, via_alt, draft_accepted, fused = outcome
            if task.drafter is not None and task.k > 0:
                self.rounds_by_drafter[task.drafter] = self.rounds_by_drafter.get(task.drafter, 0) + 1
            # (with draft-ahead, the last token says which guess it was: pre-drafted branches bet on it)
            last = predraft.last_token(self._acceptance(task), task, outcome) if ahead.on(self.policy) else PLACEHOLDER
            committed = [PLACEHOLDER] * accepted + [last]
            kept = self.policy.end_round(req, wid, committed, via_alt, draft_accepted, fused, second=task.second_accepted)
            self.rounds += 1
            self.tokens += len(kept)
            if req.t_first is None:
                req.t_first = self.now
                self._hold_prefixes(req, ended=False)
            # what every copy of this request's KV is still good for (a draft's: its own tokens)
            valid = {"target": task.length + accepted, "draft": task.length + draft_accepted}
            for w in self.workers.values():
                for role, cache in w.caches.items():  # (a second drafter's: its own chain's)
                    mine = valid[role] if not task.second or w.drafter != task.second[0] or role != "draft" \
                        else task.length + task.second_accepted
                    if req.rid in cache and cache[req.rid] > mine:
                        cache[req.rid] = mine
            if req.finish_reason:  # (end_round took it out of the pool)
                self.done.append(req)
                self.t_done[req.rid] = self.now
                self._hold_prefixes(req, ended=True)
                for w in self.workers.values():  # FREE
                    for cache in w.caches.values():
                        cache.pop(req.rid, None)
                if self.closed:
                    self.at(self.now + 2 * self.lat, self._client_submit)  # DONE reaches the client, which sends the next

    # -- workers -------------------------------------------------------------------------------
    def _worker_step(self, w: SimWorker) -> None:
        """The live worker loop's decisions: start a waiting batch, keep one PULL outstanding."""
        if w.computing is None and w.pending:
            self._start(w)
        idle = w.computing is None
        if w.pending is None and (w.pull_out is None or (idle and w.pull_out == "busy")):
            w.pull_out = "idle" if idle else "busy"
            self.to_broker(self.policy.pull, w.wid, max(w.capacity, w.draft_capacity or 0), idle, self.now)

    def _tasks_arrive(self, w: SimWorker, tasks: list[SimTask]) -> None:
        w.pull_out = None
        w.pending = (w.pending or []) + tasks
        transfer = 0.0
        for t in tasks:  # start the pulls now, one at a time, while the current batch computes
            for model_role in {DRAFT: ("draft",), AHEAD: ("draft",), VERIFY: ("target",)}.get(t.kind, ("draft", "target")) \
                    if w.prefixes else ():
                transfer += self._start_from_prefix(w, t, model_role)
            # a round's KV by model: a colocated worker holds both; an elastic one may pull both
            needs = {DRAFT: [("draft", t.holder)], AHEAD: [("draft", t.holder)], VERIFY: [("target", t.holder)]}.get(
                t.kind, [("draft", t.holder), ("target", t.target_holder)] if w.role == "any" else [])
            for model_role, want in needs:
                if want is None or want[0] == w.wid:
                    continue
                holder = self.workers.get(want[0])
                have = w.caches[model_role].get(t.req.rid, 0)
                theirs = min(want[1], holder.caches[model_role].get(t.req.rid, 0)) if holder else 0
                if model_role in (w.prefixes or ()):  # (what a finished request here holds does not travel)
                    start, have = have, max(have, min(theirs, w.prefixes[model_role].held(t.req.prompt, True)))
                    if have > start:
                        w.caches[model_role][t.req.rid], w.pull_saved = have, w.pull_saved + have - start
                took = self._pull(w, model_role, t.req.rid, have, theirs)
                if took is not None:  # (None: the holder lacks them, or recomputing them is quicker)
                    transfer += took
                elif want[1] > have:
                    w.recomputed += want[1] - have
        w.prefetch_free = max(self.now, w.prefetch_free) + transfer
        w.kv_ready = w.prefetch_free
        self._worker_step(w)

    def _start_from_prefix(self, w: SimWorker, t: SimTask, role: str) -> float:
        """A new request's ``role`` KV here starts from the longest prefix of its prompt this worker's
        prefix cache holds, or, pulled, the longer one on the peer placement names (``prefix_pulls``;
        where the link beats computing it, as a live worker judges). Returns the pull's link seconds."""
        cache, rid = w.caches.get(role), t.req.rid
        key = "colocated" if w.role == "colocated" else holder_key(role, t.req.drafter) if role == "draft" else role
        if cache is None or role not in w.prefixes or rid in cache or t.req.holders.get(key, (0, 0))[1] > 0:
            return 0.0  # (not new here: its KV is here, or held elsewhere, pulled as KV that follows a request)
        have = cache[rid] = w.prefixes[role].held(t.req.prompt)
        w.prefix_cached += have
        if role == "target":  # (a request's cached prompt tokens are its target's, as live usage counts them)
            self.cached_prompt += have
        where = t.req.affinity.get("colocated" if w.role == "colocated" else role)  # (placement knows no drafter)
        peer = self.workers.get(where[0]) if where and where[0] != w.wid and self.policy.policy.prefix_pulls else None
        theirs = min(where[1], peer.prefixes[role].held(t.req.prompt)) if peer and role in (peer.prefixes or {}) else 0
        took = self._pull(w, role, rid, have, theirs)
        if took is None:
            return 0.0
        w.prefix_pulled += theirs - have  # (and a pull as any: the live store counts both)
        if role == "target":
            self.cached_prompt += theirs - have
        return took

    def _pull(self, w: SimWorker, role: str, rid: int, have: int, theirs: int) -> float | None:
        """Pull positions ``have:theirs`` of ``rid``'s ``role`` KV to ``w`` where the link beats
        computing them, as a live worker judges: the link's seconds, counted; None: not pulled."""
        cost = w.costs[role]
        nbytes = (theirs - have) * cost.kv_bytes_per_token
        took = self.sc.link.pull_s(nbytes, cost.forward_s(1, theirs - have, theirs)) if theirs > have else None
        if took is not None:
            w.pulls, w.pulled, w.pull_s, w.kv_bytes = w.pulls + 1, w.pulled + theirs - have, w.pull_s + took, w.kv_bytes + nbytes
            w.caches[role][rid] = theirs
        return took

    def _hold_prefixes(self, req: Request, ended: bool) -> None:
        """``req``'s tokens' KV, as far as each worker holds it, is in that worker's prefix cache
        (at its first tokens: its prompt's is held then; as it ends: kept for prefixes)."""
        tokens = req.prompt + req.output
        for w in self.workers.values():
            for role, prefixes in (w.prefixes or {}).items():
                if (valid := w.caches[role].get(req.rid, 0)) > 0:
                    prefixes.hold(req.rid, tokens, valid)
                if ended:
                    prefixes.finish(req.rid)

    def _acceptance(self, t: SimTask) -> AcceptanceModel:
        """The acceptance model of the drafter whose draft ``t`` verifies."""
        return self.acceptance.get(t.drafter, self.sc.acceptance)

    def _start(self, w: SimWorker) -> None:
        batch, w.pending = w.pending, None
        begin = max(self.now, w.kv_ready)
        w.stall_s += begin - self.now
        if batch[0].kind == AHEAD:  # (a batch of pre-drafts: sim/predraft.py)
            compute, results = predraft.run(w, batch, self._forward_s, self.policy.workers[w.wid].drafter)
        else:
            compute, results = self._compute(w, batch)
        overhead = (self.sc.host.batch_overhead_us + self.sc.host.task_overhead_us * len(batch)) * 1e-6
        w.busy_s += compute
        w.tasks += len(batch)
        w.batches += 1
        w.computing = batch
        self.at(begin + compute + overhead, self._finish_batch, w, results)

    def _compute(self, w: SimWorker, batch: list[SimTask]) -> tuple[float, list[tuple[SimTask, Any]]]:
        """A batch of drafts, verifies or rounds: its forwards' seconds and each task's result."""
        compute = 0.0
        verifies = [t for t in batch if t.kind in (VERIFY, ROUND)]
        outcomes = {id(t): (t.steps - 1, False, 0, None) if t.steps > 1 else  # (a multi-step decode: its steps' tokens)
                    self._acceptance(t).tree_round(t.req.rid, t.round, t.k, t.alts, t.fuse) for t in verifies}
        for t in verifies:
            if t.second:
                outcomes[id(t)] = fused.outcome(self.acceptance.get(t.second[0], self.sc.acceptance), t, outcomes[id(t)])
        ends = self._chunk_ends(w, batch)
        drafts = [t for t in batch if t.kind in (DRAFT, ROUND)]
        if drafts:
            compute += self._draft_time(w, drafts, ends)
        if verifies:
            compute += self._verify_time(w, verifies, outcomes, ends)
        return compute, [(t, Prefilled(ends[id(t)]) if id(t) in ends else outcomes.get(id(t))) for t in batch]

    def _chunk_ends(self, w: SimWorker, batch: list[SimTask]) -> dict[int, int]:
        """The tasks of a batch that only prefill a chunk of their prompt this time, by ``id``: the
        position it reaches (the live runner's ``chunk_ends``: the target's plan on a colocated worker)."""
        most = budget.forward_budget((p := self.policy.policy).max_forward_tokens, p.max_burst_tokens, [t.alone for t in batch])
        if not most:
            return {}
        cache = w.caches["draft" if w.role == "draft" or batch[0].kind == DRAFT else "target"]
        have = [min(cache.get(t.req.rid, 0), t.length - 1) for t in batch]
        plan = budget.plan_forward([t.length - h for t, h in zip(batch, have)],
                                   [t.length - h - 1 for t, h in zip(batch, have)], most)
        return {id(t): h + chunk for t, h, chunk in zip(batch, have, plan) if chunk is not None}

    @staticmethod
    def _tree_rows(t: SimTask, outcome: Outcome) -> int:
        """A verify's rows beyond the tail: the draft, its runner-ups, the fused chain where one was found, a
        second drafter's chain (each counted in full, also where it shares the draft's first tokens)."""
        return t.k + (t.alts if t.k > 0 else 0) + (t.fuse if outcome[3] is not None else 0) + (t.second[1] if t.second else 0)

    def _draft_time(self, w: SimWorker, tasks: list[SimTask], ends: dict[int, int]) -> float:
        cost, cache = w.costs["draft"], w.caches["draft"]
        total = 0.0
        have = [cache.get(t.req.rid, 0) for t in tasks]
        new = [t.length - h if id(t) not in ends else max(0, ends[id(t)] - h) for t, h in zip(tasks, have)]
        step = 0
        active = [i for i, t in enumerate(tasks) if t.k > 0 and id(t) not in ends]
        chunks = [i for i, t in enumerate(tasks) if id(t) in ends and new[i] > 0]  # (in the first forward)
        while active or chunks:  # one forward per draft position, as ModelRunner.draft runs them
            ran = active + chunks
            tokens = sum(new[i] for i in ran)
            context = sum(have[i] for i in ran) + tokens
            total += self._forward_s(cost, len(ran), tokens, context, w.batch_costs["draft"])
            for i in chunks:
                cache[tasks[i].req.rid] = have[i] + new[i]
            chunks = []
            for i in active:
                have[i] += new[i]
                new[i] = 1
            step += 1
            active = [i for i in active if tasks[i].k > step]
        for t, h in zip(tasks, have):
            if t.k > 0 and id(t) not in ends:
                cache[t.req.rid] = h  # the last draft token is proposed, never fed
        return total

    def _verify_time(self, w: SimWorker, tasks: list[SimTask], outcomes: dict[int, Outcome], ends: dict[int, int]) -> float:
        cost, cache = w.costs["target"], w.caches["target"]
        have = [cache.get(t.req.rid, 0) for t in tasks]
        new = [t.length - h + self._tree_rows(t, outcomes[id(t)]) if id(t) not in ends else max(0, ends[id(t)] - h)
               for t, h in zip(tasks, have)]
        tokens = sum(new)
        context = sum(have) + tokens
        for t in tasks:  # (rejected drafts rolled back; a chunk: the prompt as far as it reached)
            cache[t.req.rid] = ends[id(t)] if id(t) in ends else t.length + outcomes[id(t)][0]
        ran = sum(1 for n in new if n)
        total = self._forward_s(cost, ran, tokens, context, w.batch_costs["target"]) if ran else 0.0
        for step in range(1, max(t.steps for t in tasks)):  # multi-step decodes: a forward of a row each per step
            going = [t for t in tasks if t.steps > step and id(t) not in ends]
            total += self._forward_s(cost, len(going), len(going), sum(t.length + step for t in going), w.batch_costs["target"])
        return total

    def _step_table(self, cost: CostModel) -> list[float]:
        """What a live worker's ``StepCosts.table`` would show: one sequence's forward by new rows
        (1..``FIT_ROWS``), here at the workload's mean context."""
        lo, hi = self.workload.prompt_tokens
        context = (lo + hi) // 2 + self.workload.output_tokens // 2
        return [self._forward_s(cost, 1, rows, context + rows) for rows in range(1, FIT_ROWS + 1)]

    def _forward_s(self, cost: CostModel, batch: int, tokens: int, context: int, seen: BatchCosts | None = None) -> float:
        """One forward's seconds; ``seen``: the worker's batch costs, which count it (as a live runner's)."""
        took = cost.forward_s(batch, tokens, context) + self.sc.host.forward_overhead_us * 1e-6
        if seen is not None:
            seen.observe(tokens, took)
        return took

    def _finish_batch(self, w: SimWorker, results: list[tuple[SimTask, Outcome | None]]) -> None:
        w.computing = None
        self.to_broker(self._results, w.wid, results)
        self._worker_step(w)

    # -- the report ----------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        makespan = max(self.t_done.values()) if self.t_done else 0.0
        start = min(r.t_submit for r in self.done) if self.done else 0.0
        wall = max(makespan - start, 1e-12)
        util = {w.wid: w.busy_s / wall for w in self.workers.values()}
        busy = sum(w.busy_s for w in self.workers.values())
        roles: dict[str, list[float]] = {}
        for w in self.workers.values():
            roles.setdefault(w.role, []).append(util[w.wid])
        return {
            "wall_s": wall, "requests": len(self.done), "tokens": self.tokens, "rounds": self.rounds,
            "tokens_per_s": self.tokens / wall, "round_rate": self.rounds / wall,
            "tokens_per_round": self.tokens / max(self.rounds, 1),
            "utilization": statistics.mean(util.values()),
            "utilization_by_role": {r: statistics.mean(v) for r, v in roles.items()},
            "workers": [{"id": w.wid, "role": w.role, "utilization": util[w.wid], "tasks": w.tasks,
                         "batches": w.batches, "mean_batch": w.tasks / max(w.batches, 1)}
                        for w in self.workers.values()],
            "rounds_by_drafter": dict(sorted(self.rounds_by_drafter.items())),
            "kv_bytes": sum(w.kv_bytes for w in self.workers.values()),
            "kv_pulls": sum(w.pulls for w in self.workers.values()),
            "kv_recomputed_positions": sum(w.recomputed for w in self.workers.values()),
            **prefix_report(list(self.workers.values()), self.cached_prompt, sum(len(r.prompt) for r in self.done)),
            "kv_stall_fraction": sum(w.stall_s for w in self.workers.values()) / max(busy, 1e-12),
            "stale_results": self.stale, "broker_utilization": self.broker_busy_s / wall,
            "draft_ahead": self.policy.ahead_stats.to_dict(),
            "ahead_hit_rate": self.policy.ahead_stats.hits / max(self.rounds, 1),
            "fusion": self.policy.fusion_stats.to_dict(),
            **latencies(self.done, self.t_done, self.workload),
        }


def simulate(sc: Scenario, mode: str, draft_workers: int | None = None, target_workers: int | None = None,
             workload: Workload | None = None) -> dict[str, Any]:
    return Simulator(sc, mode, draft_workers, target_workers, workload).run()
