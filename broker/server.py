"""The broker: one request pool, a draft topic and a target topic, two ROUTER sockets.

Clients (DEALER) submit, cancel and receive streamed tokens on the client socket; workers
(DEALER) register, pull, and return results on the worker socket. The decisions are the
``Scheduler``'s; this module only moves messages, validates them and keeps counters. It
never blocks on a peer: every send is non-blocking, and a peer that cannot take a message is
dropped (a worker's tasks are re-queued).
"""

from __future__ import annotations

import logging
import secrets
import signal
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from nebula_flow import protocol
from nebula_flow.metrics import MetricsServer
from nebula_flow.metrics import render as render_metrics
from nebula_flow.models.config import ModelConfig
from nebula_flow.params import InvalidParams, SamplingParams
from nebula_flow.policy_log import RecordingScheduler
from nebula_flow.process import orphaned
from nebula_flow.protocol import Message, ProtocolError
from nebula_flow.request import DRAFT, ROUND, VERIFY, Request
from nebula_flow.scheduler import MODES, POLICY_KNOBS, Scheduler
from nebula_flow.security import SecurityError, is_loopback, keys_dir, make_server, start_authenticator
from nebula_flow.speclen import DEFAULT_COSTS, FIT_ROWS
from nebula_flow.tokenizer import TextCodec, eos_token_ids
from nebula_flow.tree import TokenTree, fused_gain

log = logging.getLogger("nebula_flow.broker")
MAX_REQ_ID = 128


@dataclass
class BrokerOptions:
    mode: str = "pooled"
    host: str = "127.0.0.1"
    client_port: int = 5555
    worker_port: int = 5556
    model: str | None = None  # the target checkpoint: tokenizer, context length, EOS ids
    k: int = 4
    proposal_top_k: int = 16
    max_pending: int = 1024
    max_inflight_per_client: int = 256
    max_new_tokens_limit: int = 4096
    heartbeat_s: float = 1.0
    liveness_s: float = 10.0
    drain_s: float = 30.0
    metrics_port: int | None = None  # HTTP port for Prometheus /metrics (None: off, 0: any free port)
    keys: str | None = None  # CURVE key folder (see nebula_flow/security.py); required off loopback
    locality: bool = True  # prefer giving a worker tasks whose KV it holds (never waits for it); off = affinity-free
    migrate: bool = False  # testing/measurement: never give a request the same worker twice in a row
    merge_batches: bool = True  # no small batch for a busy worker beside a bigger running one (Scheduler.dispatch)
    adaptive_k: bool = False  # each round's k in 0..k from the request's acceptance (speclen.py); off: always k
    spec_costs: list[float] = field(default_factory=lambda: list(DEFAULT_COSTS))  # draft step, verify row, round
    measure_costs: bool = True  # adaptive_k: weigh draft steps and verify blocks by the workers' measured forward times
    first_alternatives: int = 0  # the draft also proposes this many runner-ups to its first token (token tree)
    fuse_ngram: int = 0  # a prompt-lookup chain of up to this many tokens is verified beside each draft
    disable_by_batch_size: int = 0  # rounds start without drafts while more requests than this are pooled (0: never)
    policy_log: str | None = None  # write every policy event and decision here (JSONL) at exit; see policy_log.py

    def check(self) -> None:
        """Refuse timing that declares healthy workers dead: a worker beats once per heartbeat_s,
        so a liveness under two beats drops any worker whose beat is a little late."""
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.liveness_s < 2 * self.heartbeat_s:
            raise ValueError(f"liveness_s ({self.liveness_s}) must be at least twice heartbeat_s "
                             f"({self.heartbeat_s})")

    @property
    def client_address(self) -> str:
        return f"tcp://{self.host}:{self.client_port}"

    @property
    def worker_address(self) -> str:
        return f"tcp://{self.host}:{self.worker_port}"


