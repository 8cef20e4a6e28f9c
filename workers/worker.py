"""The worker process: register, pull, compute, return results — pipelined.

The main thread owns the ZeroMQ socket and never computes; a single compute thread runs the
model (torch releases the GIL inside its kernels). So heartbeats flow while a batch runs, and
the next batch's PULL goes out as soon as the current batch starts: one batch computing, one
being fetched. A worker is stateless with respect to placement: it may get any task, and it
recomputes whatever KV it lacks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
import zmq

from nebula_flow import protocol
from nebula_flow.cores import join_lease
from nebula_flow.kv.transport import make_transport
from nebula_flow.lookup import parse_ngram
from nebula_flow.models.loader import load_model
from nebula_flow.options import WorkerOptions
from nebula_flow.process import orphaned, restarts
from nebula_flow.protocol import (
    Bye,
    Error,
    Free,
    Heartbeat,
    ProtocolError,
    Pull,
    Register,
    Rejected,
    Result,
    TaskResult,
    Tasks,
    Timing,
    Welcome,
)
from nebula_flow.routing import drafter_name
from nebula_flow.security import Identity, is_loopback, keys_dir
from nebula_flow.shards import addresses as shard_addresses
from nebula_flow_workers.device_stats import DeviceStats
from nebula_flow_workers.kv_prep import KVPrep
from nebula_flow_workers.link import BrokerLink
from nebula_flow_workers.ngram import NgramRunner
from nebula_flow_workers.runner import ModelRunner, Task
from nebula_flow_workers.tasks import current, failed, runnable
from nebula_flow_workers.warmup import warm_up

log = logging.getLogger("nebula_flow.worker")
ROLES = ("draft", "target", "colocated", "any")  # any: both models; rounds, a draft or a verify batch (elastic)
BOTH_MODELS = ("colocated", "any")
REFUSALS = ("malformed", "wrong_role", "invalid_params", "unauthorized")  # REGISTER errors retrying cannot fix


@dataclass
class BatchClock:
    """When a pending batch's first tasks arrived and the time spent decoding them
    (``protocol.Timing``'s starting marks)."""

    arrived: float = 0.0
    decode_s: float = 0.0


class Worker:
    def __init__(self, opts: WorkerOptions) -> None:
        if opts.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if opts.draft_capacity is not None and not (opts.role == "any" and opts.draft_capacity >= 1):
            raise ValueError("--draft-max-batch is for role any, and must be >= 1")
        if opts.max_kv_gb <= 0 or (opts.kv_pool_gb is not None and opts.kv_pool_gb < 0):
            raise ValueError("--max-kv-gb must be > 0 and --kv-pool-gb >= 0")
        if opts.device != "emulated" and (opts.model is None or (opts.role in BOTH_MODELS and opts.draft_model is None)):
            raise ValueError("--model is required (and --draft-model for a colocated or elastic worker)")
        self.opts = opts
        # a PULL's credits: its batch's most tasks (an elastic worker's draft batches may hold more)
        self.credits = max(opts.capacity, opts.draft_capacity or 0) if opts.role == "any" else opts.capacity
        self.heartbeat_s = opts.heartbeat_s  # until the broker's WELCOME names its own interval
        self.name = opts.name or f"{opts.role}-{os.getpid()}"
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        # The models are loaded on the thread that runs them: loaded on another, the same forward
        # took ~1.5x as long on this 2-core CPU (oneDNN's per-thread state; docs/benchmarks.md).
        self.executor.submit(self._load_models).result()
        self.lease = self.executor.submit(join_lease, opts.core_lease, opts.core_slot, max(1, opts.threads),
                                          [r for r in (self.draft, self.target) if r is not None],
                                          torch.set_num_threads).result() if opts.core_lease else None
        self.drafter = drafter_name(opts.drafter, opts.model) if opts.role == "draft" else None
        self.runners = [r for r in (self.draft, self.target) if r is not None]
        self.vocab = self._model_facts().get("vocab_size")  # (the ids a task may carry; n-gram drafters: any)
        self.stores = [r.store for r in self.runners if r.store is not None]  # (an n-gram drafter holds no KV)
        self.prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
        self.stall_s = 0.0
        folder = keys_dir(opts.keys)
        if folder is None and not is_loopback(opts.kv_host):
            raise ValueError(f"a KV server on {opts.kv_host} (off loopback) requires CURVE keys (--keys DIR)")
        # this worker's own keypair (workers/NAME in the key folder): to the broker and as a KV server
        self.identity = Identity.load(folder, "worker", self.name) if folder else None
        # (with CURVE keys, only ZeroMQ: UCX and shared folders have no authentication)
        # the KV that moves between workers: a colocated worker's never does, an n-gram drafter holds none
        served = {role: r.store for role, r in (("draft", self.draft), ("target", self.target))
                  if r is not None and r.store is not None and opts.role in (role, "any")}
        self.transport = make_transport(opts.kv_transport, self.identity, opts.device) if served else None
        self.kv = KVPrep(served, self.stores, self.transport)
        self.kv_endpoint = self.kv.endpoint = self.transport.serve(opts.kv_host, self.kv.lookup) if self.transport else None
        if self.transport is not None and self.transport.share_folder is not None:  # same-host peers read our files
            for role, runner in (("draft", self.draft), ("target", self.target)):
                if runner is not None and runner.store is not None:
                    runner.store.share_into(self.transport.share_folder, role, None if opts.kv_pool_gb is None
                                            else int(opts.kv_pool_gb * (1 << 30)))
        self.wake_r, self.wake_w = os.pipe()
        self.links = [BrokerLink(address, self.identity) for address in shard_addresses(opts.broker)]
        self.origin: dict[int, BrokerLink] = {}  # request number -> the broker that sent its tasks
        self.pending: list[Task] = []  # tasks received, waiting for the batch computing now
        self.prefetch: Future | None = None  # the pending tasks' KV pulls
        self.clock = BatchClock()  # the pending batch's
        self.frees: list[int] = []  # requests whose KV the next batch drops first
        self.stopping = False
        self.exit_code = 0
        self.errors = 0
        self.device_stats = DeviceStats()  # (each RESULT's device entry)

    def _load_models(self) -> None:
        opts = self.opts
        torch.set_num_threads(max(1, opts.threads))
        self.target = self.draft = None
        if opts.role == "draft":
            self.draft = self._draft_runner(opts.model, opts.profile)
        else:
            self.target = ModelRunner(self._load(opts.model, opts.profile, "target"), max_kv_bytes=int(opts.max_kv_gb * (1 << 30)),
                                      model_dir=opts.model)
        if opts.role in BOTH_MODELS:
            self.draft = self._draft_runner(opts.draft_model, opts.draft_profile)
        for name, runner, most in (("target", self.target, opts.capacity), ("draft", self.draft, opts.draft_capacity or opts.capacity)):
            warm_up(runner, most, name)  # (on a GPU: kernels loaded, graphs recorded, a round run)

    def _draft_runner(self, model: str, profile: str | None):  # noqa: ANN202
        ngram = parse_ngram(model) if self.opts.device != "emulated" else None
        if ngram is not None:
            return NgramRunner(*ngram)
        return ModelRunner(self._load(model, profile, "draft"), max_kv_bytes=int(self.opts.max_kv_gb * (1 << 30)), model_dir=model)

    def _load(self, model: str, profile: str | None, role: str):  # noqa: ANN202
        if self.opts.device != "emulated":
            loaded = load_model(model, self.opts.device, self.opts.dtype, self.opts.batch_invariant, cuda_graphs=self.opts.cuda_graphs)
            if self.opts.dtype == "auto":  # (what it picked depends on the CPU or GPU: say so)
                log.info("%s: dtype auto -> %s on %s", role, loaded.lm_head.weight.dtype, self.opts.device)
            if loaded.batch_invariant:
                log.info("%s: batch-invariant numerics (%s)", role, loaded.invariance)
            return loaded
        from nebula_flow.emulated import EmulatedModel, load_profile

        if not profile:
            raise ValueError("--device emulated needs --profile (and --draft-profile for colocated and elastic workers)")
        return EmulatedModel(load_profile(profile), role)

    # -- protocol --------------------------------------------------------------------------
    def _model_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"path": str(self.opts.model), "device": self.opts.device}
        runner = self.target or self.draft
        if runner.model is not None:
            facts.update(vocab_size=runner.model.cfg.vocab_size, max_model_len=runner.model.cfg.max_position_embeddings)
        return facts

    def _register(self, link: BrokerLink) -> None:
        msg = Register(self.opts.role, self.name, self.opts.capacity, self._model_facts(), self.kv_endpoint,
                       self.drafter, os.getpid(), restarts(), self.opts.draft_capacity if self.opts.role == "any" else None)
        link.send(msg)
        link.registered, link.register_sent = False, time.monotonic()

    def _runnable(self, link: BrokerLink, msg: Tasks) -> list[Task]:
        """A TASKS batch's runnable tasks. One that is malformed or that this worker cannot run is
        answered with an error result for its request (the broker ends it); the good ones still run."""
        tasks, failures, vocab, guided = [], [], self.vocab, getattr(self.target, "guides", None) is not None
        for item in msg.tasks:
            try:
                if isinstance(item, Rejected):
                    raise item.error
                tasks.append(runnable(item, vocab, guided))
            except ProtocolError as exc:
                result = failed(item, exc)
                if result is None:  # (it names no task: the broker hears of it as an error)
                    self._complain(link, exc)
                    continue
                self.errors += 1
                failures.append(result)
        if failures:
            link.send(Result(failures))
        return tasks

    # -- compute (runs on the compute thread) -----------------------------------------------
    def _compute(self, tasks: list[Task], frees: list[int], prefetch: Future | None, clock: BatchClock) -> None:
        """Run one batch and send its RESULT from this thread (``link.BrokerLink``: no wait for
        the main thread's turn); wake the main thread where the send left a message waiting."""
        with self.lease.batch() if self.lease is not None else contextlib.nullcontext():  # (on lent cores)
            result, ended = self._run_batch(tasks, frees, prefetch, clock)
        now = time.perf_counter()
        result.timing.handoff_s, result.timing.span_s = now - ended, now - clock.arrived
        result.idle = not self.pending  # (as it stands: a batch arriving just after asks with a PULL of its own)
        self._send_result(result)
        if any(link.readable() for link in self.links):
            os.write(self.wake_w, b"m")

    def _run_batch(self, tasks: list[Task], frees: list[int], prefetch: Future | None,
                   clock: BatchClock) -> tuple[Result, float]:
        started = time.perf_counter()
        # (the batch waited from its decoding to now: behind the batch computing, then the handoff)
        timing = Timing(decode_s=clock.decode_s, queue_s=max(0.0, started - clock.arrived - clock.decode_s))
        t0 = time.perf_counter()
        if prefetch is not None:  # the batch's network pulls started when it arrived; wait for the rest
            prefetch.result()
        # Finished requests' shared files go back to the pool before this batch makes its caches (a
        # pooled file's pages are in; a new one faults them in); a pull for one of them is dropped too.
        for store in self.stores:
            store.free(frees)
        # Same-host reads (shm) run here, not in the background: a copy of well under a
        # millisecond gains nothing from overlap and would cost a thread handoff and a second
        # busy thread beside the running batch. Without overlap, compute waits for every pull.
        self.kv.prefetch(self.kv.pulls(tasks, local=True if self.opts.kv_overlap else None))
        timing.kv_s = time.perf_counter() - t0
        self.stall_s += timing.kv_s
        draft0, verify0 = (r.busy_s if r is not None else 0.0 for r in (self.draft, self.target))
        results: list[TaskResult] = []
        by_kind: dict[str, list[Task]] = {}
        for t in tasks:
            by_kind.setdefault(t.kind, []).append(t)
        for kind, group in by_kind.items():
            outs = [TaskResult(t.rid, t.kind, t.round, t.attempt) for t in group]
            try:
                if kind == "draft" and self.draft:
                    for out, t, d in zip(outs, group, self.draft.draft(group)):
                        if t.prefilled is not None:  # (a chunk of its prompt: it comes back for the rest)
                            out.prefilled = t.prefilled
                            continue
                        out.draft, out.runner_ups, out.chains = d.tokens, d.runner_ups, d.chains
                        out.propose(d.q_idx, d.q_prob)
                elif kind == "ahead" and self.draft and self.opts.role == "draft":  # (draft-ahead: per outcome)
                    outs = []
                    for t, branches in zip(group, self.draft.predraft(group)):
                        for assumed, d in branches:
                            outs.append(TaskResult(t.rid, t.kind, t.round, t.attempt, draft=d.tokens,
                                                   runner_ups=d.runner_ups, chains=d.chains, assumes=assumed))
                            outs[-1].propose(d.q_idx, d.q_prob)
                        if not branches:  # (it pre-drafted nothing: the broker stops waiting for it)
                            outs.append(TaskResult(t.rid, t.kind, t.round, t.attempt))
                elif kind == "verify" and self.target and self.opts.role != "draft":
                    for out, t, committed in zip(outs, group, self.target.verify(group)):
                        if committed is None:  # (a chunk of its prompt, or it failed alone)
                            out.prefilled, out.error = t.prefilled, t.error
                            continue
                        out.committed, (out.logprobs, out.logprob_ids) = committed, t.logprobs or (None, None)
                        if t.chains and not t.draft:  # a chain the target looked up itself
                            out.chains = t.chains
                elif kind == "round" and self.opts.role in BOTH_MODELS:
                    # the target's budget decides which prompts only prefill a chunk, in both models
                    ends = self.target.chunk_ends(group)
                    drafting = [i for i, t in enumerate(group) if t.k > 0 or ends[i] is not None]
                    drafts = self.draft.draft([group[i] for i in drafting], [ends[i] for i in drafting])
                    for i, d in zip(drafting, drafts):
                        if ends[i] is None:
                            t = group[i]
                            t.draft, t.q_idx, t.q_prob, t.runner_ups, t.chains = d.tokens, d.q_idx, d.q_prob, d.runner_ups, d.chains
                    for out, t, committed in zip(outs, group, self.target.verify(group, ends)):
                        if committed is None:
                            out.prefilled, out.error = t.prefilled, t.error
                            continue
                        out.committed, out.draft, out.runner_ups = committed, t.draft, t.runner_ups
                        out.chains, (out.logprobs, out.logprob_ids) = t.chains, t.logprobs or (None, None)
                else:
                    raise ProtocolError("wrong_role", f"a {self.opts.role} worker cannot run {kind} tasks")
            except Exception as exc:  # fail these requests clearly rather than leave them hanging
                log.exception("%s batch failed", kind)
                outs = [TaskResult(t.rid, t.kind, t.round, t.attempt, error=f"{type(exc).__name__}: {exc}")
                        for t in group]
            results.extend(outs)
        for store in self.stores:
            store.unpin([t.rid for t in tasks])
        timing.draft_s = self.draft.busy_s - draft0 if self.draft is not None else 0.0
        timing.verify_s = self.target.busy_s - verify0 if self.target is not None else 0.0
        busy = timing.draft_s + timing.verify_s
        ended = time.perf_counter()
        timing.python_s = max(0.0, ended - started - timing.kv_s - busy)
        device = self.device_stats.snapshot(self.draft, self.target, self.lease)
        return Result(results, busy, self.kv.stats(self.stall_s), device, timing), ended

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        poller = zmq.Poller()
        poller.register(self.wake_r, zmq.POLLIN)
        for link in self.links:
            link.connect(poller)
            self._register(link)
        computing: Future | None = None
        while True:
            if orphaned():  # the deployment that started us is gone: do not linger
                self.stopping = True
            for link in self.links if self.stopping else ():
                if link.pull_out is not None and link.registered:
                    # Leaving: withdraw the PULL parked at the broker (no task sent here to be re-queued)
                    link.send(Pull(0, computing is None))
                    link.pull_out = None
            if self.stopping and computing is None:
                for link in self.links:
                    if link.registered:
                        link.send(Bye())
                break
            if not self.stopping:
                if computing is None and self.pending:
                    computing = self._start_batch()
                self._pull(idle=computing is None)
            now = time.monotonic()
            # (never under three of the broker's beats: a broker set to beat slowly is not gone)
            liveness = max(self.opts.liveness_s, 3 * self.heartbeat_s)
            for link in self.links:
                if now - link.last_sent >= self.heartbeat_s:
                    link.send(Heartbeat())
                if link.silent_for(now) > liveness * (link.backoff if not link.registered else 1):
                    # That broker is gone (or never answered): reconnect, waiting longer each time.
                    log.warning("no word from the broker at %s for %.0f s: reconnecting", link.address,
                                link.silent_for(now))
                    link.connect(poller)
                    self._register(link)
                    link.backoff = min(link.backoff * 2, 16.0)
            # Wake when the next heartbeat is due, not a whole interval after the last look:
            # sleeping a full interval let two beats lie up to twice the interval apart.
            due = min(link.last_sent for link in self.links) + self.heartbeat_s - time.monotonic()
            # (a socket's FD is edge-triggered: a message our own sends let in would not wake us)
            # (nor sleep past a finished batch: its thread wakes us only where there is work, _batch_done)
            waiting = any(link.readable() for link in self.links) or computing is not None and computing.done()
            events = dict(poller.poll(timeout=0 if waiting else max(1, int(due * 1000) + 1)))
            if self.wake_r in events:
                os.read(self.wake_r, 64)
            if computing is not None and computing.done():
                try:
                    computing.result()  # (its RESULT went out from the compute thread)
                except Exception:  # a bug in compute must not kill the worker silently
                    log.exception("batch failed")
                    self.errors += 1
                computing = None
            for link in self.links:
                for frames in link.receive():
                    self._on_message(link, frames)
        self.executor.shutdown(wait=True)
        self.prefetcher.shutdown(wait=True)
        if self.transport is not None:
            self.transport.close()
        for link in self.links:
            link.close()
        return self.exit_code

    def _start_batch(self) -> Future:
        """Start computing the waiting tasks (at most a PULL's credits: with several brokers more
        may have come; the rest run next, their KV already pulled)."""
        batch, self.pending = self.pending[:self.credits], self.pending[self.credits:]
        computing = self.executor.submit(self._compute, batch, self.frees, self.prefetch, self.clock)
        computing.add_done_callback(self._batch_done)
        self.frees, self.prefetch, self.clock = [], None, BatchClock(arrived=time.perf_counter())
        return computing

    def _batch_done(self, _batch: Future) -> None:
        """Wake the main thread where a finished batch leaves it work: tasks wait, it is stopping, or
        a broker its RESULT did not reach still holds a busy PULL. Otherwise the wake-up (a second
        busy core as the broker handles the RESULT) is skipped: the main thread sees the batch done
        before it next sleeps, since the batch is done before this looks at what waits."""
        if self.pending or self.stopping or any(link.pull_out == "busy" for link in self.links):
            os.write(self.wake_w, b"x")

    def _pull(self, idle: bool) -> None:
        """Park a PULL at every broker none of whose tasks wait here. A worker that goes idle with
        a "busy" PULL parked says so again, so the broker's locality rules (only idle workers take
        tasks held elsewhere) see it as idle."""
        waiting = {self.origin.get(t.rid) for t in self.pending}
        for link in self.links:
            if link.registered and link not in waiting and (link.pull_out is None or (idle and link.pull_out == "busy")):
                link.send(Pull(self.credits, idle))
                link.pull_out = "idle" if idle else "busy"

    def _send_result(self, result: Result) -> None:
        """Each broker gets the results of its own tasks, with the batch's timing and counters; one
        told ``idle`` counts the PULL parked there as an idle worker's, so none is sent to say so."""
        by_link: dict[BrokerLink, list[TaskResult]] = {self.links[0]: result.results}
        if len(self.links) > 1:
            by_link = {}
            for r in result.results:
                by_link.setdefault(self.origin.get(r.rid, self.links[0]), []).append(r)
        for link, results in by_link.items():
            with link.lock:  # (before the send, and atomic with the main thread taking TASKS: see _on_message)
                link.pull_out = "idle" if result.idle and link.pull_out == "busy" else link.pull_out
            link.send(result if results is result.results else replace(result, results=results))

    def _on_message(self, link: BrokerLink, frames: list[Any]) -> None:
        arrived = time.perf_counter()
        link.last_heard = time.monotonic()
        try:
            msg = protocol.decode(frames)
        except ProtocolError as exc:
            self._complain(link, exc)
            return
        if isinstance(msg, Welcome):
            link.registered, link.pull_out, link.backoff, link.worker_id = True, None, 1.0, msg.worker_id
            log.info("%s registered as worker %d at %s (slot %d, mode %s)", self.name, msg.worker_id,
                     link.address, msg.slot, msg.mode)
            settings = msg.settings
            for r in self.runners:
                r.proposal_top_k = int(settings.get("proposal_top_k", r.proposal_top_k))
                r.max_forward_tokens = int(settings.get("max_forward_tokens", 0))
            # The broker judges liveness against its own interval: beat at that pace.
            self.heartbeat_s = float(settings.get("heartbeat_s", self.heartbeat_s))
        elif isinstance(msg, Tasks):
            with link.lock:  # (the compute thread may be marking the PULL this answers idle: _send_result)
                link.pull_out = None
            for item in msg.tasks:
                if isinstance(getattr(item, "rid", None), int):
                    self.origin[item.rid] = link
            batch = self._runnable(link, msg)
            if batch:  # start this batch's KV pulls now, while the current batch computes
                if not self.pending:  # (its span starts when its first tasks arrived)
                    self.clock.arrived = arrived
                self.clock.decode_s += time.perf_counter() - arrived
                # (two answers can cross a re-sent PULL: extend the waiting batch; the
                # prefetch thread runs in order, so the last future covers both)
                self.pending += batch
                # (a batch whose KV is all here or in this host's memory skips the prefetch
                # thread: a thread handoff per batch is ~0.1 ms on a single stream's critical path)
                pulls = self.kv.pulls(batch, local=False) if self.opts.kv_overlap else {}
                room = self.kv.room_to_make(batch) if self.opts.kv_overlap else {}
                if pulls or room:
                    self.prefetch = self.prefetcher.submit(self.kv.prefetch, pulls, room)
        elif isinstance(msg, Free):
            rids = [r for r in msg.rids if isinstance(r, int)]
            self.frees.extend(rids)
            self.pending = current(self.pending, rids)  # (a waiting task that came before its request's FREE)
            for rid in rids:
                if self.origin.get(rid) is link:
                    del self.origin[rid]
        elif isinstance(msg, Error):
            self._on_error(link, msg)

    def _on_error(self, link: BrokerLink, msg: Error) -> None:
        if msg.code == "revoked":  # this worker's key was taken back: it must not serve
            log.error("the broker dropped this worker: %s", msg.message)
            self.exit_code, self.stopping = 2, True
        elif msg.code == "unknown_worker":  # that broker restarted: join again
            # (once: every message sent before the WELCOME is answered so, and each
            # REGISTER after the first would replace the last, re-queueing its tasks;
            # again if no WELCOME came: that REGISTER went to a broker that died)
            if link.registered or time.monotonic() - link.register_sent > 2 * self.heartbeat_s:
                link.pull_out = None
                self._register(link)
        elif not link.registered and msg.code in REFUSALS:
            # The broker refused this worker (wrong role for its mode, bad endpoint, ...):
            # retrying cannot help, and exiting lets a deployment report it at once.
            log.error("the broker refused to register this worker: %s", msg.message)
            self.exit_code = 2
            self.stopping = True
        else:
            log.warning("broker error: %s", msg.message)

    def _complain(self, link: BrokerLink, exc: ProtocolError) -> None:
        """Count a malformed message and tell the broker that sent it, which counts it too."""
        self.errors += 1
        log.warning("rejected a message from the broker at %s: %s", link.address, exc)
        link.send(Error(exc.code, exc.message))

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        os.write(self.wake_w, b"x")


def serve_worker(opts: WorkerOptions) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {opts.role} %(levelname)s %(message)s")
    # The compute thread holds the GIL between torch ops; with the default 5 ms switch interval
    # a peer's KV request (KV server thread) or the next batch's pulls (prefetch thread) wait up
    # to 5 ms for it. 0.5 ms keeps them responsive for a small cost to compute.
    sys.setswitchinterval(float(os.environ.get("NEBULA_FLOW_SWITCH_INTERVAL_S", "0.0005")))
    return Worker(opts).run()
