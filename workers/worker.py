"""The worker process: register, pull, compute, return results — pipelined.

A single compute thread runs the model (torch releases the GIL inside its kernels); the main
thread never computes. While a batch computes, the main thread listens to the brokers: heartbeats
flow, the next batch's PULL goes out as soon as the current batch starts and its tasks' KV pulls
start as they arrive (one batch computing, one being fetched). The compute thread runs the
batches that wait back to back, and while none waits it listens itself: TASKS that reach an idle
worker are decoded and run on the thread that computes them, with no thread handoff on the
round's critical path (each cost a wake-up of an idle core: ~0.1-0.2 ms on the hosts measured).
A worker is stateless with respect to placement: it may get any task, and it recomputes whatever
KV it lacks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from nebula_flow import io_threads, protocol
from nebula_flow.cores import join_lease
from nebula_flow.kv.transport import make_transport
from nebula_flow.listen import route_to
from nebula_flow.lookup import parse_ngram
from nebula_flow.models.identity import fingerprint
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
from nebula_flow_workers.kinds import BOTH_MODELS, run_kind
from nebula_flow_workers.kv_prep import KVPrep
from nebula_flow_workers.link import BrokerLink, wait
from nebula_flow_workers.ngram import NgramRunner
from nebula_flow_workers.runner import ModelRunner, Task
from nebula_flow_workers.tasks import current, runnable_batch
from nebula_flow_workers.token_book import TokenBook
from nebula_flow_workers.warmup import warm_up

log = logging.getLogger("nebula_flow.worker")
REFUSALS = ("malformed", "wrong_role", "wrong_model", "wrong_numerics", "invalid_params", "unauthorized", "wrong_address")  # REGISTER errors retrying cannot fix


@dataclass
class BatchClock:
    """When a pending batch's first tasks arrived and the time spent decoding them
    (``protocol.Timing``'s starting marks)."""

    arrived: float = 0.0
    decode_s: float = 0.0


class Worker:
    def __init__(self, opts: WorkerOptions) -> None:
        opts.check()
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
        self.facts = self._model_facts()  # (what REGISTER says of the model: read once, sent at every join)
        self.vocab = self.facts.get("vocab_size")  # (the ids a task may carry; n-gram drafters: any)
        self.stores = [r.store for r in self.runners if r.store is not None]  # (an n-gram drafter holds no KV)
        self.prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
        self.stall_s = 0.0
        folder, kv_host = keys_dir(opts.keys), opts.kv_host or route_to(shard_addresses(opts.broker))
        if folder is None and not is_loopback(kv_host):
            raise ValueError(f"a KV server on {kv_host} (off loopback) requires CURVE keys (--keys DIR)")
        # this worker's own keypair (workers/NAME in the key folder): to the broker and as a KV server
        self.identity = Identity.load(folder, "worker", self.name) if folder else None
        # (with CURVE keys, only ZeroMQ: UCX and shared folders have no authentication)
        # the KV peers pull from this worker (an n-gram drafter holds none): a colocated worker's own
        # requests never move, but a new request bound elsewhere pulls its prompt's start from here
        served = {role: r.store for role, r in (("draft", self.draft), ("target", self.target))
                  if r is not None and r.store is not None and opts.role in (role, "any", "colocated")}
        self.transport = make_transport(opts.kv_transport, self.identity, opts.device) if served else None
        self.kv = KVPrep(served, self.stores, self.transport,  # (runners: a pull slower than recomputing is not made)
                         {"draft": self.draft, "target": self.target} if opts.kv_skip_slow_pulls else None,
                         one_holder=opts.role == "colocated")
        self.kv_endpoint = self.kv.endpoint = self.transport.serve(kv_host, self.kv.lookup) if self.transport else None
        if self.transport is not None and self.transport.share_folder is not None:  # same-host peers read our files
            for role, runner in (("draft", self.draft), ("target", self.target)):
                if runner is not None and runner.store is not None:
                    runner.store.share_into(self.transport.share_folder, role, None if opts.kv_pool_gb is None
                                            else int(opts.kv_pool_gb * (1 << 30)))
        self.wake_r, self.wake_w = os.pipe()  # wakes the main thread
        self.compute_r, self.compute_w = os.pipe()  # wakes the compute thread while it listens
        # What both threads share is changed under ``lock``: the waiting tasks and their KV pulls,
        # the links' state, who listens ("main" or "compute": the compute thread while it has no
        # batch), whether a batch computes, whether the main thread's sleep watches the sockets.
        self.lock = threading.Lock()
        self.listener, self.busy, self.main_listens = "main", False, True
        self.links = [BrokerLink(address, self.identity) for address in shard_addresses(opts.broker)]
        self.origin: dict[int, BrokerLink] = {}  # request number -> the broker that sent its tasks
        self.book = TokenBook()  # each request's tokens its tasks brought (a task carries only the new ones)
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
                                      model_dir=opts.model, prefix_cache=opts.prefix_cache)
        if opts.role in BOTH_MODELS:
            self.draft = self._draft_runner(opts.draft_model, opts.draft_profile)
        for name, runner, most in (("target", self.target, opts.capacity), ("draft", self.draft, opts.draft_capacity or opts.capacity)):
            warm_up(runner, most, name)  # (on a GPU: kernels loaded, graphs recorded, a round run)

    def _draft_runner(self, model: str, profile: str | None):  # noqa: ANN202
        ngram = parse_ngram(model) if self.opts.device != "emulated" else None
        if ngram is not None:
            return NgramRunner(*ngram)
        return ModelRunner(self._load(model, profile, "draft"), max_kv_bytes=int(self.opts.max_kv_gb * (1 << 30)), model_dir=model,
                           prefix_cache=self.opts.prefix_cache)

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
            if self.target is not None and self.opts.device != "emulated":  # (the broker refuses another target)
                facts["fingerprint"] = fingerprint(self.opts.model)  # (and numerics unlike its other verifiers')
                model = self.target.model
                facts["numerics"] = f"{model.runtime_status()['numerics']} on {model.lm_head.weight.device.type}"
        return facts

    def _register(self, link: BrokerLink) -> None:
        msg = Register(self.opts.role, self.name, self.opts.capacity, self.facts, self.kv_endpoint,
                       self.drafter, os.getpid(), restarts(), self.opts.draft_capacity if self.opts.role == "any" else None)
        link.send(msg)
        link.registered, link.register_sent = False, time.monotonic()

    def _runnable(self, link: BrokerLink, msg: Tasks) -> list[Task]:
        """A TASKS batch's runnable tasks. One that is malformed or that this worker cannot run is
        answered with an error result for its request (the broker ends it); the good ones still run."""
        tasks, failures, unnamed = runnable_batch(msg.tasks, self.vocab, self.book, getattr(self.target, "guides", None) is not None)
        for exc in unnamed:  # (it names no task: the broker hears of it as an error)
            self._complain(link, exc)
        self.errors += sum(not protocol.lacked_tokens(r.error) for r in failures)  # (a task sent again whole is no error)
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
            os.write(self.wake_w, b"m")  # (the send took the socket's edge: the main thread listens)

    def _serve(self) -> None:
        """The compute thread's loop: run the batch that waits, else listen for one, until the
        worker stops. A batch taken while this thread listened hands listening to the main
        thread (which also sends the next PULL); going idle takes it back."""
        while True:
            with self.lock:
                if self.stopping:
                    self.busy, self.listener = False, "main"
                    os.write(self.wake_w, b"s")  # (the main thread says goodbye once no batch computes)
                    return
                batch = self._take_batch() if self.pending else None
                wake_main = self.listener == "compute" if batch else self.main_listens
                self.busy, self.listener = batch is not None, "main" if batch else "compute"
                if batch is None or not wake_main:  # (else the main thread, woken to listen, sends it)
                    self._pull(idle=batch is None)  # (a batch: the next is fetched meanwhile; none: say idle)
            if wake_main:  # (a batch: the main thread listens while it computes; none: it stops)
                os.write(self.wake_w, b"l")
            if batch is None:
                self._listen()
                continue
            try:
                self._compute(*batch)
            except Exception:  # a bug in compute must not kill the worker silently
                log.exception("batch failed")
                self.errors += 1

    def _listen(self) -> None:
        """Wait for the brokers' messages on the compute thread (no batch waits) and handle them."""
        if not any(link.readable() for link in self.links):
            wait(self.links, self.compute_r, self.heartbeat_s)
        with self.lock:
            if self.listener == "compute":  # (else the main thread took over: the worker stops)
                self._receive()

    def _receive(self) -> None:
        for link in self.links:
            for frames in link.receive():
                self._on_message(link, frames)

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
            try:
                outs = run_kind(kind, group, self.opts.role, self.draft, self.target)
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
        for link in self.links:
            link.connect()
            self._register(link)
        serving = self.executor.submit(self._serve)
        while True:
            with self.lock:
                if orphaned():  # the deployment that started us is gone: do not linger
                    self._stop()
                if self.stopping and self._leave():
                    break
                if serving.done() and not self.stopping:  # (a bug that escaped the loop: logged, served again)
                    self._loop_failed(serving)
                    serving = self.executor.submit(self._serve)
                listens = self.main_listens = self.listener == "main"
                if listens and not self.stopping:
                    self._pull(idle=not self.busy)
                due = self._keep_alive()
                waiting = listens and any(link.readable() for link in self.links)
                if not listens and any(link.readable() for link in self.links):
                    os.write(self.compute_w, b"m")  # (our sends took the socket's edge: the compute thread listens)
            if not waiting:
                wait(self.links if listens else [], self.wake_r, due)
            with self.lock:
                if self.listener == "main":
                    self._receive()
        self.executor.shutdown(wait=True)
        self._loop_failed(serving)
        self.prefetcher.shutdown(wait=True)
        if self.transport is not None:
            self.transport.close()
        for link in self.links:
            link.close()
        log.info("%s stopped", self.name)
        return self.exit_code

    def _leave(self) -> bool:
        """Stopping: withdraw the PULLs parked at the brokers (no task sent here to be re-queued);
        once no batch computes, say goodbye. True when the worker may go."""
        for link in self.links:
            if link.pull_out is not None and link.registered:
                link.send(Pull(0, not self.busy))
                link.pull_out = None
        if self.busy:
            return False
        for link in self.links:
            if link.registered:
                link.send(Bye())
        return True

    def _keep_alive(self) -> float:
        """Heartbeats, and a reconnect to a broker gone silent; returns the seconds to the next beat."""
        now = time.monotonic()
        # (never under three of the broker's beats: a broker set to beat slowly is not gone)
        liveness = max(self.opts.liveness_s, 3 * self.heartbeat_s)
        for link in self.links:
            if now - link.last_sent >= self.heartbeat_s:
                link.send(Heartbeat())
            if link.silent_for(now) > liveness * (link.backoff if not link.registered else 1):
                # That broker is gone (or never answered): reconnect, waiting longer each time.
                log.warning("no word from the broker at %s for %.0f s%s: reconnecting", link.address,
                            link.silent_for(now), link.refusal())
                link.connect()
                self._register(link)
                link.backoff = min(link.backoff * 2, 16.0)
                os.write(self.compute_w, b"c")  # (a listening compute thread watches the new socket)
        # Wake when the next heartbeat is due, not a whole interval after the last look:
        # sleeping a full interval let two beats lie up to twice the interval apart.
        return min(link.last_sent for link in self.links) + self.heartbeat_s - time.monotonic()

    def _loop_failed(self, serving: Future) -> None:
        if serving.done() and serving.exception() is not None:
            log.error("the compute loop failed", exc_info=serving.exception())
            self.errors += 1

    def _take_batch(self) -> tuple[list[Task], list[int], Future | None, BatchClock]:
        """The waiting tasks to compute now (at most a PULL's credits: with several brokers more
        may have come; the rest run next, their KV already pulled), with what goes with them."""
        batch, self.pending = self.pending[:self.credits], self.pending[self.credits:]
        taken = (batch, self.frees, self.prefetch, self.clock)
        self.frees, self.prefetch, self.clock = [], None, BatchClock(arrived=time.perf_counter())
        return taken

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
                r.max_burst_tokens = int(settings.get("max_burst_tokens", 0))
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
            self.book.forget(rids)
            self.pending = current(self.pending, rids)  # (a waiting task that came before its request's FREE)
            for rid in rids:
                if self.origin.get(rid) is link:
                    del self.origin[rid]
        elif isinstance(msg, Error):
            self._on_error(link, msg)

    def _on_error(self, link: BrokerLink, msg: Error) -> None:
        if msg.code == "revoked":  # this worker's key was taken back: it must not serve
            log.error("the broker dropped this worker: %s", msg.message)
            self.exit_code = 2
            self._stop()
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
            self._stop()
        else:
            log.warning("broker error: %s", msg.message)

    def _complain(self, link: BrokerLink, exc: ProtocolError) -> None:
        """Count a malformed message and tell the broker that sent it, which counts it too."""
        self.errors += 1
        log.warning("rejected a message from the broker at %s: %s", link.address, exc)
        link.send(Error(exc.code, exc.message))

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop()

    def _stop(self) -> None:
        self.stopping = True
        os.write(self.wake_w, b"x")
        os.write(self.compute_w, b"x")


def serve_worker(opts: WorkerOptions) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {opts.role} %(levelname)s %(message)s")
    io_threads.pin_from_env()  # (before the first socket: the deployment's zmq_io_cpu)
    # The compute thread holds the GIL between torch ops; with the default 5 ms switch interval
    # a peer's KV request (KV server thread) or the next batch's pulls (prefetch thread) wait up
    # to 5 ms for it. 0.5 ms keeps them responsive for a small cost to compute.
    sys.setswitchinterval(float(os.environ.get("NEBULA_FLOW_SWITCH_INTERVAL_S", "0.0005")))
    return Worker(opts).run()
