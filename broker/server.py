"""The broker: one request pool, a draft topic and a target topic, two ROUTER sockets.

Clients (DEALER) submit, cancel and receive streamed tokens on the client socket; workers
(DEALER) register, pull, and return results on the worker socket. The decisions are the
``Scheduler``'s; this module only moves messages, validates them and keeps counters. It
never blocks on a peer: every send is non-blocking, and a peer that cannot take a message is
dropped (a worker's tasks are re-queued).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, OrderedDict, deque
from typing import Any

import zmq

from nebula_flow import ahead, elastic, fusion, protocol, zmq_frames
from nebula_flow.listen import bind_zmq
from nebula_flow.log_cap import LogCap
from nebula_flow.metrics import MetricsServer
from nebula_flow.metrics import render as render_metrics
from nebula_flow.options import BrokerOptions
from nebula_flow.policy_log import RecordingScheduler
from nebula_flow.prefixes import PrefixRoutes
from nebula_flow.process import orphaned, restarts, wake_on_stop_signals
from nebula_flow.protocol import (
    Bye,
    Chunks,
    Done,
    Error,
    Free,
    Heartbeat,
    Msg,
    ProtocolError,
    Pull,
    Register,
    Rejected,
    Result,
    TaskResult,
    Tasks,
    Timing,
    Tokens,
    Welcome,
    lacked_tokens,
)
from nebula_flow.request import AHEAD, DRAFT, ROUND, Request
from nebula_flow.roles import MODEL_ROLES, MODES
from nebula_flow.round_times import RoundTimes
from nebula_flow.scheduler import Scheduler
from nebula_flow.security import user_id
from nebula_flow.speclen import FIT_ROWS
from nebula_flow.topic import queued_by_priority
from nebula_flow.wire import req_id_of
from nebula_flow_broker import known, results
from nebula_flow_broker.access import Access, metrics_token
from nebula_flow_broker.activity import ActivityLog
from nebula_flow_broker.admission import Admission
from nebula_flow_broker.intake import Intake, chunk_groups
from nebula_flow_broker.stats import BrokerStats, WorkerInfo, served
from nebula_flow_broker.tasks import task_specs
from nebula_flow_broker.tokenizing import PromptTokenizer

log = logging.getLogger("nebula_flow.broker")


class Broker(Intake):
    def __init__(self, opts: BrokerOptions) -> None:
        opts.check()
        self.opts = opts
        policy = RecordingScheduler if opts.policy_log else Scheduler
        self.scheduler = policy(opts.mode, opts.policy)
        if opts.policy.prefix_affinity:  # (cache-aware placement: the prompts' tokens are real here)
            self.scheduler.prefixes = PrefixRoutes()
        self.admission = Admission(opts.model, opts.max_new_tokens_limit, opts.policy.priority_scheduling, opts.max_model_len)
        self.prompts = PromptTokenizer(self.admission.prepare)
        if self.admission.codec is not None:  # (on the tokenizer thread: the first chat request need not wait for it)
            self.prompts.pool.submit(self.admission.codec.compile_chat_template)
        self.stats = BrokerStats()
        self.round_times = RoundTimes()
        self.counters, self.errors = self.stats.counters, self.stats.errors
        self.workers: dict[int, WorkerInfo] = {}
        self.by_identity: dict[bytes, int] = {}
        # Client-chosen request ids (random, unique) make SUBMIT idempotent: a retry of a running
        # request re-attaches to it, a retry of a finished one gets its result again.
        self.by_req_id: dict[str, int] = {}
        self.finished: OrderedDict[str, tuple[str, Done, list | None]] = OrderedDict()  # req_id -> (owner, result, logprobs)
        self.finished_logprobs, self.finished_logprob_tokens = deque[tuple[str, int]](), 0  # (logprobs kept: oldest first)
        self.owners: dict[str, str] = {}  # running req_id -> its owner (see ``owner_of``)
        self.digests: dict[str, bytes] = {}  # req_id -> what it asked (``intake.submitted``): a retry, or a new request?
        self.inflight_by_owner: Counter[bytes] = Counter()
        self.next_rid, self.next_worker = opts.shard + 1, 1  # (shards number requests apart: see _submit)
        self.frees, self.gone = [], {}  # (requests whose KV workers may drop; clients a send failed to, since: reap_clients)
        self.draining_since: float | None = None
        self.started, self.metrics = time.monotonic(), None
        self.failure_log = LogCap(10)  # (a line for each failed request: its client id beside its rid, which workers log)
        self.activity = ActivityLog(opts.stats_log_s, self.started, opts.mode)  # (the log's line every stats_log_s)
        self.client_outbox: list[tuple[bytes, Msg]] = []  # see _send
        self.outbox_logprobs = False  # a chunk in it carries logprobs (``intake.chunk_groups``)

    # -- sockets ---------------------------------------------------------------------------
    def bind(self) -> None:
        self.access = Access(self.opts)
        self.clients, self.peers = (zmq.Context.instance().socket(zmq.ROUTER) for _ in range(2))
        for sock, accepts in ((self.clients, "client"), (self.peers, "worker")):
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # learn about vanished peers instead of dropping silently
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            self.access.secure(sock, accepts)
        for sock, address in ((self.clients, self.opts.client_address), (self.peers, self.opts.worker_address)):
            bind_zmq(sock, address)  # (a port that is taken: one line, not a traceback)
        self.endpoints = [sock.getsockopt(zmq.LAST_ENDPOINT).decode() for sock in (self.clients, self.peers)]  # (port 0)
        self._last_beat = self._last_render = time.monotonic()  # (``step``'s heartbeats and metrics)

    def _send(self, sock: zmq.Socket, identity: bytes, msg: Msg) -> bool:
        if sock is self.clients:
            # Clients hear of a round after the next round's tasks are out (``step`` flushes this
            # once it has dispatched): on a loaded host a client woken by its tokens competes with
            # the worker that has to start the next round (measured ~0.5 ms of a round's latency).
            self.client_outbox.append((identity, msg))
            return True
        return self._send_now(sock, identity, msg)

    def _send_now(self, sock: zmq.Socket, identity: bytes, msg: Msg) -> bool:
        try:
            zmq_frames.send(sock, [identity, *protocol.encode(msg)], zmq_frames.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            self.counters["send_failures"] += 1
            if sock is self.clients and exc.errno == zmq.EHOSTUNREACH:  # (gone, not slow: ``reap_clients``)
                self.gone.setdefault(identity, time.monotonic())
            return False

    def _finish(self, rid: int, reason: str, error: tuple[str, str] | None = None) -> None:
        """End a request the policy still holds (cancelled, failed, or the broker stopping)."""
        req = self.scheduler.finish(rid)
        if req is not None:
            req.finish_reason = req.finish_reason or reason
            self._close(req, error)

    def _stream(self, req: Request, kept: list[int], delta: str, at: int, now: float, logprobs: list | None = None) -> None:
        """Send what a verify committed (``delta``: the text released from character ``at``, ``Admission.release``)."""
        if req.t_first is None:
            req.t_first = now
        self._send(self.clients, req.owner, Tokens(req.req_id, kept, delta, len(req.output) - len(kept), at, logprobs))

    # -- workers ---------------------------------------------------------------------------
    def on_worker(self, identity: bytes, frames: list[Any], now: float) -> None:
        arrived = time.perf_counter()  # (round_times: the message's decoding is the broker's time)
        wid = self.by_identity.get(identity)
        try:
            msg = protocol.decode(frames)
            if isinstance(msg, Register):
                return self._register(identity, msg, now, user_id(frames[0]))
            if wid is None and msg.KIND in protocol.CLIENT_KINDS:
                raise ProtocolError("wrong_address", "this is the broker's worker address: clients connect to its "
                                                     f"client address, {self.endpoints[0]}")
            if wid is None:
                raise ProtocolError("unknown_worker", "register first")
            self.workers[wid].last_seen = now
            if isinstance(msg, Pull):
                self.counters["pulls"] += 1
                self.scheduler.pull(wid, min(msg.credits, protocol.MAX_CAPACITY), msg.idle, now)
            elif isinstance(msg, Result):
                self._results(wid, identity, msg, now, arrived)
            elif isinstance(msg, Bye):
                self._drop_worker(wid, "left")
            elif isinstance(msg, Error):  # a worker rejected something we sent it
                self.errors[f"worker_reported_{msg.code}"] += 1
            elif not isinstance(msg, Heartbeat):
                raise ProtocolError("unexpected_kind", f"{msg.KIND} is not a worker message")
        except ProtocolError as exc:  # (with the request id of a client's message, which its request then raises)
            self._reject(self.peers, identity, exc.code, exc.message, req_id_of(frames, protocol.MAX_REQ_ID))
        except Exception as exc:  # a bug must cost one message, never the broker
            self._internal(self.peers, identity, exc)

    def _results(self, wid: int, identity: bytes, msg: Result, now: float, arrived: float) -> None:
        info = self.workers[wid]
        info.busy_s += max(0.0, msg.busy_s)
        if msg.kv is not None:
            info.kv = msg.kv
            self.scheduler.observe_pulls(wid, msg.kv.get("pull_s"), msg.kv.get("pulled"))
        if msg.device is not None:
            info.device = msg.device
            self._observe_costs(wid, msg.device.get("step_costs"), msg.device.get("batch_costs"))
        predrafts: dict[tuple[int, int], list[TaskResult]] = {}  # (draft-ahead: each request's branches together)
        for item in msg.results:
            if isinstance(item, Rejected):  # one bad entry must not strand the others
                self._reject(self.peers, identity, item.error.code, item.error.message)
                if item.head is not None:  # its request ends with a clear error, never a hang
                    self._fail_result(wid, item.head, item.error.message)
                continue
            if lacked_tokens(item.error) and (req := self.scheduler.requests.get(item.rid)) is not None:
                req.known.pop(wid, None)  # (it lacked tokens it was sent before: its next task carries them all)
                req.resent += 1
                self.counters["tokens_resent"] += 1
            if item.kind == AHEAD:
                predrafts.setdefault((item.rid, item.attempt), []).append(item)
                continue
            if item.kind == DRAFT and item.attempt < 0:  # (a fused round's second draft)
                self._second(wid, item.rid, item.attempt, item)
                continue
            self._result(wid, item, now, arrived, msg.timing)
        for (rid, attempt), items in predrafts.items():
            self._predrafted(wid, rid, attempt, items)
        w = self.scheduler.workers.get(wid)
        if msg.idle and w is not None and w.pull_credits and not w.pull_idle and not w.inflight:
            self.scheduler.pull(wid, w.pull_credits, True, now)  # (its busy PULL is an idle worker's now)

    def _predrafted(self, wid: int, rid: int, attempt: int, items: list[TaskResult]) -> None:
        """A pre-draft's branches (draft-ahead). A bad one is counted and the pre-draft dropped: a
        pre-draft is only ever a head start, and its request drafts as usual."""
        req = ahead.accepts(self.scheduler, wid, rid, attempt)
        if req is None:
            self.counters["stale_results"] += 1
            return
        try:
            branches = results.predrafted(req.ahead, items, wid, self.scheduler.workers[wid].drafter,
                                          not req.params.greedy, self.admission.vocab_size)
        except ProtocolError as exc:
            self.errors[exc.code] += 1
            branches = []
        self.scheduler.predrafted(req, wid, branches)

    def _second(self, wid: int, rid: int, attempt: int, item: TaskResult | None) -> None:
        """A second draft (fused drafters). A failed or bad one is counted and dropped: its round
        verifies the first draft alone (``item`` None: it did not decode)."""
        req = fusion.accepts(self.scheduler, wid, rid, attempt)
        if req is None:
            self.counters["stale_results"] += 1
            return
        draft = chunk = None
        try:
            if item is not None and item.prefilled is not None:  # (a chunk of its prompt: it runs again for the rest)
                chunk = results.prefilled(req, item)
            elif item is not None and not item.error:
                draft, _, _ = results.drafted(results.Asked(req.second.k, 0, 0), item, self.admission.vocab_size)
        except ProtocolError as exc:
            self.errors[exc.code] += 1
        self.scheduler.second_done(req, wid, draft, chunk)

    def _register(self, identity: bytes, msg: Register, now: float, key: str | None) -> None:
        self.access.check_worker(msg, key)
        self.admission.check_verifier(msg.role, msg.model, [w.model for w in self.workers.values() if w.identity != identity])
        if identity in self.by_identity:
            self._drop_worker(self.by_identity[identity], "re-registered")
        wid = self.next_worker
        try:
            slot = self.scheduler.register(wid, msg.role, msg.capacity, msg.drafter, msg.draft_capacity)
        except ValueError as exc:
            raise ProtocolError("wrong_role", str(exc)) from None
        self.next_worker += 1
        self.workers[wid] = WorkerInfo(identity, msg.role, msg.name[:64], now, msg.kv_endpoint, pid=msg.pid,
                                       restarts=msg.restarts, key=key, model=served(msg.model))
        self.by_identity[identity] = wid
        log.info("worker %d (%s, %s) joined in slot %d", wid, msg.name[:64], msg.role, slot)
        self._send(self.peers, identity, Welcome(wid, slot, self.opts.mode, {
            "proposal_top_k": self.opts.proposal_top_k, "heartbeat_s": self.opts.heartbeat_s,
            "max_forward_tokens": self.opts.policy.max_forward_tokens, "max_burst_tokens": self.opts.policy.max_burst_tokens}))

    def _drop_worker(self, wid: int, why: str) -> None:
        info = self.workers.pop(wid, None)
        if info is None:
            return
        self.by_identity.pop(info.identity, None)
        requeued = self.scheduler.unregister(wid)
        self.counters[f"workers_{why}"] += 1
        self.counters["tasks_requeued"] += len(requeued)
        log.warning("worker %d (%s) %s; %d tasks re-queued", wid, info.name, why, len(requeued))

    def _result(self, wid: int, item: TaskResult, now: float, arrived: float, timing: Timing | None) -> None:
        req = self.scheduler.accepts_result(wid, item.rid, item.attempt, item.kind)
        if req is None:
            self.counters["stale_results"] += 1
            return
        self.workers[wid].tasks += 1
        self.round_times.returned(req.rid, arrived, timing)
        if lacked_tokens(item.error) and req.resent <= known.MAX_RESENDS:  # (no failure: it goes again, whole)
            return self.scheduler.retry(req, wid)
        if item.error:
            self._finish(req.rid, "error", ("worker_error", item.error[:500]))
            return
        try:
            self._apply_result(wid, req, item, now)
        except ProtocolError as exc:
            # A result we cannot use still ends its request with a clear error, never a hang.
            self.errors[exc.code] += 1
            self._finish(req.rid, "error", ("worker_error", f"bad result from worker {wid}: {exc.message}"))
        except Exception as exc:  # a bug: that request ends with a clear error; the rest go on
            log.exception("internal error applying a result")
            self.errors["internal"] += 1
            self._finish(req.rid, "error", ("internal", f"{type(exc).__name__}: {exc}"[:300]))

    def _fail_result(self, wid: int, head: dict[str, Any], why: str) -> None:
        """A result too malformed to decode: end the request it names (when it is this worker's
        current task), as any result the broker cannot use."""
        if head["kind"] == AHEAD:  # (a pre-draft: dropped; its request drafts as usual)
            return self._predrafted(wid, head["rid"], head["attempt"], [])
        if head["kind"] == DRAFT and head["attempt"] < 0:  # (a second draft: its round goes without it)
            return self._second(wid, head["rid"], head["attempt"], None)
        req = self.scheduler.accepts_result(wid, head["rid"], head["attempt"], head["kind"])
        if req is not None:
            self.workers[wid].tasks += 1
            self._finish(req.rid, "error", ("worker_error", f"bad result from worker {wid}: {why}"))

    def _apply_result(self, wid: int, req: Request, item: TaskResult, now: float) -> None:
        req.cached += item.cached
        if item.prompt_logprobs is not None or item.prompt_logprob_ids is not None:  # (the prompt's, as asked)
            self._prompt_scored(req, item)
        if item.prefilled is not None:  # a chunk of the prompt (chunked prefill): the task goes round again
            self.scheduler.prefilled(req, wid, results.prefilled(req, item))
            self.counters["prefill_chunks"] += 1
            self.round_times.handled(req.rid, time.perf_counter())
            return
        if item.kind == DRAFT:
            draft, runner_ups, chains = results.drafted(req, item, self.admission.vocab_size)
            q = results.proposal(item) if not req.params.greedy else {}
            self.scheduler.draft_done(req, wid, draft, q)
            req.runner_ups, req.chains = runner_ups, chains
            self.round_times.handled(req.rid, time.perf_counter())
            return
        v = results.verified(req, item, self.admission.vocab_size)
        logprobs = results.logprobs(req, item, self.admission.vocab_size) \
            if req.params.logprobs is not None or item.logprobs is not None or item.logprob_ids is not None else None
        if item.kind == ROUND:
            req.proposed += len(v.draft)
        req.alt_accepted += v.via_alt
        req.fused_accepted += v.fused
        self.stats.count_round(v, req.fuse > 0, req.drafter if item.kind != ROUND else None)
        kept = self.scheduler.end_round(req, wid, v.committed, v.via_alt, v.draft_accepted, v.fused if v.chains else None,
                                        self.admission.eos_ids, self.admission.stop_text, v.second)
        self.counters["rounds"] += 1
        self.counters["tokens_out"] += len(kept)
        entries = self.admission.logprob_entries(kept, *logprobs) if logprobs is not None else None
        if entries is not None:
            req.logprobs = req.logprobs or []
            req.logprobs.extend(entries)
            self.outbox_logprobs = True
        self._stream(req, kept, *self.admission.release(req), now, entries)
        self.round_times.ended(req.rid, time.perf_counter(), len(kept))
        if req.finish_reason:  # (end_round took it out of the pool)
            self._close(req)

    def _observe_costs(self, wid: int, steps: object, batches: object) -> None:
        """Feed a worker's measured forward times (its RESULT's ``device.step_costs`` and
        ``device.batch_costs``) to the policy; a malformed entry is counted and left out (the
        results it came with still count)."""
        roles = MODEL_ROLES.get(self.workers[wid].role, (self.workers[wid].role,))
        for raw, longest, by_batch in ((steps, FIT_ROWS, False), (batches, len(elastic.BUCKETS), True)):
            if raw is None:
                continue
            try:
                tables = results.cost_tables(raw, roles, longest)
            except ValueError:
                self.errors["malformed"] += 1
                continue
            for role, seconds in tables.items():
                self.scheduler.observe_costs(wid, role, seconds, by_batch)

    def _send_tasks(self, wid: int, batch: list[Request]) -> None:
        stage = self.scheduler.workers[wid].stage  # (the topic: an elastic worker's changes batch by batch)
        self.stats.batch_sizes.setdefault(stage, Counter())[len(batch)] += 1
        self.workers[wid].batches[stage] += 1
        tasks = task_specs(self.scheduler, wid, batch, self.workers, self.opts.full_tokens)
        # (tokens the tasks carry, and the positions they cover: what sending only new ones saves)
        self.counters["task_tokens"] += sum(len(t.tokens) for t in tasks)
        self.counters["task_positions"] += sum(t.base + len(t.tokens) for t in tasks)
        sent = time.perf_counter()  # (before the send: the worker may start before this process runs again)
        if not self._send(self.peers, self.workers[wid].identity, Tasks(tasks)):
            self._drop_worker(wid, "unreachable")
            return
        w = self.scheduler.workers[wid]
        for req in batch if stage != AHEAD else ():  # (a pre-draft is off every round's critical path)
            if not fusion.is_second(w, req):  # (a second draft: the round is timed by its first; a wait shows as queue)
                self.round_times.sent(req.rid, sent)

    # -- the loop --------------------------------------------------------------------------
    def state(self, now: float) -> dict[str, Any]:
        return {
            "mode": self.opts.mode, "pid": os.getpid(), "uptime_s": now - self.started,
            "shard": self.opts.shard, "shards": self.opts.shards,
            "draining": self.draining_since is not None,  # (SIGTERM: in-flight requests finish, new ones are refused)
            "pool": len(self.scheduler.requests), "topics": self.scheduler.depth(), "roles": list(MODES[self.opts.mode]),
            "waiting_for_prefix": self.scheduler.prefixes.waiting(self.scheduler.requests) if self.scheduler.prefixes else 0,
            **({"queued_by_priority": queued_by_priority(self.scheduler.topics.values())}
               if self.opts.policy.priority_scheduling else {}),
            "model": self.opts.model_name, "max_model_len": self.admission.max_model_len,  # (what the HTTP API serves)
            "tokenizer": self.admission.model, "max_new_tokens_limit": self.opts.max_new_tokens_limit,  # (replay's prompts)
            **self.stats.state(self.scheduler, self.workers), "round_times": self.round_times.state(),
            "metrics_port": self.metrics.port if self.metrics else None, "worker_address": self.endpoints[1],
            # times the deployment started the broker, and the workers registered now, again after a death
            "restarts": {"broker": restarts(), "workers": sum(w.restarts for w in self.workers.values())},
        }

    def step(self, now: float) -> None:
        """Housekeeping after events: dispatch, FREE broadcasts, heartbeats, liveness; then what
        the clients are owed."""
        for wid, batch in self.scheduler.dispatch():
            self._send_tasks(wid, batch)
        if self.frees:
            for info in list(self.workers.values()):
                self._send(self.peers, info.identity, Free(self.frees))
            self.frees = []
        if self.metrics is not None and now - self._last_render >= 0.5:
            self._last_render = now
            self.metrics.snapshot = render_metrics(self.state(now))
        if now - self._last_beat >= self.opts.heartbeat_s:
            self._last_beat = now
            self.reap_clients(now)
            self.activity.log(now, self.counters, self.errors, len(self.scheduler.requests), self.scheduler.depth(), self.scheduler.workers.values())
            for wid, info in list(self.workers.items()):
                if self.access.revoked(info.key):
                    self._drop_worker(wid, "revoked")  # its tasks go to others; it is told to stop
                    self._send(self.peers, info.identity, Error("revoked", "this worker's key was revoked"))
                elif now - info.last_seen > self.opts.liveness_s:
                    self._drop_worker(wid, "dead")
                elif not self._send(self.peers, info.identity, Heartbeat()):
                    # its connection is gone (a killed process): re-queue its tasks now, not after
                    # liveness_s of silence
                    self._drop_worker(wid, "unreachable")
        self._flush_clients()

    def _flush_clients(self) -> None:
        """Send what the clients are owed; a client's stream chunks go in one ``Chunks`` (at its
        first chunk's place: each request's messages keep their order)."""
        outbox, self.client_outbox = self.client_outbox, []
        chunks: dict[bytes, list[Tokens]] = {}
        for identity, msg in outbox:
            if isinstance(msg, Tokens):
                chunks.setdefault(identity, []).append(msg)
        for identity, msg in outbox:
            if not isinstance(msg, Tokens):
                self._send_now(self.clients, identity, msg)
            elif (mine := chunks.pop(identity, None)) is not None:
                for group in chunk_groups(mine) if self.outbox_logprobs else (mine,):
                    self._send_now(self.clients, identity, group[0] if len(group) == 1 else Chunks(group))
        self.outbox_logprobs = False

    def receive(self, socks: list[zmq.Socket], now: float) -> None:
        """Handle what waits on ``socks`` (the worker socket, the client socket, or both)."""
        for sock in socks:
            handler = self.on_worker if sock is self.peers else self.on_client
            for _ in range(1000):  # bounded, so one busy socket cannot starve the other
                try:
                    frames = zmq_frames.recv(sock, zmq_frames.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) < 2:
                    self.errors["malformed"] += 1
                    continue
                handler(frames[0].bytes, frames[1:], now)

    def run(self) -> int:
        token = metrics_token(self.opts) if self.opts.metrics_port is not None else None  # (refused before binding)
        self.bind()
        if self.opts.metrics_port is not None:
            self.metrics = MetricsServer(self.opts.metrics_host, self.opts.metrics_port, token)
            log.info("metrics at http://%s:%d/metrics", self.opts.metrics_host, self.metrics.port)
        stop: list[int] = []
        poller = zmq.Poller()
        for sock in (self.clients, self.peers, self.prompts.fd, woken := wake_on_stop_signals(stop)):
            poller.register(sock, zmq.POLLIN)
        log.info("broker (%s) clients at %s, workers at %s", self.opts.mode,  # (as bound: port 0 is a free one)
                 *self.endpoints)
        while True:
            events = dict(poller.poll(timeout=int(self.opts.heartbeat_s * 1000 / 2)))
            now = time.monotonic()
            self.receive([sock for sock in (self.peers, self.clients) if sock in events], now)
            if self.prompts.fd in events:
                self._tokenized()
            if woken.fileno() in events:  # (a signal: ``stop`` says it; the poller keys a socket by its fd)
                woken.recv(64)
            self.step(now)
            if orphaned():  # the deployment that started us is gone
                stop.append(1)
            if stop and self.draining_since is None:
                self.draining_since = self.activity.draining(now, len(self.scheduler.requests), self.opts.drain_s)
            if self.draining_since is not None:
                if not (self.scheduler.requests or self.prompts.waiting) or now - self.draining_since > self.opts.drain_s:
                    self.activity.stopped(len(self.scheduler.requests) + len(self.prompts.waiting), self.opts.drain_s)
                    for rid in list(self.scheduler.requests):
                        self._finish(rid, "error", ("shutting_down", "the broker shut down before this request finished"))
                    for waiting in self.prompts.waiting.values():
                        self._reject(self.clients, waiting.identity, "shutting_down", "the broker shut down", waiting.msg.req_id)
                    self._flush_clients()
                    break
        self.clients.close(), self.peers.close(), self.prompts.close()
        if isinstance(self.scheduler, RecordingScheduler):
            self.scheduler.save(self.opts.policy_log)
            log.info("policy log: %d records in %s", len(self.scheduler.records), self.opts.policy_log)
        if self.metrics is not None:
            self.metrics.close()
        self.access.close()
        return 0

