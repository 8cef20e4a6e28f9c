"""The worker process: register, pull, compute, return results — pipelined.

The main thread owns the ZeroMQ socket and never computes; a single compute thread runs the
model (torch releases the GIL inside its kernels). So heartbeats flow while a batch runs, and
the next batch's PULL goes out as soon as the current batch starts: one batch computing, one
being fetched. A worker is stateless with respect to placement: it may get any task, and it
recomputes whatever KV it lacks.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from nebula_flow import protocol
from nebula_flow.kv.store import add_by_size
from nebula_flow.kv.transport import make_transport
from nebula_flow.models.loader import load_model
from nebula_flow.params import InvalidParams, SamplingParams
from nebula_flow.process import orphaned
from nebula_flow.protocol import Message, ProtocolError
from nebula_flow.routing import drafter_name, parse_ngram
from nebula_flow.security import is_loopback, keys_dir, make_client
from workers.ngram import NgramRunner
from workers.runner import ModelRunner, Task

# A batch whose same-host reads go into new caches of this many bytes or more gets those caches
# made on the prefetch thread while the previous batch computes: a new shared file's pages fault
# in at ~1.2 us each here (24 MB: ~7 ms), against ~0.1 ms for the thread handoff.
ROOM_BYTES = 1 << 20
COSTS_EVERY_S = 1.0  # forward-time tables go to the broker at most this often
log = logging.getLogger("nebula_flow.worker")
ROLES = ("draft", "target", "colocated")
REFUSALS = ("malformed", "wrong_role", "invalid_params")  # REGISTER errors that retrying cannot fix


@dataclass
class WorkerOptions:
    role: str
    broker: str
    model: str | None = None  # draft model for role draft, target model otherwise
    draft_model: str | None = None  # colocated only
    name: str = ""
    capacity: int = 8
    threads: int = 1
    device: str = "cpu"
    dtype: str | None = None
    batch_invariant: bool | None = None  # see models.invariant; None: on for bf16/fp16 on CPU
    heartbeat_s: float = 1.0
    liveness_s: float = 10.0  # broker silence after which the worker reconnects (with backoff)
    max_kv_gb: float = 4.0  # KV memory budget per model; least recently used requests are evicted
    kv_pool_gb: float | None = None  # finished requests' shared KV files kept for reuse (None: max_kv_gb / 8)
    kv_transport: str = "auto"  # see kv.transport.resolve_transport
    kv_host: str = "127.0.0.1"  # interface the KV server binds and advertises
    kv_overlap: bool = True  # pull a batch's KV while the previous batch computes (off: pull at start)
    keys: str | None = None  # CURVE key folder (or NEBULA_FLOW_KEYS): authenticate to the broker and peers
    profile: str | None = None  # latency profile when device == "emulated"
    draft_profile: str | None = None  # colocated + emulated: the draft's profile
    drafter: str | None = None  # draft workers: the drafter name routing knows them by (default: from the model)


class Worker:
    def __init__(self, opts: WorkerOptions) -> None:
        if opts.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if opts.max_kv_gb <= 0 or (opts.kv_pool_gb is not None and opts.kv_pool_gb < 0):
            raise ValueError("--max-kv-gb must be > 0 and --kv-pool-gb >= 0")
        if opts.device != "emulated" and (opts.model is None or (opts.role == "colocated" and opts.draft_model is None)):
            raise ValueError("--model is required (and --draft-model for a colocated worker)")
        self.opts = opts
        self.heartbeat_s = opts.heartbeat_s  # until the broker's WELCOME names its own interval
        self.name = opts.name or f"{opts.role}-{os.getpid()}"
        torch.set_num_threads(max(1, opts.threads))
        self.target = self.draft = None
        if opts.role == "draft":
            self.draft = self._draft_runner(opts.model, opts.profile)
        else:
            self.target = ModelRunner(self._load(opts.model, opts.profile, "target"), max_kv_bytes=int(opts.max_kv_gb * (1 << 30)))
        if opts.role == "colocated":
            self.draft = self._draft_runner(opts.draft_model, opts.draft_profile)
        self.drafter = drafter_name(opts.drafter, opts.model) if opts.role == "draft" else None
        self.runners = [r for r in (self.draft, self.target) if r is not None]
        self.stores = [r.store for r in self.runners if r.store is not None]  # (an n-gram drafter holds no KV)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
        self.worker_id = 0
        self.stall_s = 0.0
        self.keys = keys_dir(opts.keys)
        if self.keys is None and not is_loopback(opts.kv_host):
            raise ValueError(f"a KV server on {opts.kv_host} (off loopback) requires CURVE keys (--keys DIR)")
        # (with CURVE keys, only ZeroMQ: UCX and shared folders have no authentication)
        self.transport = make_transport(opts.kv_transport, self.keys, opts.device) \
            if opts.role != "colocated" and self._store_for(opts.role) is not None else None
        self.kv_endpoint = self.transport.serve(opts.kv_host, self._lookup) if self.transport else None
        if self.transport is not None and self.transport.share_folder is not None:  # same-host peers read our files
            for role, runner in (("draft", self.draft), ("target", self.target)):
                if runner is not None and runner.store is not None:
                    runner.store.share_into(self.transport.share_folder, role, None if opts.kv_pool_gb is None
                                            else int(opts.kv_pool_gb * (1 << 30)))
        self.wake_r, self.wake_w = os.pipe()
        self.stopping = False
        self.exit_code = 0
        self.errors = 0
        self.costs_sent_at = float("-inf")  # when forward times last went with a RESULT (_device_stats)

    def _draft_runner(self, model: str, profile: str | None):  # noqa: ANN202
        ngram = parse_ngram(model) if self.opts.device != "emulated" else None
        if ngram is not None:
            return NgramRunner(*ngram)
        return ModelRunner(self._load(model, profile, "draft"), max_kv_bytes=int(self.opts.max_kv_gb * (1 << 30)))

    def _load(self, model: str, profile: str | None, role: str):  # noqa: ANN202
        if self.opts.device != "emulated":
            loaded = load_model(model, self.opts.device, self.opts.dtype, self.opts.batch_invariant)
            if self.opts.dtype == "auto":  # (what it picked depends on the CPU or GPU: say so)
                log.info("%s: dtype auto -> %s on %s", role, loaded.lm_head.weight.dtype, self.opts.device)
            if loaded.batch_invariant:
                log.info("%s: batch-invariant numerics (%s)", role, loaded.invariance)
            return loaded
        from nebula_flow.emulated import EmulatedModel, load_profile

        if not profile:
            raise ValueError("--device emulated needs --profile (and --draft-profile for colocated workers)")
        return EmulatedModel(load_profile(profile), role)

    # -- protocol --------------------------------------------------------------------------
    def _vocab_size(self) -> int | None:
        runner = self.target or self.draft
        return runner.model.cfg.vocab_size if runner.model is not None else None  # (n-gram: any ids)

    def _model_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"path": str(self.opts.model), "device": self.opts.device}
        runner = self.target or self.draft
        if runner.model is not None:
            facts.update(vocab_size=runner.model.cfg.vocab_size, max_model_len=runner.model.cfg.max_position_embeddings)
        return facts

    def _send(self, msg: Message) -> None:
        self.sock.send_multipart(protocol.encode(msg), copy=False)
        self.last_sent = time.monotonic()

    def _register(self) -> None:
        msg = Message("REGISTER", {"role": self.opts.role, "name": self.name,
                                   "capacity": self.opts.capacity, "model": self._model_facts()})
        if self.kv_endpoint:
            msg.header["kv_endpoint"] = self.kv_endpoint
        if self.drafter:
            msg.header["drafter"] = self.drafter
        self._send(msg)
        self.registered = False

    # -- KV movement ---------------------------------------------------------------------
    def _store_for(self, role: str):  # noqa: ANN202
        runner = {"draft": self.draft, "target": self.target}.get(role)
        return runner.store if runner is not None and role == self.opts.role else None

    def _lookup(self, rid: int, role: str, start: int, end: int):  # noqa: ANN202 - KV server thread
        store = self._store_for(role)
        return store.snapshot(rid, start, end) if store is not None else None

    def _pulls(self, tasks: list[Task], local: bool | None = None) -> dict[str, list[tuple[int, np.ndarray, int]]]:
        """The KV this batch needs from peers: holder endpoint -> [(rid, tokens, valid length)].
        ``local``: only holders read from this host's memory (True), only the others (False), all (None)."""
        if self._store_for(self.opts.role) is None or self.transport is None:
            return {}
        by_holder: dict[str, list[tuple[int, np.ndarray, int]]] = {}
        for t in tasks:
            h = t.holder
            if h.get("endpoint") and h.get("worker") != self.worker_id and h.get("valid", 0) > 0:
                by_holder.setdefault(str(h["endpoint"]), []).append((t.rid, t.tokens, int(h["valid"])))
        if local is None:
            return by_holder
        return {e: w for e, w in by_holder.items() if self.transport.reads_locally(e) == local}

    def _room_to_make(self, tasks: list[Task]) -> dict[str, list[tuple[int, np.ndarray, int]]]:
        """This batch's same-host reads into caches not held here (by holder, as ``_pulls``),
        when they are large enough (``ROOM_BYTES``) to be worth a thread handoff."""
        store = self._store_for(self.opts.role)
        if store is None or store.share_folder is None:
            return {}
        room = {e: new for e, ws in self._pulls(tasks, local=True).items()
                if (new := [w for w in ws if w[0] not in store.caches])}
        positions = sum(min(valid, len(tokens) - 1) for ws in room.values() for _, tokens, valid in ws)
        return room if positions * store.row_bytes >= ROOM_BYTES else {}

    def _prefetch(self, pulls: dict[str, list[tuple[int, np.ndarray, int]]],
                  room: dict[str, list[tuple[int, np.ndarray, int]]] | None = None) -> None:
        """Pull a batch's missing KV (``_pulls``) from its holders: network pulls on the prefetch
        thread (overlapping compute), same-host reads and no-overlap pulls at compute start.
        ``room`` (``_room_to_make``; on the prefetch thread, first): for large same-host reads,
        make the caches they fill and have the pages on both sides in, so that at compute start
        they are only copies."""
        store = self._store_for(self.opts.role)
        for endpoint, wanted in (room or {}).items():
            try:
                store.make_room(wanted)
                self.transport.prepare_reads(endpoint, [(rid, self.opts.role, 0, min(valid, len(tokens) - 1))
                                                        for rid, tokens, valid in wanted])
            except Exception:  # only a head start: the pull at compute start does what is left
                log.exception("preparing KV reads from %s failed", endpoint)
        for endpoint, wanted in pulls.items():  # one exchange per holder for the whole batch
            try:
                store.fetch_many(self.opts.role, wanted, endpoint, self.transport)
            except Exception:  # never let a transfer problem cost the batch: recompute instead
                log.exception("KV pull from %s failed", endpoint)
                store.stats.pull_failures += len(wanted)

    def _kv_stats(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for store in self.stores:
            for k, v in store.stats.to_wire().items():
                if k == "by_size":
                    add_by_size(merged.setdefault(k, {}), v)
                else:
                    merged[k] = merged.get(k, 0) + v
        merged["stall_s"] = merged.get("stall_s", 0.0) + self.stall_s
        merged["overlap_s"] = max(0.0, merged.get("pull_s", 0.0) - merged["stall_s"])
        merged["transport"] = self.transport.scheme if self.transport else "none"
        merged["server_errors"] = getattr(self.transport, "errors", 0)
        if hasattr(self.transport, "routes"):  # shm+zmq: items read from same-host files / asked over the network
            merged["routes"] = dict(self.transport.routes)
        merged["held_requests"] = sum(len(store.caches) for store in self.stores)
        return merged

    def _decode_tasks(self, msg: Message) -> list[Task]:
        """Decode a TASKS batch. A bad task is answered with an error result for its request
        (so the broker ends that request instead of waiting); the good ones still run."""
        tasks, failed = [], Message("RESULT", {"results": [], "busy_s": 0.0})
        for raw in msg.header["tasks"]:
            try:
                tasks.append(self._decode_task(msg, raw))
            except ProtocolError as exc:
                head = {k: raw.get(k) for k in ("rid", "kind", "round", "attempt")} if isinstance(raw, dict) else {}
                try:
                    protocol.check_fields(head, {"rid": int, "kind": str, "round": int, "attempt": int}, "task")
                except ProtocolError:
                    self._complain(exc)
                    continue
                self.errors += 1
                failed.header["results"].append(dict(head, error=f"{exc.code}: {exc.message}"))
        if failed.header["results"]:
            self._send(failed)
        return tasks

    def _decode_task(self, msg: Message, raw: Any) -> Task:
        protocol.check_fields(raw, protocol.TASK_FIELDS, "task")
        if raw["kind"] not in protocol.TASK_KINDS:
            raise ProtocolError("malformed", f"unknown task kind {raw['kind']!r}")
        try:
            params = SamplingParams.from_wire(raw["params"])
        except (InvalidParams, TypeError) as exc:
            raise ProtocolError("invalid_params", str(exc)) from None
        task = Task(raw["rid"], raw["kind"], raw["round"], raw["attempt"],
                    np.asarray(msg.int_list(raw["tokens"], "tokens"), dtype=np.int64),
                    raw["k"], params, raw["seed"], list(raw.get("draft") or []), holder=raw["holder"])
        vocab = self._vocab_size() or (1 << 31) - 1
        if len(task.tokens) == 0 or task.tokens.min() < 0 or task.tokens.max() >= vocab:
            raise ProtocolError("malformed", f"task tokens must be a non-empty list of ids below {vocab}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in task.draft):
            raise ProtocolError("malformed", "draft must be a list of token ids")
        if not 0 <= task.k <= protocol.MAX_DRAFT or len(task.draft) > protocol.MAX_DRAFT:
            raise ProtocolError("malformed", f"k and draft length must be in 0..{protocol.MAX_DRAFT}")
        if raw.get("q_len") is not None:
            task.q_idx, task.q_prob = protocol.split_q(msg, raw)
        elif task.draft and not params.greedy:
            raise ProtocolError("malformed", "a sampled draft needs its proposal q")
        task.alts, task.alt = raw.get("alts") or 0, list(raw.get("alt") or [])
        if task.alts or task.alt:
            if not 0 <= task.alts <= protocol.MAX_ALTERNATIVES or len(task.alt) > protocol.MAX_ALTERNATIVES:
                raise ProtocolError("malformed", f"at most {protocol.MAX_ALTERNATIVES} alternatives")
            ids = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in task.alt)
            if task.alt and (not task.draft or not ids or len(set(task.alt) | {task.draft[0]}) != len(task.alt) + 1):
                raise ProtocolError("malformed", "alt must be distinct token ids other than draft[0], with a draft")
        task.fuse, task.chains = raw.get("fuse") or 0, raw.get("chains") or []
        if task.fuse or task.chains:
            if not isinstance(task.fuse, int) or not 0 <= task.fuse <= protocol.MAX_DRAFT:
                raise ProtocolError("malformed", f"fuse must be in 0..{protocol.MAX_DRAFT}")
            if len(task.chains) > protocol.MAX_FUSED_CHAINS or not all(
                    isinstance(c, list) and 0 < len(c) <= protocol.MAX_DRAFT
                    and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in c)
                    for c in task.chains):
                raise ProtocolError("malformed", f"chains must be at most {protocol.MAX_FUSED_CHAINS} lists of "
                                                 f"1..{protocol.MAX_DRAFT} token ids")
        return task

    # -- compute (runs on the compute thread) -----------------------------------------------
    def _compute(self, tasks: list[Task], frees: list[int], prefetch: Future | None) -> tuple[Message, float]:
        # Finished requests first: their shared files go back to the pool before this batch's
        # new caches are made (a pooled file's pages are already in; a new one faults them in).
        for store in self.stores:
            store.free(frees)
        t0 = time.perf_counter()
        if prefetch is not None:  # the batch's network pulls started when it arrived; wait for the rest
            prefetch.result()
        # Same-host reads (shm) run here, not in the background: a copy of well under a
        # millisecond gains nothing from overlap and would cost a thread handoff and a second
        # busy thread beside the running batch. Without overlap, compute waits for every pull.
        self._prefetch(self._pulls(tasks, local=True if self.opts.kv_overlap else None))
        self.stall_s += time.perf_counter() - t0
        busy0 = sum(r.busy_s for r in self.runners)
        msg = Message("RESULT", {"results": [], "busy_s": 0.0})
        by_kind: dict[str, list[Task]] = {}
        for t in tasks:
            by_kind.setdefault(t.kind, []).append(t)
        results = msg.header["results"]
        for kind, group in by_kind.items():
            heads = [{"rid": t.rid, "kind": t.kind, "round": t.round, "attempt": t.attempt} for t in group]
            try:
                if kind == "draft" and self.draft:
                    for h, d in zip(heads, self.draft.draft(group)):
                        h["draft"] = d.tokens
                        if d.alt:
                            h["alt"] = d.alt
                        if d.chains:
                            h["chains"] = d.chains
                        protocol.attach_q(msg, h, d.q_idx, d.q_prob)
                elif kind == "verify" and self.target and self.opts.role != "draft":
                    for h, t, committed in zip(heads, group, self.target.verify(group)):
                        h["committed"] = committed
                        if t.chains and not t.draft:  # a chain the target looked up itself
                            h["chains"] = t.chains
                elif kind == "round" and self.opts.role == "colocated":
                    drafts = self.draft.draft([t for t in group if t.k > 0])
                    it = iter(drafts)
                    for t in group:
                        if t.k > 0:
                            d = next(it)
                            t.draft, t.q_idx, t.q_prob, t.alt, t.chains = d.tokens, d.q_idx, d.q_prob, d.alt, d.chains
                    for h, t, committed in zip(heads, group, self.target.verify(group)):
                        h["committed"], h["draft"] = committed, t.draft
                        if t.alt:
                            h["alt"] = t.alt
                        if t.chains:
                            h["chains"] = t.chains
                else:
                    raise ProtocolError("wrong_role", f"a {self.opts.role} worker cannot run {kind} tasks")
            except Exception as exc:  # fail these requests clearly rather than leave them hanging
                log.exception("%s batch failed", kind)
                for h in heads:
                    h["error"] = f"{type(exc).__name__}: {exc}"
            results.extend(heads)
        for store in self.stores:
            store.unpin([t.rid for t in tasks])
        busy = sum(r.busy_s for r in self.runners) - busy0
        msg.header["busy_s"] = busy
        msg.header["kv"] = self._kv_stats()
        msg.header["device"] = self._device_stats()
        return msg, busy

    # -- the loop --------------------------------------------------------------------------
    def _connect(self, poller: zmq.Poller) -> None:
        """A fresh DEALER (a new identity: the broker sees a new worker) and a REGISTER."""
        old = getattr(self, "sock", None)
        if old is not None:
            poller.unregister(old)
            old.close(linger=0)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        if self.keys:
            make_client(self.sock, self.keys, "worker")
        self.sock.connect(self.opts.broker)
        poller.register(self.sock, zmq.POLLIN)
        self.last_heard = time.monotonic()
        self._register()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        poller = zmq.Poller()
        poller.register(self.wake_r, zmq.POLLIN)
        self._connect(poller)
        backoff = 1.0
        computing: Future | None = None
        pending: list[Task] | None = None
        prefetch: Future | None = None
        # The PULL waiting at the broker: None, "busy" (sent while computing: prefetch) or "idle".
        # A worker that goes idle with a "busy" PULL parked says so again, so the broker's
        # locality rules (only idle workers take tasks held elsewhere) see it as idle.
        pull_out: str | None = None
        frees: list[int] = []
        while True:
            if orphaned():  # the deployment that started us is gone: do not linger
                self.stopping = True
            if self.stopping and pull_out is not None and self.registered:
                # Leaving: withdraw the PULL parked at the broker, so no new task is sent here
                # only to be re-queued when the BYE arrives.
                self._send(Message("PULL", {"credits": 0, "idle": computing is None}))
                pull_out = None
            if self.stopping and computing is None:
                if self.registered:
                    self._send(Message("BYE"))
                break
            if self.registered and not self.stopping:
                if computing is None and pending:
                    computing = self.executor.submit(self._compute, pending, frees, prefetch)
                    computing.add_done_callback(lambda _f: os.write(self.wake_w, b"x"))
                    pending, frees, prefetch = None, [], None
                idle = computing is None
                if pending is None and (pull_out is None or (idle and pull_out == "busy")):
                    self._send(Message("PULL", {"credits": self.opts.capacity, "idle": idle}))
                    pull_out = "idle" if idle else "busy"
            if time.monotonic() - self.last_sent >= self.heartbeat_s:
                self._send(Message("HEARTBEAT"))
            # (never under three of the broker's beats: a broker set to beat slowly is not gone)
            liveness = max(self.opts.liveness_s, 3 * self.heartbeat_s)
            if time.monotonic() - self.last_heard > liveness * (backoff if not self.registered else 1):
                # The broker is gone (or never answered): reconnect, waiting longer each time.
                log.warning("no word from the broker for %.0f s: reconnecting", time.monotonic() - self.last_heard)
                self._connect(poller)
                pull_out, backoff = None, min(backoff * 2, 16.0)
            # Wake when the next heartbeat is due, not a whole interval after the last look:
            # sleeping a full interval let two beats lie up to twice the interval apart.
            due = self.last_sent + self.heartbeat_s - time.monotonic()
            events = dict(poller.poll(timeout=max(1, int(due * 1000) + 1)))
            if self.wake_r in events:
                os.read(self.wake_r, 64)
            if computing is not None and computing.done():
                try:
                    result, _ = computing.result()
                    self._send(result)
                except Exception:  # a bug in compute must not kill the worker silently
                    log.exception("batch failed")
                    self.errors += 1
                computing = None
            if self.sock in events:
                frames = self.sock.recv_multipart(copy=False)
                self.last_heard = time.monotonic()
                try:
                    msg = protocol.decode(frames)
                except ProtocolError as exc:
                    self._complain(exc)
                    continue
                if msg.kind == "WELCOME":
                    self.registered, pull_out, backoff = True, None, 1.0
                    self.worker_id = msg.header["worker_id"]
                    log.info("%s registered as worker %d (slot %d, mode %s)", self.name,
                             msg.header["worker_id"], msg.header["slot"], msg.header["mode"])
                    settings = msg.header["settings"]
                    for r in self.runners:
                        r.proposal_top_k = int(settings.get("proposal_top_k", r.proposal_top_k))
                    # The broker judges liveness against its own interval: beat at that pace.
                    self.heartbeat_s = float(settings.get("heartbeat_s", self.heartbeat_s))
                elif msg.kind == "TASKS":
                    pull_out = None
                    try:
                        batch = self._decode_tasks(msg)
                    except ProtocolError as exc:
                        self._complain(exc)
                        batch = []
                    if batch:  # start this batch's KV pulls now, while the current batch computes
                        # (two answers can cross a re-sent PULL: extend the waiting batch; the
                        # prefetch thread runs in order, so the last future covers both)
                        pending = (pending or []) + batch
                        # (a batch whose KV is all here or in this host's memory skips the prefetch
                        # thread: a thread handoff per batch is ~0.1 ms on a single stream's critical path)
                        pulls = self._pulls(batch, local=False) if self.opts.kv_overlap else {}
                        room = self._room_to_make(batch) if self.opts.kv_overlap else {}
                        if pulls or room:
                            prefetch = self.prefetcher.submit(self._prefetch, pulls, room)
                elif msg.kind == "FREE":
                    frees.extend(int(r) for r in msg.header["rids"] if isinstance(r, int))
                elif msg.kind == "ERROR":
                    if msg.header["code"] == "unknown_worker":  # the broker restarted: join again
                        pull_out = None
                        self._register()
                    elif not self.registered and msg.header["code"] in REFUSALS:
                        # The broker refused this worker (wrong role for its mode, bad endpoint, ...):
                        # retrying cannot help, and exiting lets a deployment report it at once.
                        log.error("the broker refused to register this worker: %s", msg.header["message"])
                        self.exit_code = 2
                        self.stopping = True
                    else:
                        log.warning("broker error: %s", msg.header["message"])
        self.executor.shutdown(wait=True)
        self.prefetcher.shutdown(wait=True)
        if self.transport is not None:
            self.transport.close()
        self.sock.close()
        return self.exit_code

    def _device_stats(self) -> dict[str, Any]:
        """Forward passes run and each model's numerics; on emulated devices also how far the host
        fell behind the profile."""
        out: dict[str, Any] = {"forwards": sum(r.forwards for r in self.runners)}
        # each model's forward seconds for one sequence by new rows (1, 2, ...; null: not seen): the
        # policy's adaptive k weighs a round's draft steps and verify block with them. At most once
        # per COSTS_EVERY_S: they move slowly, and the broker takes a median over workers per update.
        if time.monotonic() - self.costs_sent_at >= COSTS_EVERY_S:
            tables = {role: t for role, r in (("draft", self.draft), ("target", self.target))
                      if r is not None and (t := r.step_costs.table())}
            if tables:
                out["step_costs"] = tables
                self.costs_sent_at = time.monotonic()
        for role, runner in (("draft", self.draft), ("target", self.target)):
            if runner is not None and isinstance(runner.model, torch.nn.Module):
                dtype = str(runner.model.lm_head.weight.dtype).removeprefix("torch.")
                out[f"{role}_numerics"] = dtype + (" batch-invariant" if runner.model.batch_invariant else "")
                out[f"{role}_packed_layers"] = runner.model.packed_layers  # models/packed.py
                if runner.model.packed_from_rows:  # weight shape -> fewest rows on the packed kernel
                    out[f"{role}_packed_from_rows"] = runner.model.packed_from_rows
        emulated = [r.model for r in self.runners if hasattr(r.model, "overrun_s")]
        if emulated:
            out["emulated_predicted_s"] = sum(m.predicted_s for m in emulated)
            out["emulated_overrun_s"] = sum(m.overrun_s for m in emulated)
        return out

    def _complain(self, exc: ProtocolError) -> None:
        """Count a malformed message and tell the broker, which counts it too."""
        self.errors += 1
        log.warning("rejected a message from the broker: %s", exc)
        self._send(protocol.error(exc.code, exc.message))

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
