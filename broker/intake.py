"""The broker's client side: a SUBMIT becomes a request of the pool (at once, or once its long
prompt is tokenized off the dispatch thread: ``tokenizing``), a retry re-attaches, a cancel ends
it, and a request that leaves the pool is answered to its client.

A part of ``Broker`` (``server.py``), kept apart so each module stays readable; it uses the
broker's sockets, counters and policy through ``self``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import orjson
import zmq

from nebula_flow import displace, protocol
from nebula_flow.protocol import Cancel, Done, Error, ProtocolError, State, Status, Submit, TaskResult, Tokenize, Tokens
from nebula_flow.request import Request
from nebula_flow.wire import req_id_of
from nebula_flow_broker import results
from nebula_flow_broker.access import owner_of
from nebula_flow_broker.tokenizing import INLINE_CHARS, tokenize_chars

log = logging.getLogger("nebula_flow.broker")
# Stream chunks with logprobs are big (each token's top tokens): a re-attached client gets a request's
# tokens again in messages of this many tokens, and a step's chunks for one client go in messages of at
# most LOGPROB_ITEMS (a token or a top token each, ~100 bytes), far under protocol.MAX_HEADER_BYTES.
RESEND_LOGPROB_TOKENS = 256
# finished requests' log-probabilities kept to replay them (the oldest go first; a replay without
# them still gives the tokens and text)
FINISHED_LOGPROB_TOKENS = 1 << 18
LOGPROB_ITEMS = 4096


def chunk_groups(mine: list[Tokens]) -> list[list[Tokens]]:
    """A client's stream chunks of one step in as few messages as keep each one's logprobs under
    ``LOGPROB_ITEMS`` (one message unless they carry many)."""
    groups: list[list[Tokens]] = [[]]
    items = 0
    for t in mine:
        n = sum(1 + len(e[3]) for e in t.logprobs) if t.logprobs else 0
        n += sum(1 + len(e[3]) for e in t.prompt_logprobs) if t.prompt_logprobs else 0
        if groups[-1] and items + n > LOGPROB_ITEMS:
            groups.append([])
            items = 0
        groups[-1].append(t)
        items += n
    return groups


def submitted(msg: Submit) -> bytes:
    """A digest of what a SUBMIT asks (its prompt, parameters and prediction; not its session, which
    a client of the same key restarted has anew): a retry has the same one, another request under
    the same id another."""
    asked = [msg.prompt, msg.chat, msg.messages, msg.chat_options, msg.prediction, msg.params]
    try:
        text = orjson.dumps(asked, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except TypeError:  # (what JSON cannot hold: its repr, which a retry repeats too)
        text = repr(asked).encode()
    digest = hashlib.blake2b(text, digest_size=16)
    for ids in (msg.prompt_tokens, msg.prediction_tokens):
        digest.update(b"none" if ids is None else ids.tobytes())
    return digest.digest()


class Intake:
    """``Broker``'s handling of client messages and of requests' ends (see the module docstring)."""

    # -- clients ---------------------------------------------------------------------------
    def on_client(self, identity: bytes, frames: list[Any], now: float) -> None:
        try:
            msg = protocol.decode(frames)
            if isinstance(msg, Submit):
                self._submit(identity, msg, now, owner_of(identity, frames[0], msg.session), submitted(msg))
            elif isinstance(msg, Cancel):
                rid = self.by_req_id.get(msg.req_id)
                if rid is None and msg.req_id not in self.prompts.waiting or \
                        self.owners.get(msg.req_id) != owner_of(identity, frames[0], msg.session):
                    raise ProtocolError("unknown_request", f"no active request {msg.req_id!r} of this client")
                if rid is None:  # (its prompt is still being tokenized: dropped when that is done)
                    self.prompts.waiting[msg.req_id].cancelled = True
                else:
                    self._finish(rid, "cancelled")
            elif isinstance(msg, Status):
                self._send(self.clients, identity, State(self.state(now)))
            elif isinstance(msg, Tokenize):  # (a long text on the tokenizer thread, as long prompts)
                self.counters["tokenize_requests"] += 1
                if tokenize_chars(msg) > INLINE_CHARS:
                    self.prompts.answer(lambda: self.admission.answer(msg, unlocked=True), identity, msg.req_id)
                else:
                    self._send(self.clients, identity, self.admission.answer(msg))
            elif msg.KIND in protocol.WORKER_KINDS:
                raise ProtocolError("wrong_address", "this is the broker's client address: workers connect to its "
                                                     f"worker address, {self.endpoints[1]}")
            else:
                raise ProtocolError("unexpected_kind", f"{msg.KIND} is not a client message")
        except ProtocolError as exc:
            self._reject(self.clients, identity, exc.code, exc.message, req_id_of(frames, protocol.MAX_REQ_ID))
        except Exception as exc:  # a bug must cost one message, never the broker
            self._internal(self.clients, identity, exc, req_id_of(frames, protocol.MAX_REQ_ID))

    def _internal(self, sock: zmq.Socket, identity: bytes, exc: Exception, req_id: str | None = None) -> None:
        log.exception("internal error handling a message")
        self._reject(sock, identity, "internal", f"{type(exc).__name__}: {exc}"[:300], req_id)

    def _submit(self, identity: bytes, msg: Submit, now: float, owner: str, digest: bytes) -> None:
        req_id = msg.req_id
        if self.owners.get(req_id, owner) != owner or self.finished.get(req_id, (owner,))[0] != owner:
            self.counters["requests_not_owner"] += 1
            raise ProtocolError("request_id_taken", f"request {req_id!r} belongs to another client")
        if self.digests.get(req_id, digest) != digest:  # (another request under the id of one of its own, not a retry)
            if req_id in self.by_req_id or req_id in self.prompts.waiting:
                raise ProtocolError("request_id_taken", f"request {req_id!r} is running with another prompt or "
                                    "parameters: give each request an id of its own")
            self.finished.pop(req_id, None)  # (a finished one's id: the new request runs, its result is not replayed)
        # (a retry re-attaches, or replays a result, even while draining: only new work is refused)
        if req_id in self.by_req_id:  # a retry: re-attach and resend what was committed so far
            req = self.scheduler.requests[self.by_req_id[req_id]]
            self._release(req.owner)
            req.owner = identity
            self.inflight_by_owner[identity] += 1
            self.counters["requests_reattached"] += 1
            self._prompt_facts(identity, req)
            if req.logprobs is None and req.prompt_logprobs is None:
                self._send(self.clients, identity, Tokens(req_id, req.output, req.text[:req.sent], 0))
                return
            self._resend_logprobs(identity, req_id, req.output, req.text[:req.sent], req.logprobs, req.prompt_logprobs)
            return
        if (waiting := self.prompts.waiting.get(req_id)) is not None:  # a retry while its prompt tokenizes
            self._release(waiting.identity)
            waiting.identity = identity
            self.inflight_by_owner[identity] += 1
            self.counters["requests_reattached"] += 1
            return
        if req_id in self.finished:
            self.counters["requests_replayed"] += 1
            _, done, logprobs = self.finished[req_id]
            if logprobs is not None:  # (its chunks may have been lost: they carried them)
                self._resend_logprobs(identity, req_id, done.token_ids, done.text, *logprobs)
            self._send(self.clients, identity, done)
            return
        if self.draining_since is not None:
            raise ProtocolError("shutting_down", "the broker is shutting down")
        self._remember(req_id, digest)
        if self.opts.max_inflight_per_client is not None and self.inflight_by_owner[identity] >= self.opts.max_inflight_per_client:
            raise ProtocolError("busy", f"this client already has {self.opts.max_inflight_per_client} requests in flight")
        if self.admission.slow(msg):  # (tokenizing.py)
            params = self.admission.params(msg, grammar=False)  # (bad parameters are refused before the work)
            if len(self.scheduler.requests) + len(self.prompts.waiting) >= self.opts.max_pending \
                    and not self._displace(params.priority):
                raise ProtocolError("busy", f"{self.opts.max_pending} requests pending; retry later")
            self.owners[req_id] = owner
            self.inflight_by_owner[identity] += 1
            self.prompts.start(msg, identity, owner, now)
            return
        self.inflight_by_owner[identity] += 1
        self._admit(msg, identity, owner, now, None)

    def _remember(self, req_id: str, digest: bytes) -> None:
        """What a new request asked, under its id (``submitted``); kept for those running or finished,
        the rest dropped now and then."""
        self.digests[req_id] = digest
        if len(self.digests) > 2 * (len(self.by_req_id) + len(self.prompts.waiting) + len(self.finished)) + 1024:
            self.digests = {r: d for r, d in self.digests.items()
                            if r in self.by_req_id or r in self.prompts.waiting or r in self.finished}

    def _reject(self, sock: zmq.Socket, identity: bytes, code: str, message: str, req_id: str | None = None) -> None:
        self.errors[code] += 1
        self._send(sock, identity, Error(code, message, req_id))

    def reap_clients(self, now: float) -> None:
        """End the requests of a client that went away (a send to it failed: its process was killed,
        its socket closed) ``client_gone_s`` ago, that no retry from a new connection has taken over
        since (its library sends them again at once from a new connection, as after a broker
        restart: a retry re-attaches, and its requests' owner is then that connection): nobody would read
        their output, and they held their devices' time until their last token. Each is counted in
        ``requests_abandoned`` and forgotten, so a retry that comes later runs it again."""
        for identity, since in list(self.gone.items()):
            if now - since < self.opts.client_gone_s:
                continue
            del self.gone[identity]
            for req in [r for r in self.scheduler.requests.values() if r.owner == identity]:
                self.counters["requests_abandoned"] += 1
                self._finish(req.rid, "cancelled")
                self.finished.pop(req.req_id, None)
            for waiting in self.prompts.waiting.values():
                if waiting.identity == identity:
                    self.counters["requests_abandoned"] += 1
                    waiting.cancelled = True

    def _resend_logprobs(self, identity: bytes, req_id: str, output: list[int], text: str, logprobs: list | None,
                         prompt_logprobs: list | None) -> None:
        """A request's tokens so far with their log-probabilities (and its prompt's, first), to a
        client that re-attached."""
        self.outbox_logprobs = True
        if prompt_logprobs is not None:
            self._send_prompt_logprobs(identity, req_id, prompt_logprobs, 0)
        for a in range(0, len(output), RESEND_LOGPROB_TOKENS):  # (each message's header stays small)
            self._send(self.clients, identity, Tokens(
                req_id, output[a:a + RESEND_LOGPROB_TOKENS], "" if a else text, a, len(text) if a else 0,
                logprobs[a:a + RESEND_LOGPROB_TOKENS] if logprobs is not None else None))

    def _send_prompt_logprobs(self, identity: bytes, req_id: str, entries: list, at: int) -> None:
        """The prompt's tokens' log-probabilities ``entries``, the first at position ``at``, in
        messages of their own (no tokens: before the first tokens; each header small)."""
        self.outbox_logprobs = True
        for a in range(0, len(entries), RESEND_LOGPROB_TOKENS):
            self._send(self.clients, identity, Tokens(req_id, [], "", 0, 0, None, entries[a:a + RESEND_LOGPROB_TOKENS],
                                                      at + a))

    def _prompt_scored(self, req: Request, item: TaskResult) -> None:
        """The prompt's log-probabilities a verify brings: those not had yet kept, and streamed."""
        lp, ids, rank, at = results.prompt_scores(req, item, self.admission.vocab_size)
        have = len(req.prompt_logprobs)
        scored = self.admission.logprob_entries(req.prompt[at:at + len(lp)], lp, ids)
        new = [[*e, r] for e, r in zip(scored, rank.tolist())][have - at:]  # (vLLM's rank of each prompt token)
        if new:
            req.prompt_logprobs.extend(new)
            sent = 0 if have == 1 else have  # (the first message has the first token's null too)
            self._send_prompt_logprobs(req.owner, req.req_id, req.prompt_logprobs[sent:], sent)

    def _admit(self, msg: Submit, identity: bytes, owner: str, now: float, prompt: list[int] | None) -> None:
        """Make a SUBMIT (counted in flight for its client already) a request of the pool."""
        try:
            req = self.admission.request(self.next_rid, msg, identity, now, prompt)
            if len(self.scheduler.requests) >= self.opts.max_pending and not self._displace(req.params.priority):
                raise ProtocolError("busy", f"{self.opts.max_pending} requests pending; retry later")
        except ProtocolError:
            self._release(identity)
            self.owners.pop(msg.req_id, None)
            raise
        self.next_rid += self.opts.shards  # (a worker's KV and FREEs never confuse two shards' requests)
        self.by_req_id[msg.req_id] = req.rid
        self.owners[msg.req_id] = owner
        self.counters["requests_submitted"] += 1
        self.counters["requests_resumed"] += bool(req.output)  # (a resend after its tokens began: ``Submit.resume_tokens``)
        self.scheduler.admit(req)
        if req.waits_for is not None:  # (it waits for the request computing its prompt's start: prefixes.py)
            self.counters["prefix_waits"] += 1
        self.round_times.admitted(req.rid, time.perf_counter())
        self._prompt_facts(identity, req)

    def _displace(self, priority: int) -> bool:
        """The pool is full: turn its least urgent request not started away for a new one of
        ``priority`` (``displace.py``); False: none is less urgent (the new one is refused)."""
        if (away := displace.displaced_by(self.scheduler, priority)) is None:
            return False
        self.counters["displaced"] += 1
        self._finish(away.rid, "error", ("busy", f"turned away from a full pool ({self.opts.max_pending} requests "
                                                 f"pending) for a more urgent request; retry later"))
        return True

    def _prompt_facts(self, identity: bytes, req: Request) -> None:
        """What a request asked to know of its prompt before its first tokens: its text (echo) and its token count."""
        p = req.params
        if p.echo or p.prompt_count:
            self._send(self.clients, identity, Tokens(req.req_id, [], "", prompt_text=self.admission.prompt_text(req)
                                                      if p.echo else None,
                                                      prompt_tokens=len(req.prompt) if p.prompt_count else None))

    def _tokenized(self) -> None:
        """Admit the long prompts tokenized since the last look (even while draining: they were
        taken before it began), refuse the bad ones, drop the cancelled."""
        for waiting, prompt in self.prompts.ready():
            msg, identity = waiting.msg, waiting.identity
            if waiting.cancelled or isinstance(prompt, ProtocolError):
                self._release(identity)
                self.owners.pop(msg.req_id, None)
                if waiting.cancelled:
                    self.counters["requests_cancelled"] += 1
                else:
                    self._reject(self.clients, identity, prompt.code, prompt.message, msg.req_id)
                continue
            try:
                self._admit(msg, identity, waiting.owner, waiting.submitted, prompt)
            except ProtocolError as exc:
                self._reject(self.clients, identity, exc.code, exc.message, msg.req_id)
        for identity, req_id, answer in self.prompts.answers():
            if isinstance(answer, ProtocolError):
                self._reject(self.clients, identity, answer.code, answer.message, req_id)
            else:
                self._send(self.clients, identity, answer)

    def _release(self, identity: bytes) -> None:
        """One request fewer in flight for this client."""
        self.inflight_by_owner[identity] -= 1
        if self.inflight_by_owner[identity] <= 0:
            del self.inflight_by_owner[identity]

    def _close(self, req: Request, error: tuple[str, str] | None = None) -> None:
        """A request has left the pool: tell its client, let workers drop its KV."""
        self.by_req_id.pop(req.req_id, None)
        owner = self.owners.pop(req.req_id, "")
        queued = self.round_times.closed(req.rid)
        self._release(req.owner)
        self.frees.append(req.rid)
        if error is not None:
            self.counters["requests_failed"] += 1
            if error[0] != "shutting_down" and (more := self.failure_log.admit()) is not None:  # (the drain says those)
                log.warning("request %s (rid %d) failed after %d output tokens: %s: %s%s", req.req_id, req.rid,
                            len(req.output), *error, more)
            self._reject(self.clients, req.owner, error[0], error[1], req.req_id)
            return
        self.counters[f"requests_{req.finish_reason}"] += 1
        stats = {**req.stats(), "queue_s": queued}  # (queue_s: admission to its first task sent)
        if "prediction_tokens" in stats:  # (Predicted Outputs: how much of the predictions the outputs held)
            self.counters["prediction_requests"] += 1
            self.counters["prediction_tokens_accepted"] += stats["prediction_accepted"]
            self.counters["prediction_tokens_rejected"] += stats["prediction_tokens"] - stats["prediction_accepted"]
        done = Done(req.req_id, req.output, self.admission.final_text(req), req.finish_reason, stats)
        scored = req.logprobs is not None or req.prompt_logprobs is not None
        self.finished[req.req_id] = (owner, done, (req.logprobs, req.prompt_logprobs) if scored else None)
        if scored:  # (bounded apart: a token's entries are up to 21 ids and texts)
            n = len(req.logprobs or ()) + len(req.prompt_logprobs or ())
            self.finished_logprobs.append((req.req_id, n))
            self.finished_logprob_tokens += n
            while self.finished_logprob_tokens > FINISHED_LOGPROB_TOKENS:
                old, n = self.finished_logprobs.popleft()
                self.finished_logprob_tokens -= n
                if old in self.finished:
                    self.finished[old] = self.finished[old][:2] + (None,)
        while len(self.finished) > 4096:  # bounded: old results age out
            self.finished.popitem(last=False)
        self._send(self.clients, req.owner, done)