@dataclass
class WorkerInfo:
    identity: bytes
    role: str
    name: str
    last_seen: float
    kv_endpoint: str | None = None
    busy_s: float = 0.0
    tasks: int = 0
    kv: dict[str, Any] | None = None  # the worker's latest KV counters
    device: dict[str, Any] | None = None  # forwards run; emulated devices: predicted vs overrun seconds


class Broker:
    def __init__(self, opts: BrokerOptions) -> None:
        opts.check()
        self.opts = opts
        policy = RecordingScheduler if opts.policy_log else Scheduler
        self.scheduler = policy(opts.mode, opts.k, **{knob: getattr(opts, knob) for knob in POLICY_KNOBS})
        self.codec = TextCodec(opts.model) if opts.model else None
        self.eos_ids = eos_token_ids(opts.model, self.codec) if opts.model else ()
        self.max_model_len = ModelConfig.from_dir(opts.model).max_position_embeddings if opts.model else 1 << 30
        self.vocab_size = ModelConfig.from_dir(opts.model).vocab_size if opts.model else None
        self.counters: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.workers: dict[int, WorkerInfo] = {}
        self.by_identity: dict[bytes, int] = {}
        # Client-chosen request ids (random, unique) make SUBMIT idempotent: a retry of a running
        # request re-attaches to it, a retry of a finished one gets its result again.
        self.by_req_id: dict[str, int] = {}
        self.finished: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.inflight_by_owner: Counter[bytes] = Counter()
        self.next_rid = self.next_worker = 1
        self.frees: list[int] = []
        self.draining_since: float | None = None
        self.started = time.monotonic()
        self.proposed_by_position: list[int] = []
        self.accepted_by_position: list[int] = []
        self.tokens_per_round_hist: Counter[int] = Counter()
        self.drafter_counts: dict[str, Counter[str]] = {}  # drafter -> rounds, proposed, accepted
        self.batch_sizes: dict[str, Counter[int]] = {}
        self.metrics = None
        self.client_outbox: list[tuple[bytes, Message]] = []  # see _send

    # -- sockets ---------------------------------------------------------------------------
    def bind(self) -> None:
        folder = keys_dir(self.opts.keys)
        if folder is None and not is_loopback(self.opts.host):
            raise SecurityError(f"binding to {self.opts.host} (off loopback) requires CURVE keys: "
                                "create them with `nebula-flow keys DIR` and pass --keys DIR")
        self.auth = start_authenticator(folder) if folder else None
        ctx = zmq.Context.instance()
        self.clients = ctx.socket(zmq.ROUTER)
        self.peers = ctx.socket(zmq.ROUTER)
        for sock in (self.clients, self.peers):
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # learn about vanished peers instead of dropping silently
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            if folder:
                make_server(sock, folder, "broker")
        self.clients.bind(self.opts.client_address)
        self.peers.bind(self.opts.worker_address)

    def _send(self, sock: zmq.Socket, identity: bytes, msg: Message) -> bool:
        if sock is self.clients:
            # Clients hear of a round after the next round's tasks are out (``step`` flushes this
            # once it has dispatched): on a loaded host a client woken by its tokens competes with
            # the worker that has to start the next round (measured ~0.5 ms of a round's latency).
            self.client_outbox.append((identity, msg))
            return True
        return self._send_now(sock, identity, msg)

    def _send_now(self, sock: zmq.Socket, identity: bytes, msg: Message) -> bool:
        try:
            sock.send_multipart([identity, *protocol.encode(msg)], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:
            self.counters["send_failures"] += 1
            return False

    def _reject(self, sock: zmq.Socket, identity: bytes, code: str, message: str, req_id: str | None = None) -> None:
        self.errors[code] += 1
        self._send(sock, identity, protocol.error(code, message, req_id))

    # -- clients ---------------------------------------------------------------------------
    def on_client(self, identity: bytes, frames: list[Any], now: float) -> None:
        try:
            msg = protocol.decode(frames)
            if msg.kind == "SUBMIT":
                self._submit(identity, msg, now)
            elif msg.kind == "CANCEL":
                rid = self.by_req_id.get(msg.header["req_id"])
                if rid is None:
                    raise ProtocolError("unknown_request", f"no active request {msg.header['req_id']!r}")
                self._finish(rid, "cancelled")
            elif msg.kind == "STATUS":
                self._send(self.clients, identity, Message("STATE", {"state": self.state(now)}))
            else:
                raise ProtocolError("unexpected_kind", f"{msg.kind} is not a client message")
        except ProtocolError as exc:
            req_id = _req_id_of(frames)
            self._reject(self.clients, identity, exc.code, exc.message, req_id)

    def _submit(self, identity: bytes, msg: Message, now: float) -> None:
        h = msg.header
        req_id = h["req_id"]
        if not 0 < len(req_id) <= MAX_REQ_ID:
            raise ProtocolError("malformed", f"req_id must have 1..{MAX_REQ_ID} characters")
        if self.draining_since is not None:
            raise ProtocolError("shutting_down", "the broker is shutting down")
        if req_id in self.by_req_id:  # a retry: re-attach and resend what was committed so far
            req = self.scheduler.requests[self.by_req_id[req_id]]
            self.inflight_by_owner[req.owner] -= 1
            req.owner = identity
            self.inflight_by_owner[identity] += 1
            self.counters["requests_reattached"] += 1
            self._send(self.clients, identity, Message("TOKENS", {"req_id": req_id, "token_ids": req.output,
                                                                  "text": req.text, "offset": 0}))
            return
        if req_id in self.finished:
            self.counters["requests_replayed"] += 1
            self._send(self.clients, identity, Message("DONE", self.finished[req_id]))
            return
        if self.inflight_by_owner[identity] >= self.opts.max_inflight_per_client:
            raise ProtocolError("busy", f"this client already has {self.opts.max_inflight_per_client} requests in flight")
        try:
            params = SamplingParams.from_wire(h["params"])
            params.validate(self.opts.max_new_tokens_limit)
        except (InvalidParams, TypeError) as exc:
            raise ProtocolError("invalid_params", str(exc)) from None
        if (h.get("prompt") is None) == (h.get("prompt_tokens") is None):
            raise ProtocolError("malformed", "give exactly one of prompt and prompt_tokens")
        if h.get("prompt") is not None:
            if self.codec is None:
                raise ProtocolError("no_tokenizer", "this broker has no tokenizer; send prompt_tokens")
            try:
                prompt = self.codec.encode(h["prompt"], chat=bool(h.get("chat")))
            except ValueError as exc:
                raise ProtocolError("invalid_prompt", str(exc)) from None
        else:
            prompt = msg.int_list(h["prompt_tokens"], "prompt_tokens")
            if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in prompt):
                raise ProtocolError("invalid_prompt", f"token ids must be in [0, {self.vocab_size})")
        if not prompt:
            raise ProtocolError("invalid_prompt", "the prompt is empty")
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ProtocolError("too_long", f"prompt ({len(prompt)} tokens) + max_new_tokens "
                                            f"({params.max_new_tokens}) exceeds the context ({self.max_model_len})")
        if len(self.scheduler.requests) >= self.opts.max_pending:
            raise ProtocolError("busy", f"{self.opts.max_pending} requests pending; retry later")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(self.next_rid, req_id, prompt, params, seed, owner=identity, t_submit=now)
        self.next_rid += 1
        self.by_req_id[req_id] = req.rid
        self.inflight_by_owner[identity] += 1
        self.counters["requests_submitted"] += 1
        self.scheduler.admit(req)

    def _finish(self, rid: int, reason: str, error: tuple[str, str] | None = None) -> None:
        req = self.scheduler.finish(rid)
        if req is None:
            return
        self.by_req_id.pop(req.req_id, None)
        self.inflight_by_owner[req.owner] -= 1
        if self.inflight_by_owner[req.owner] <= 0:
            del self.inflight_by_owner[req.owner]
        self.frees.append(rid)
        req.finish_reason = req.finish_reason or reason
        if error is not None:
            self.counters["requests_failed"] += 1
            self._reject(self.clients, req.owner, error[0], error[1], req.req_id)
            return
        self.counters[f"requests_{req.finish_reason}"] += 1
        text = apply_stop(self.codec.decode(req.output), req.params.stop)[0] if self.codec else ""
        done = {"req_id": req.req_id, "token_ids": req.output, "text": text,
                "finish_reason": req.finish_reason, "stats": req.stats()}
        self.finished[req.req_id] = done
        while len(self.finished) > 4096:  # bounded: old results age out
            self.finished.popitem(last=False)
        self._send(self.clients, req.owner, Message("DONE", done))

    def _stream(self, req: Request, kept: list[int], now: float) -> None:
        """Send what a verify committed; apply stop strings to the decoded text."""
        delta = ""
        if self.codec is not None:
            full, hit = apply_stop(self.codec.decode(req.output), req.params.stop)
            if hit:
                req.finish_reason = "stop"
            if hit or not full.endswith("\ufffd"):  # hold back a partial UTF-8 character
                delta, req.text = full[len(req.text):], full
        if req.t_first is None:
            req.t_first = now
        self._send(self.clients, req.owner, Message("TOKENS", {"req_id": req.req_id, "token_ids": kept, "text": delta,
                                                               "offset": len(req.output) - len(kept)}))

    # -- workers ---------------------------------------------------------------------------
    def on_worker(self, identity: bytes, frames: list[Any], now: float) -> None:
        wid = self.by_identity.get(identity)
        try:
            msg = protocol.decode(frames)
            if msg.kind == "REGISTER":
                self._register(identity, msg, now)
                return
            if wid is None:
                raise ProtocolError("unknown_worker", "register first")
            self.workers[wid].last_seen = now
            if msg.kind == "PULL":
                self.scheduler.pull(wid, min(msg.header["credits"], 4096), msg.header["idle"], now)
            elif msg.kind == "RESULT":
                self.workers[wid].busy_s += max(0.0, float(msg.header["busy_s"]))
                if isinstance(msg.header.get("kv"), dict):
                    self.workers[wid].kv = msg.header["kv"]
                if isinstance(msg.header.get("device"), dict):
                    self.workers[wid].device = msg.header["device"]
                    self._observe_costs(wid, msg.header["device"].get("step_costs"))
                for raw in msg.header["results"]:
                    try:
                        self._result(wid, msg, raw, now)
                    except ProtocolError as exc:  # one bad entry must not strand the others
                        self._reject(self.peers, identity, exc.code, exc.message)
            elif msg.kind == "BYE":
                self._drop_worker(wid, "left")
            elif msg.kind == "ERROR":  # a worker rejected something we sent it
                self.errors[f"worker_reported_{msg.header['code']}"] += 1
            elif msg.kind != "HEARTBEAT":
                raise ProtocolError("unexpected_kind", f"{msg.kind} is not a worker message")
        except ProtocolError as exc:
            self._reject(self.peers, identity, exc.code, exc.message)

    def _register(self, identity: bytes, msg: Message, now: float) -> None:
        h = msg.header
        if identity in self.by_identity:
            self._drop_worker(self.by_identity[identity], "re-registered")
        if not 1 <= h["capacity"] <= 4096:
            raise ProtocolError("invalid_params", "capacity must be in 1..4096")
        endpoint = h.get("kv_endpoint")
        if endpoint is not None and (len(endpoint) > 512 or not all(
                part.startswith(("tcp://", "ucx://", "shm://")) for part in endpoint.split(";"))):
            raise ProtocolError("malformed", "kv_endpoint must be tcp://, ucx:// or shm:// addresses joined by ';'")
        drafter = h.get("drafter")
        if drafter is not None and not protocol.DRAFTER_NAME.fullmatch(drafter):
            raise ProtocolError("malformed", f"drafter must be {protocol.DRAFTER_RULE}")
        wid = self.next_worker
        try:
            slot = self.scheduler.register(wid, h["role"], h["capacity"], drafter)
        except ValueError as exc:
            raise ProtocolError("wrong_role", str(exc)) from None
        self.next_worker += 1
        self.workers[wid] = WorkerInfo(identity, h["role"], h["name"][:64], now, endpoint)
        self.by_identity[identity] = wid
        log.info("worker %d (%s, %s) joined in slot %d", wid, h["name"][:64], h["role"], slot)
        self._send(self.peers, identity, Message("WELCOME", {
            "worker_id": wid, "slot": slot, "mode": self.opts.mode,
            "settings": {"proposal_top_k": self.opts.proposal_top_k, "heartbeat_s": self.opts.heartbeat_s}}))

    def _drop_worker(self, wid: int, why: str) -> None:
        info = self.workers.pop(wid, None)
        if info is None:
            return
        self.by_identity.pop(info.identity, None)
        requeued = self.scheduler.unregister(wid)
        self.counters[f"workers_{why}"] += 1
        self.counters["tasks_requeued"] += len(requeued)
        log.warning("worker %d (%s) %s; %d tasks re-queued", wid, info.name, why, len(requeued))

    def _result(self, wid: int, msg: Message, raw: Any, now: float) -> None:
        protocol.check_fields(raw, protocol.RESULT_FIELDS, "result")
        req = self.scheduler.accepts_result(wid, raw["rid"], raw["attempt"], raw["kind"])
        if req is None:
            self.counters["stale_results"] += 1
            return
        self.workers[wid].tasks += 1
        if raw.get("error"):
            self._finish(req.rid, "error", ("worker_error", str(raw["error"])[:500]))
            return
        try:
            self._apply_result(wid, msg, req, raw, now)
        except ProtocolError as exc:
            # A result we cannot use still ends its request with a clear error, never a hang.
            self.errors[exc.code] += 1
            self._finish(req.rid, "error", ("worker_error", f"bad result from worker {wid}: {exc.message}"))

    def _apply_result(self, wid: int, msg: Message, req: Request, raw: dict, now: float) -> None:
        if raw["kind"] in (DRAFT, ROUND):
            draft = _int_list(raw.get("draft") or [], "draft")
            if len(draft) > req.k:  # (fewer: a drafter with nothing worth proposing, e.g. n-gram without a match)
                raise ProtocolError("malformed", f"draft has {len(draft)} tokens, asked for at most {req.k}")
            alt, chains = self._alternatives(req, raw, draft), self._fused_chains(req, raw)
        if raw["kind"] == DRAFT:
            q = {}
            if not req.params.greedy:
                idx, prob = protocol.split_q(msg, raw)
                q = {"q_idx": [a.copy() for a in idx], "q_prob": [p.copy() for p in prob]}
            self.scheduler.draft_done(req, wid, draft, q)
            req.alt, req.chains = alt, chains
            return
        if raw["kind"] == ROUND:  # (drafted and verified in one task: its draft comes with the result)
            req.proposed += len(draft)
        else:
            draft, alt, chains = req.draft, req.alt, req.chains
            if not draft:  # a round without a draft: the target looked the chain up itself
                chains = self._fused_chains(req, raw)
        committed = _int_list(raw.get("committed"), "committed")
        tree = TokenTree([draft, *([a] for a in alt), *chains])
        if not committed or len(tree.path(committed[:-1])) != len(committed) - 1:
            raise ProtocolError("malformed", f"{len(committed)} committed tokens are not a path of the round's "
                                             f"drafts and one more token")
        accepted = len(committed) - 1
        chain = next((i for i, (a, b) in enumerate(zip(draft, committed[:-1])) if a != b), min(len(draft), accepted))
        via_alt = chain == 0 and accepted > 0 and committed[0] in alt
        fused = fused_gain(accepted, chain, via_alt)
        self.counters["alternatives_proposed"] += len(alt)
        self.counters["alternatives_contested"] += bool(alt) and chain == 0  # (where a runner-up could win)
        self.counters["alternatives_accepted"] += via_alt
        req.alt_accepted += via_alt
        self.counters["fused_asked"] += req.fuse > 0
        self.counters["fused_chains"] += len(chains)
        self.counters["fused_rounds_won"] += fused > 0
        self.counters["fused_tokens_accepted"] += fused
        req.fused_accepted += fused
        self._count_acceptance(len(draft), chain, len(committed))
        if req.drafter is not None and raw["kind"] != ROUND:
            by = self.drafter_counts.setdefault(req.drafter, Counter())
            by["rounds"] += 1
            by["proposed"] += len(draft)
            by["accepted"] += chain
        self.scheduler.verify_done(req, wid, accepted, via_alt, chain, fused if chains else None)
        kept = req.commit(committed, self.eos_ids)
        self.counters["rounds"] += 1
        self.counters["tokens_out"] += len(kept)
        self._stream(req, kept, now)
        if req.finish_reason:
            self._finish(req.rid, req.finish_reason)
        else:
            self.scheduler.start_round(req)

    def _observe_costs(self, wid: int, raw: object) -> None:
        """Feed a worker's measured forward times (its RESULT's ``device.step_costs``) to the policy;
        a malformed entry is counted and left out (the results it came with still count)."""
        if raw is None:
            return
        roles = {"colocated": ("draft", "target")}.get(self.workers[wid].role, (self.workers[wid].role,))
        try:
            if not isinstance(raw, dict):
                raise ValueError
            for role, seconds in raw.items():
                if role not in roles or not isinstance(seconds, list) or not 0 < len(seconds) <= FIT_ROWS \
                        or not all(t is None or _seconds(t) for t in seconds):
                    raise ValueError
                self.scheduler.observe_costs(wid, role, [None if t is None else float(t) for t in seconds])
        except (ValueError, TypeError):
            self.errors["malformed"] += 1

    def _alternatives(self, req: Request, raw: dict, draft: list[int]) -> list[int]:
        """The alternatives to the first draft token a draft / round result brings, checked
        against the ones the policy asked for (``req.alts``: a two-level token tree)."""
        alt = _int_list(raw.get("alt") or [], "alt")
        if alt and not draft:
            raise ProtocolError("malformed", "alternatives to the first draft token need a draft")
        if len(alt) > req.alts or len(set(alt)) != len(alt) or (alt and draft[0] in alt):
            raise ProtocolError("malformed", f"{len(alt)} alternatives (asked for {req.alts}) must be distinct "
                                             "and differ from the first draft token")
        return alt

    def _fused_chains(self, req: Request, raw: dict) -> list[list[int]]:
        """The chains a result fused beside its draft (or, without one, looked up for its verify),
        checked against what the policy asked for (``req.fuse``: at most one chain of that many
        tokens)."""
        chains = raw.get("chains") or []
        if not isinstance(chains, list) or len(chains) > (1 if req.fuse else 0):
            raise ProtocolError("malformed", f"{len(chains) if isinstance(chains, list) else 'bad'} fused chains "
                                             f"(asked for {1 if req.fuse else 0})")
        for c in chains:
            if not 0 < len(_int_list(c, "chains")) <= req.fuse:
                raise ProtocolError("malformed", f"a fused chain of {len(c)} tokens (asked for 1..{req.fuse})")
        return chains

    def _count_acceptance(self, proposed: int, accepted: int, committed: int) -> None:
        """``accepted``: chain drafts accepted; ``committed``: tokens the round committed."""
        while len(self.proposed_by_position) < proposed:
            self.proposed_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(proposed):
            self.proposed_by_position[i] += 1
            self.accepted_by_position[i] += i < accepted
        self.tokens_per_round_hist[committed] += 1

    def _send_tasks(self, wid: int, batch: list[Request]) -> None:
        role = self.workers[wid].role
        self.batch_sizes.setdefault(role, Counter())[len(batch)] += 1
        msg = Message("TASKS", {"tasks": []})
        for req in batch:
            holder_id, valid = req.holders.get(self.scheduler.holder_key(req), (0, 0))
            holder = {"worker": holder_id, "valid": valid}
            info = self.workers.get(holder_id)
            if info is not None and info.kv_endpoint:
                holder["endpoint"] = info.kv_endpoint
            task = {"rid": req.rid, "kind": req.phase, "round": req.round, "attempt": req.attempt,
                    "tokens": msg.add_array(req.tokens), "k": req.k, "params": req.params.to_wire(),
                    "seed": req.seed, "holder": holder}
            if req.alts and req.phase in (DRAFT, ROUND):
                task["alts"] = req.alts
            if req.fuse and (req.phase != VERIFY or not req.draft):  # (without a draft the target looks it up)
                task["fuse"] = req.fuse
            if req.draft:
                task["draft"] = req.draft
                if req.alt:
                    task["alt"] = req.alt
                if req.chains:
                    task["chains"] = req.chains
                protocol.attach_q(msg, task, req.q.get("q_idx"), req.q.get("q_prob"))
            msg.header["tasks"].append(task)
        if not self._send(self.peers, self.workers[wid].identity, msg):
            self._drop_worker(wid, "unreachable")

    # -- the loop --------------------------------------------------------------------------
    def state(self, now: float) -> dict[str, Any]:
        return {
            "mode": self.opts.mode, "uptime_s": now - self.started, "pool": len(self.scheduler.requests),
            "max_model_len": self.max_model_len,
            "topics": self.scheduler.depth(), "roles": list(MODES[self.opts.mode]),
            "workers": [{"id": wid, "role": w.role, "name": w.name, "drafter": self.scheduler.workers[wid].drafter,
                         "busy_s": w.busy_s, "tasks": w.tasks,
                         "slot": self.scheduler.workers[wid].slot, "kv_endpoint": w.kv_endpoint, "kv": w.kv,
                         "device": w.device}
                        for wid, w in self.workers.items()],
            "counters": dict(self.counters), "errors": dict(self.errors),
            # what adaptive k weighs now: draft step, verify row, round, in target decode steps
            "spec_costs": list(self.scheduler.costs), "verify_costs": list(self.scheduler.verify_costs),
            "drafters": self._drafters_state(),
            "proposed_by_position": self.proposed_by_position, "accepted_by_position": self.accepted_by_position,
            "tokens_per_round_hist": {str(k): v for k, v in self.tokens_per_round_hist.items()},
            "batch_sizes": {r: {str(k): v for k, v in h.items()} for r, h in self.batch_sizes.items()},
            "metrics_port": self.metrics.port if self.metrics else None,
        }

    def _drafters_state(self) -> dict[str, dict[str, Any]]:
        """Per drafter: its live workers, rounds drafted, drafts proposed and accepted; with several,
        the pool's recent acceptance of it (greedy, sampled) and the costs routing weighs (draft
        step, verify row, round)."""
        s = self.scheduler
        out = {}
        for name in sorted(set(s.drafters) | set(self.drafter_counts)):
            counts = self.drafter_counts.get(name, Counter())
            entry: dict[str, Any] = {"workers": s.drafters.get(name, 0), "rounds": counts["rounds"],
                                     "proposed": counts["proposed"], "accepted": counts["accepted"]}
            rates = {kind: acc.rate for kind, greedy in (("greedy", True), ("sampled", False))
                     if (acc := s.drafter_acceptance.get((name, greedy))) is not None}
            if rates:
                entry["acceptance"] = rates
            if name in s.drafter_costs:
                entry["spec_costs"] = list(s.drafter_costs[name][0])
            out[name] = entry
        return out

    def step(self, now: float) -> None:
        """Housekeeping after events: dispatch, FREE broadcasts, heartbeats, liveness; then what
        the clients are owed."""
        for wid, batch in self.scheduler.dispatch():
            self._send_tasks(wid, batch)
        if self.frees:
            for info in list(self.workers.values()):
                self._send(self.peers, info.identity, Message("FREE", {"rids": self.frees}))
            self.frees = []
        if self.metrics is not None and now - self._last_render >= 0.5:
            self._last_render = now
            self.metrics.snapshot = render_metrics(self.state(now))
        if now - self._last_beat >= self.opts.heartbeat_s:
            self._last_beat = now
            for wid, info in list(self.workers.items()):
                if now - info.last_seen > self.opts.liveness_s:
                    self._drop_worker(wid, "dead")
                else:
                    self._send(self.peers, info.identity, Message("HEARTBEAT"))
        self._flush_clients()

    def _flush_clients(self) -> None:
        outbox, self.client_outbox = self.client_outbox, []
        for identity, msg in outbox:
            self._send_now(self.clients, identity, msg)

    def run(self) -> int:
        self.bind()
        self._last_beat = self._last_render = time.monotonic()
        if self.opts.metrics_port is not None:
            self.metrics = MetricsServer(self.opts.host, self.opts.metrics_port)
            log.info("metrics at http://%s:%d/metrics", self.opts.host, self.metrics.port)
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        signal.signal(signal.SIGINT, lambda *_: stop.append(1))
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.peers, zmq.POLLIN)
        log.info("broker (%s) clients at %s, workers at %s", self.opts.mode,
                 self.opts.client_address, self.opts.worker_address)
        while True:
            events = dict(poller.poll(timeout=int(self.opts.heartbeat_s * 1000 / 2)))
            now = time.monotonic()
            for sock, handler in ((self.peers, self.on_worker), (self.clients, self.on_client)):
                if sock in events:
                    for _ in range(1000):  # bounded, so one busy socket cannot starve the other
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if len(frames) < 2:
                            self.errors["malformed"] += 1
                            continue
                        handler(frames[0].bytes, frames[1:], now)
            self.step(now)
            if orphaned():  # the deployment that started us is gone
                stop.append(1)
            if stop and self.draining_since is None:
                log.info("stopping: no new requests; %d in flight", len(self.scheduler.requests))
                self.draining_since = now
            if self.draining_since is not None:
                if not self.scheduler.requests or now - self.draining_since > self.opts.drain_s:
                    for rid in list(self.scheduler.requests):
                        self._finish(rid, "error", ("shutting_down", "the broker shut down before this request finished"))
                    self._flush_clients()
                    break
        self.clients.close()
        self.peers.close()
        if isinstance(self.scheduler, RecordingScheduler):
            self.scheduler.save(self.opts.policy_log)
            log.info("policy log: %d records in %s", len(self.scheduler.records), self.opts.policy_log)
        if self.metrics is not None:
            self.metrics.close()
        if self.auth is not None:
            self.auth.stop()
        return 0


def apply_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string; says whether one was found."""
    cuts = [at for at in (text.find(s) for s in stops) if at >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def _seconds(value: Any, least: float = 1e-9) -> bool:
    """A finite duration of at least ``least`` seconds, under an hour (a bool is no number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and least <= value < 3600.0


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ProtocolError("malformed", f"{name} must be a list of token ids")
    return value


def _req_id_of(frames: list[Any]) -> str | None:
    """Best effort: the req_id of a rejected message, so the client can match the error."""
    try:
        header = protocol.orjson.loads(bytes(frames[1].buffer if hasattr(frames[1], "buffer") else frames[1]))
        rid = header.get("req_id")
        return rid if isinstance(rid, str) and len(rid) <= MAX_REQ_ID else None
    except Exception:
        return None


def serve_broker(opts: BrokerOptions) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s broker %(levelname)s %(message)s")
    try:
        return Broker(opts).run()
    except SecurityError as exc:
        log.error("%s", exc)
        return 2
