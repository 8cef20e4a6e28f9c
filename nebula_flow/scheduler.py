"""The scheduling policy: pure bookkeeping over the request pool, its topics and its workers.

No sockets, no torch, no clock of its own (``now`` is passed in), so the live broker and a simulator drive the
same object. The broker feeds it events (a worker registers, pulls, returns a result, dies; a request arrives or
is cancelled) and sends what ``dispatch`` decides.

Modes (the same code, one switch):

* ``pooled``: M-for-N. Any draft worker takes any draft task, any target worker any verify
  task; every batch is rebuilt from the shared topics.
* ``paired``: draft worker i feeds target worker i only; a request is bound to one pair.
* ``colocated``: a worker holds both models; a request is bound to one worker, which runs
  whole rounds (``round`` tasks) for it.
* ``autoregressive``: target only; every round is a verify with no draft (one token; several alone, ``steps``).
* ``elastic``: a worker holding both models (role ``any``) takes whole rounds, a draft batch or a
  verify batch at each PULL (``elastic.choose_stage``); draft-only and target-only workers may join.

Several drafters (pooled mode): each round's draft goes to the drafter ``routing.choose_drafter`` picks for the
request, taken by any worker of it (any draft worker when none is left); a request's draft KV is per drafter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nebula_flow import ahead, balance, elastic, fusion, roles, routing, speclen
from nebula_flow.policy import PolicyConfig
from nebula_flow.prefixes import PrefixRoutes, learnt
from nebula_flow.request import DONE, DRAFT, ROUND, VERIFY, Request
from nebula_flow.roles import MODES, PHASE_ROLE, ROLE_TOPICS, STAGE_TOPIC, Binder, WorkerState, holder_key
from nebula_flow.speclen import Acceptance
from nebula_flow.topic import Topic


class Scheduler:
    """Request pool + topics + workers for one mode; decides who runs what next."""

    def __init__(self, mode: str, policy: PolicyConfig | None = None) -> None:
        """``policy``: every knob, its default and its meaning (``nebula_flow.policy``). Notes on how the scheduler
        uses them:

        ``locality`` never makes a task wait for a particular worker. ``measure_costs``: the draft step and the
        verify blocks follow the forward times workers report (``observe_costs``); ``spec_costs`` only starts them.
        ``first_alternatives`` and ``fuse_ngram`` build a token tree per round; with ``adaptive_k`` only where its
        rows pay (``speclen.choose_round``, ``speclen.choose_fuse``). A fused chain is looked up by the draft
        worker, or by the target worker in a round without a draft, so rounds that ``disable_by_batch_size`` or
        adaptive k leave without drafts still get it (not in autoregressive mode, the baseline).
        ``disable_by_batch_size`` leaves seeded sampled requests speculating: their k decides which sample they
        draw, and it must not depend on the load."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self.policy = policy = policy or PolicyConfig()
        # what choose_round weighs now (measured, with measure_costs): the three costs, verify forwards by rows
        self.costs, self.verify_costs = policy.spec_costs, ()
        self.step_costs: dict[tuple[int, str], list[float | None]] = {}  # (worker, role) -> seconds by rows
        self.batch_costs: dict[tuple[int, str], list[float | None]] = {}  # the same by batch rows (``elastic``)
        # several drafters: each one's (costs, verify costs), and the pool's recent acceptance of each for
        # greedy and sampled requests (they differ widely): where requests start a drafter (``routing``)
        self.drafter_costs: dict[str, tuple[tuple[float, float, float], tuple[float | None, ...]]] = {}
        self.drafter_acceptance: dict[tuple[str, bool], Acceptance] = {}  # (drafter, greedy) ->
        self.drafters: dict[str, int] = {}  # drafter -> live draft workers
        self.requests: dict[int, Request] = {}
        self.streaming = 0  # requests of the pool whose output has begun (``budget.prefills_whole``)
        self.topics: dict[str, Topic] = {role: Topic() for role in ("draft", "target", "colocated", "ahead", fusion.TOPIC)}
        self.ahead_stats = ahead.AheadStats()  # draft-ahead's pre-drafts (``nebula_flow/ahead.py``)
        self.fusion_stats = fusion.FusionStats()  # second drafts of fused rounds (``nebula_flow/fusion.py``)
        self.workers: dict[int, WorkerState] = {}
        self.homes: dict[int, int] = {}  # elastic: slot -> its worker (a request's home: ``_holder``)
        self.binder = Binder()  # the work bound to each slot (paired, colocated, elastic)
        self.pull_rates: dict[int, float] = {}  # worker -> seconds per KV position it pulled (``balance.observe_pulls``)
        self.sharing: frozenset[int] = frozenset()  # dispatch: workers whose held tasks others take, priced (balance)
        self.prefixes: PrefixRoutes | None = None  # cache-aware placement (the broker's; a simulator's whose prompts share)

    # -- workers ---------------------------------------------------------------------------
    def register(self, worker_id: int, role: str, capacity: int, drafter: str | None = None,
                 draft_capacity: int | None = None) -> int:
        """Add a worker; returns its slot (its pair index, or colocated index). ``drafter``: a draft
        worker's drafter (``DEFAULT_DRAFTER`` when None); ``draft_capacity``: an elastic worker's draft
        batches' most tasks (a small model drafts large batches for little more than small ones)."""
        if role not in MODES[self.mode]:
            raise ValueError(f"mode {self.mode} has no {role!r} workers (roles: {', '.join(MODES[self.mode])})")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        used = {w.slot for w in self.workers.values() if w.role == role}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        drafter = (drafter or roles.DEFAULT_DRAFTER) if role == "draft" else None
        self.workers[worker_id] = WorkerState(worker_id, role, slot, capacity, drafter=drafter,
                                              draft_capacity=draft_capacity if role == "any" else None)
        if drafter is not None:
            self.drafters[drafter] = self.drafters.get(drafter, 0) + 1
        if role == "any":
            self.homes[slot] = worker_id
        self.binder.reset()
        self._bind([req for req in self.requests.values() if req.slot is None])
        return slot

    def unregister(self, worker_id: int) -> list[int]:
        """Drop a worker; its in-flight tasks go back to the front of their topics."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        ahead.unregister(self, w)
        if w.drafter is not None:
            self.drafters[w.drafter] -= 1
            if not self.drafters[w.drafter]:
                del self.drafters[w.drafter]
                self.drafter_costs.pop(w.drafter, None)
        fusion.unregister(self, w)
        elastic.unregister(self, w)
        self.pull_rates.pop(worker_id, None)
        self.binder.reset()
        requeued = [rid for rid in sorted(w.inflight) if rid in self.requests and self.requests[rid].phase != DONE]
        for rid in requeued:
            self._requeue(self.requests[rid])
        for req in self.requests.values():
            req.holders = {role: held for role, held in req.holders.items() if held[0] != worker_id}
        for topic in self.topics.values():
            topic.forget_holder(worker_id)
        self.batch_costs = {key: v for key, v in self.batch_costs.items() if key[0] != worker_id}
        if any(key[0] == worker_id for key in self.step_costs):
            self.step_costs = {key: v for key, v in self.step_costs.items() if key[0] != worker_id}
            self._update_costs()
        return requeued

    def observe_costs(self, worker_id: int, role: str, seconds: list[float | None], by_batch: bool = False) -> None:
        """A worker's forward times for its ``role``'s model by new rows of one sequence (``speclen.StepCosts.table``;
        None where not seen); ``by_batch``: by a forward's rows in all (``elastic.BatchCosts.table``: elastic merging)."""
        if worker_id in self.workers and role in ("draft", "target") and any(t is not None for t in seconds):
            if by_batch:
                self.batch_costs[(worker_id, role)] = list(seconds)
                return
            self.step_costs[(worker_id, role)] = list(seconds)
            self._update_costs()

    def observe_pulls(self, worker_id: int, seconds: object, positions: object) -> None:
        """A worker's KV pull counters: what moving a position to it costs (``balance.observe_pulls``)."""
        balance.observe_pulls(self, worker_id, seconds, positions)

    def _update_costs(self) -> None:
        """The costs ``choose_round`` uses: per row count, the median worker's of each role (a request may run on any)."""
        if not self.policy.measure_costs:
            return

        def median(role: str, drafter: str | None = None) -> list[float | None] | None:
            return speclen.median_table([t for (wid, r), t in self.step_costs.items() if r == role
                                         and (drafter is None or self.workers[wid].drafter == drafter)])

        target = median("target")
        self.costs, self.verify_costs = speclen.measured_costs(median("draft"), target, self.policy.spec_costs)
        # (one drafter left: ``costs`` are its own; a colocated worker's draft has no drafter, never routed)
        self.drafter_costs = {d: speclen.measured_costs(median("draft", d), target, self.policy.spec_costs)
                              for d in self.drafters} if len(self.drafters) > 1 else {}

    def pull(self, worker_id: int, credits: int, idle: bool, now: float) -> None:
        w = self.workers[worker_id]  # (credits 0 withdraws a waiting PULL: a worker about to leave takes no more)
        w.pull_credits, w.pull_idle, w.pull_since = max(0, credits), idle, now

    # -- requests --------------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.streaming += len(req.output) > 0
        if self.prefixes is None or not self.prefixes.place(req, self.workers, self.policy.wait_for_prefix):
            self.start(req)  # (else it waits for the request computing its prompt's start: ``prefixes.learnt``)

    def start(self, req: Request) -> None:
        self._bind([req])  # (paired, colocated, elastic: the slot it is bound to)
        self.start_round(req)

    def start_round(self, req: Request) -> None:
        """Queue the next round of ``req``: a draft, a draft-less verify, or a whole round."""
        req.round += 1
        req.draft, req.q, req.runner_ups, req.chains, req.steps = [], {}, [], [], 1
        max_alts = self.policy.first_alternatives
        loaded = 0 < self.policy.disable_by_batch_size < len(self.requests) and not req.reproducible  # (__init__)
        speculate = self.mode != "autoregressive" and req.remaining > 1 and not loaded
        req.drafter, explore, plan = routing.route(self, req, max_alts) if speculate and self.mode == "pooled" and self.drafters \
            else (None, False, None)
        if self.policy.adaptive_k:
            if plan is None:  # (planned_costs: draft-ahead takes drafts off the critical path)
                costs, verify = self.costs_for(req, req.drafter)
                plan = speclen.choose_round(req.acceptance, self.policy.k, ahead.planned_costs(self, req, req.acceptance, costs),
                                            max_alts, verify)
            k, alts = plan
            k = max(k, 1) if explore or req.round % speclen.RECHECK_EVERY == 0 else k  # (a look: speclen.RECHECK_EVERY)
        else:
            k, alts = self.policy.k, max_alts
        req.k = max(0, min(k, req.remaining - 1)) if speculate else 0
        req.alts = alts if req.k > 0 else 0
        # (a chain no longer than the tokens left, as the draft, and long where the client predicted the output;
        # with adaptive k only where it pays for its rows, planned for a seeded sample from its own history, as its k)
        req.fuse = min(speclen.longest_chain(self.policy.fuse_ngram, req.prediction is not None, req.acceptance),
                       req.remaining - 1) if self.mode != "autoregressive" else 0
        if req.fuse and self.policy.adaptive_k:
            req.fuse = speclen.choose_fuse(req.acceptance, req.k, req.alts, req.fuse, *self.costs_for(req, req.drafter),
                                           batch=self._verify_batch() if loaded else 1)
        if req.k == 0:
            req.drafter = None  # no draft this round
        req.ks.append(req.k)
        req.phase = ROUND if self.mode == "colocated" else DRAFT if req.k > 0 else VERIFY
        if req.phase != DRAFT or not ahead.take(self, req):  # (a pre-drafted branch: its verify is queued)
            self.enqueue(req)
            fusion.plan(self, req)  # (a second drafter's chain beside the draft, where it pays)

    def _verify_batch(self) -> int:
        """About how many requests share a target's verify forward: the pool over the targets."""
        targets = sum(1 for w in self.workers.values() if w.role in ("target", "colocated", "any")) or 1
        return -(-len(self.requests) // targets)

    def costs_for(self, req: Request, drafter: str | None) -> tuple[tuple[float, float, float], tuple[float | None, ...]]:
        """The costs ``req``'s round is planned with: measured ones (of ``drafter``'s workers where
        several drafters run), except for a seeded sampled request, whose k and drafter decide
        which sample it draws: it is planned from its own history and ``spec_costs`` alone, so the
        same seed gives the same output whatever the placement and the machine's timing."""
        if req.reproducible:
            return self.policy.spec_costs, ()
        return self.drafter_costs.get(drafter, (self.costs, self.verify_costs)) if drafter else (self.costs, self.verify_costs)

    def draft_done(self, req: Request, worker_id: int, draft: list[int], q: dict) -> None:
        """A draft arrived (it may be shorter than ``req.k``: e.g. an n-gram drafter without a match)."""
        self.use_draft(req, worker_id, draft, q)

    def use_draft(self, req: Request, worker_id: int, draft: list[int], q: dict, drafter: str | None = None) -> None:
        """``draft`` (by ``worker_id``) is the draft of ``req``'s round: its verify is queued. Not an
        event of its own for a pre-drafted branch (draft-ahead: ``drafter``, its worker's, which
        may have left since): a policy log replays that from the round's end or the pre-draft's return."""
        req.draft, req.q, req.phase = draft, q, VERIFY
        req.proposed += len(draft)
        w = self.workers.get(worker_id)
        drafter = w.drafter if w is not None else drafter
        if drafter is not None and drafter != req.drafter:  # (no worker of the routed drafter was left)
            req.acceptance = req.by_drafter.setdefault(drafter, routing.starting_acceptance(None))
        req.drafter = drafter
        if drafter is not None:
            req.drafter_used[drafter] = req.round
            req.drafter_rounds[drafter] = req.drafter_rounds.get(drafter, 0) + 1
        if w is not None:
            req.holders[holder_key("draft", drafter)] = (worker_id, len(req.prompt) + len(req.output) + max(0, len(draft) - 1))
            w.inflight.discard(req.rid)
        if not fusion.holds_verify(self, req):  # (a fused round's verify waits for its running second draft)
            self.enqueue(req)
        ahead.queue(self, req, worker_id)  # (draft-ahead: the next round's pre-draft, while this one verifies)

    def second_done(self, req: Request, worker_id: int, draft: list[int] | None, prefilled: int | None = None) -> None:
        """A second draft of ``req``'s round came back (fused drafters, ``fusion.done``); None: it failed."""
        fusion.done(self, req, worker_id, draft, prefilled)

    def predrafted(self, req: Request, worker_id: int, branches: list[ahead.Branch]) -> None:
        """A pre-draft of ``req``'s next round came back (draft-ahead, ``ahead.done``)."""
        ahead.done(self, req, worker_id, branches)

    def prefilled(self, req: Request, worker_id: int, valid: int) -> None:
        """A worker computed a chunk of ``req``'s prompt (chunked prefill) and holds ``valid`` positions of the KV its
        task needs: the same task goes back on its topic for the rest (to that worker, by locality, unless another is idle)."""
        req.holders[self.task_holder_key(req)] = (worker_id, valid)
        if self._unround(req):  # (an elastic round prefilled both models)
            req.holders["target"] = (worker_id, valid)
        self.workers[worker_id].inflight.discard(req.rid)
        self.enqueue(req)

    def retry(self, req: Request, worker_id: int) -> None:
        """``req``'s task, whose tokens ``worker_id`` lacked (``broker/known.py``), back at the front of its topic."""
        self.workers[worker_id].inflight.discard(req.rid)
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        self._unround(req)
        self.topics[PHASE_ROLE[req.phase]].appendleft(req.rid, self._holder(req), req.params.priority)

    def _unround(self, req: Request) -> bool:
        """An elastic worker's whole round going back to a topic: the draft (or draft-less verify) it was."""
        if unround := req.phase == ROUND and self.mode == "elastic":
            req.phase = DRAFT if req.k > 0 else VERIFY
        return unround

    def verify_done(self, req: Request, worker_id: int, accepted: int, via_alt: bool = False,
                    draft_accepted: int | None = None, fused: int | None = None, second: int | None = None) -> None:
        """Record a verify's (or whole round's) outcome in the policy's state (``end_round`` calls it).

        ``via_alt``: the accepted token was an alternative to the first draft token (a token tree), not the draft:
        the draft's acceptance was 0, and the draft's KV ends before it. ``draft_accepted``: the draft tokens
        accepted, where a fused chain won more than the draft had (the draft's acceptance and its KV count only
        those); by default ``accepted`` (0 via_alt). ``fused``: the tokens a fused chain won beyond the draft
        (``broker/results.py``), None when the round verified none. ``second``: a fused round's second chain's
        tokens on the committed path (``fusion.verified``), None without one."""
        drafted = accepted if self.mode != "autoregressive" else 0  # (a multi-step decode's tokens: none drafted)
        req.accepted += drafted
        draft_accepted = (0 if via_alt else drafted) if draft_accepted is None else draft_accepted
        req.acceptance.update(req.k, draft_accepted)  # (a draft shorter than k counts as rejected where it stopped)
        req.acceptance.update_alternatives(req.alts, draft_accepted, via_alt)
        if self.policy.fuse_ngram and self.mode != "autoregressive" and (fused is not None or not req.fuse):
            req.acceptance.update_fused(fused)  # (asked for but no match: no evidence either way)
        if req.drafter is not None and len(self.drafters) > 1:
            self.drafter_acceptance.setdefault((req.drafter, req.params.greedy), Acceptance()).update(req.k, draft_accepted,
                                                                                                   routing.POOL_DECAY)
        base = len(req.prompt) + len(req.output)
        role = "colocated" if req.phase == ROUND and self.mode == "colocated" else "target"
        req.holders[role] = (worker_id, base + accepted)
        if req.phase == ROUND and self.mode == "elastic" and req.k > 0:  # it drafted here too (as draft_done)
            req.holders["draft"] = (worker_id, base + max(0, req.k - 1))
        draft_key = holder_key("draft", req.drafter)
        if draft_key in req.holders:
            holder, draft_valid = req.holders[draft_key]
            req.holders[draft_key] = (holder, min(draft_valid, base + draft_accepted))
        fusion.verified(self, req, draft_accepted, via_alt, second)
        self.workers[worker_id].inflight.discard(req.rid)

    def end_round(self, req: Request, worker_id: int, committed: list[int], via_alt: bool = False,
                  draft_accepted: int | None = None, fused: int | None = None, eos_ids: tuple[int, ...] = (),
                  stop_text: Callable[[Request], bool] | None = None, second: int | None = None) -> list[int]:
        """The end of a verify (or whole round), the one place a round ends: record the outcome
        (``verify_done``), commit the tokens (cut at EOS and ``max_new_tokens``), decide whether
        the request is done (EOS, length, or ``stop_text``: the caller's check of the decoded text
        against stop strings, None where there is no text), then finish it or queue its next round.

        ``committed``: the accepted draft tokens and the target's next token. Returns the tokens
        kept; ``req.finish_reason`` is set when the request ended (it has then left the pool)."""
        self.verify_done(req, worker_id, len(committed) - 1, via_alt, draft_accepted, fused, second)
        before, kept = len(req.output), req.commit(committed, eos_ids)
        if 0 < len(kept) == len(req.output):  # its first tokens: its prompt's KV is held now, so requests that
            self.streaming += 1  # start alike are placed by it (``prefixes``) before this one ends, as after
            learnt(self, req)
        if stop_text is not None and stop_text(req):  # (which may end the output at the stop string's last token)
            req.finish_reason, kept = "stop", req.output[before:]
        if req.finish_reason:
            self.finish(req.rid)
        else:
            self.start_round(req)
        return kept

    def finish(self, rid: int) -> Request | None:
        """Remove a request (done or cancelled) from the pool and from any topic."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        self.streaming -= len(req.output) > 0
        learnt(self, req)  # (where its tokens' KV stays, for requests that start with them)
        ahead.forget(self, rid)
        fusion.forget(self, rid)
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
        req, w = self.requests.get(rid), self.workers.get(worker_id)
        if req is None or w is None or rid not in w.inflight or req.attempt != attempt or req.phase != kind:
            return None
        return req

    # -- the decision ----------------------------------------------------------------------
    def dispatch(self) -> list[tuple[int, list[Request]]]:
        """Serve waiting PULLs from the topics: idle workers first, the one idle the shortest first (its caches are
        warm and, on a CPU host, it still holds the cores idle workers lend: the longest idle took each new single-
        stream request on one core of two), then busy ones by arrival.

        With ``locality`` on, a first pass gives every waiting worker the tasks whose KV it already holds (of the
        most urgent priority queued). In the second pass an idle worker takes any remaining task in topic order,
        but a busy worker only prefetching takes no task another live worker holds (unless more urgent than its own:
        ``Topic.overtaking_bar``): moving that KV would buy nothing.

        A busy worker is also not given a partial batch no larger than the one it is running (``holds_back``): that
        would split its requests into two groups that alternate for ever, each paying a whole forward (a GPU's weight
        read) for half the work. The tasks wait and join the returning ones when it goes idle, unless idle workers
        take them (``balance.release``). Several idle elastic workers share a pool one of them holds by turns
        (``balance.spreads``); both move KV only where it pays."""
        waiting = sorted((w for w in self.workers.values() if w.pull_credits > 0),
                         key=lambda w: (not w.pull_idle, -w.pull_since if w.pull_idle else w.pull_since, w.worker_id))
        picks: dict[int, list[int]] = {}
        taken: set[int] = set()
        for w in waiting:
            w.stage = None if w.role == "any" else ROLE_TOPICS[w.role][0]
        balance.serve(self, waiting, picks, taken)  # (the passes: held tasks first, then the rest)
        seconds = fusion.dispatch(self, waiting, picks) if self.topics[fusion.TOPIC] else {}  # (second drafts join)
        if self.topics["ahead"]:
            ahead.dispatch(self, waiting, picks)  # (draft workers left without a draft task: pre-drafts)
        out = []
        for w in waiting:
            rids = picks.get(w.worker_id)
            if not rids or self.holds_back(w, rids):
                continue
            w.pull_credits = 0
            out.append((w.worker_id, ahead.commit(self, w, rids) if w.stage == "ahead"
                        else self._commit(w, rids, seconds.get(w.worker_id, ()))))
        return out

    def holds_back(self, w: WorkerState, rids: list[int] | None) -> bool:
        """Whether busy worker ``w`` waits rather than take ``rids`` beside a running batch as large (``dispatch``)."""
        return bool(rids) and self.policy.merge_batches and w.stage != "ahead" and not w.pull_idle \
            and len(w.inflight) >= len(rids) < self._room(w, w.stage)

    def _room(self, w: WorkerState, stage: str | None) -> int:
        return min(w.pull_credits, w.draft_capacity if stage == "draft" and w.draft_capacity else w.capacity)  # (round: verify's)

    def _choose(self, w: WorkerState, room: int, held_only: bool, taken: set[int], stage: str | None = None) -> list[int]:
        """Up to ``room`` queued tasks for ``w`` in queue order (not yet removed from the topic),
        from ``stage``'s topic (by default the one its PULL is served from)."""
        stage = stage or w.stage
        if stage == "round":  # (an elastic worker's: from two topics, ``elastic.choose_rounds``)
            return elastic.choose_rounds(self, w, room, held_only, taken)
        return self._choose_from(self.topics[STAGE_TOPIC[stage]], w, stage, room, held_only, taken)

    def _choose_from(self, topic: Topic, w: WorkerState, stage: str, room: int, held_only: bool, taken: set[int],
                     bare: bool = False) -> list[int]:
        """``_choose`` in one topic; ``bare``: only tasks without a draft. An idle elastic worker takes others'
        tasks only while the KV moves pay (``balance.Steals``), whole rounds up to its share of the pool; the round's
        request makes it its home (``_commit``). Its merged draft batch, busy or idle, takes its own requests' drafts
        and unheld ones: another's draft KV would move there and back again. Urgent ones: ``Topic.overtaking_bar``.
        A worker ``sharing`` its tasks (``balance``) takes its own up to its share; others take them as elastic rounds."""
        rounds = stage == "round"
        busy_local = self.policy.locality and (not w.pull_idle or stage == "draft" and w.role == "any") and not held_only
        sharing = self.sharing if w.role != "any" or rounds else frozenset()
        share = balance.share(self, w, stage, room) if rounds or sharing else room
        if held_only:
            candidates: Iterable[int] = topic.held_by([w.worker_id], most_urgent=True)
        elif busy_local:  # a prefetching worker: urgent tasks, its own, unheld ones, and those of departed holders
            candidates = topic.urgent_or_held_by([h for h in topic.holders() if h is None or h == w.worker_id
                                                  or h not in self.workers])
        else:
            candidates = topic
        chosen, steals = [], balance.Steals(self, w) if (w.role == "any" or sharing) and not held_only else None
        bar = topic.overtaking_bar(w.worker_id, (self.requests[r].params.priority for r in w.inflight if r in self.requests))
        for rid in candidates:  # stop at ``room``: a long topic costs nothing when its head is eligible
            if rid in taken or rid in w.second or rid in chosen:  # (a worker never runs both drafts of a fused round)
                continue
            req = self.requests[rid]
            if not self._eligible(req, w) or (bare and req.draft):
                continue
            holder = self._holder(req)  # checked again: the index is a hint, this is the rule
            if held_only and holder != w.worker_id:
                continue
            if holder != w.worker_id and req.params.priority >= bar and (busy_local and holder in self.workers
                    or (rounds or holder in sharing) and len(chosen) >= share
                    or steals and (w.role == "any" or holder in sharing) and holder in self.workers and not steals.take(req)):
                continue  # leave it for its holder or an idle worker (elastic: while the KV moves pay)
            if holder == w.worker_id and w.worker_id in sharing and len(chosen) >= share:
                continue  # its own past its share: first the other idle workers' turns (``balance.spreads``)
            chosen.append(rid)
            if len(chosen) == room:
                break
        return chosen

    def _commit(self, w: WorkerState, rids: list[int], seconds: Iterable[int] = ()) -> list[Request]:
        batch = []
        for rid in rids:
            req = self.requests[rid]  # (from its stage's topic; a round's draft-less verify: the target's)
            if rid in seconds:  # (a second draft of a fused round: ``fusion``)
                batch.append(fusion.commit(self, w, req))
                continue
            next(t for t in (self.topics[STAGE_TOPIC[w.stage]], self.topics["target"]) if rid in t).remove(rid)
            req.attempt += 1
            if w.stage == "round":  # (an elastic worker runs it as a whole round, and is its home from now)
                req.phase, req.slot = ROUND, w.slot
            w.inflight.add(rid)
            batch.append(req)
        return batch

    def enqueue(self, req: Request) -> None:
        """Queue ``req``'s next task on its phase's topic."""
        self.topics[PHASE_ROLE[req.phase]].append(req.rid, self._holder(req), req.params.priority)

    def task_holder_key(self, req: Request) -> str:
        """The ``holders`` key of the KV ``req``'s queued task needs (an elastic round's: its draft KV's;
        its target KV's is ``holders["target"]``)."""
        role = "draft" if req.phase == ROUND and self.mode == "elastic" else PHASE_ROLE[req.phase]
        return holder_key(role, req.drafter) if req.phase == DRAFT else role  # (a drafter's own key: drafts only)

    def _holder(self, req: Request) -> int | None:
        """The worker ``req``'s queued task stays with while it is busy (``locality``): the holder of the KV
        it needs, or an elastic request's home (``elastic.home``)."""
        key = self.task_holder_key(req)
        held = (req.holders.get(key) or req.affinity.get(key) or (None, 0))[0]  # (new: where its prefix likely is)
        return elastic.home(req, held, self.homes, self.workers) if self.mode == "elastic" else held

    def _eligible(self, req: Request, w: WorkerState) -> bool:
        if self.mode in ("paired", "colocated"):
            return req.slot == w.slot
        if not routing.routed_to(self, req, w):
            return False
        if self.policy.migrate and self._holder(req) == w.worker_id:
            topic = PHASE_ROLE[req.phase]
            return not any(topic in ROLE_TOPICS[o.role] and o.worker_id != w.worker_id and routing.routed_to(self, req, o)
                           for o in self.workers.values())
        return True

    def _bind(self, reqs: list[Request]) -> None:
        """Paired/colocated: bind requests to the least-loaded slots that exist now (``roles.Binder``); elastic:
        their homes, unless draft-only workers draft new requests (a request's first round there runs as a round)."""
        if reqs and (self.mode in ("paired", "colocated") or self.mode == "elastic" and not self.drafters):
            self.binder.bind(self.mode, self.workers.values(), self.requests.values(), reqs, self.policy)

    def depth(self) -> dict[str, int]:
        return {role: len(q) for role, q in self.topics.items() if any(role in ROLE_TOPICS[r] for r in MODES[self.mode])}
