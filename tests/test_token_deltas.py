"""A task carries only the tokens its worker lacks (``broker/known.py``, ``workers/token_book.py``).

- the broker sends each worker the tokens after those it sent it before, with their CRC-32;
- a worker's book rebuilds the whole sequence, and refuses a base it lacks or holds other
  tokens of (``tokens_missing``);
- a real broker answers ``tokens_missing`` by sending that task again whole, and the request
  goes on (a stand-in worker on a real socket, rebuilding every task with a real book);
- a real worker answers a task whose base it lacks with ``tokens_missing``, counted as no error;
- real deployments stay lossless with deltas and with ``full_tokens``, and deltas send a
  fraction of the tokens.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import zmq

from nebula_flow import policy_log, protocol
from nebula_flow.bench_broker import answer
from nebula_flow.client import Client, build_submit
from nebula_flow.deploy import Deployment, free_port
from nebula_flow.options import WorkerOptions
from nebula_flow.params import SamplingParams
from nebula_flow.protocol import (
    TOKENS_MISSING,
    Done,
    Error,
    Holder,
    ProtocolError,
    Pull,
    Register,
    Result,
    TaskResult,
    Tasks,
    TaskSpec,
    Welcome,
)
from nebula_flow.request import Request
from nebula_flow_broker.known import MAX_RESENDS, tokens_for
from nebula_flow_workers.token_book import TokenBook
from nebula_flow_workers.worker import Worker
from tests.conftest import deploy_config, hf_greedy
from tests.test_emulated import PROFILE
from tests.test_idle_result import stand_ins


def _request(prompt: list[int], rid: int = 1) -> Request:
    return Request(rid, f"r{rid}", list(prompt), SamplingParams(max_new_tokens=64), seed=rid)


def _spec(rid: int, sent: tuple[np.ndarray, int, int]) -> TaskSpec:
    """A draft task carrying ``sent`` (what ``tokens_for`` gives), through the wire and back."""
    tokens, base, crc = sent
    spec = TaskSpec(rid, "draft", 1, 1, tokens, 2, SamplingParams().to_wire(), rid, Holder(), base=base, base_crc=crc)
    return protocol.decode(protocol.encode(Tasks([spec]))).tasks[0]


def test_the_broker_sends_each_worker_the_tokens_after_those_it_sent_it() -> None:
    req = _request([5, 6, 7, 8, 9])
    first = tokens_for(req, 1)
    assert first[0].tolist() == [5, 6, 7, 8, 9] and first[1:] == (0, 0)
    req.output += [10, 11]
    rest, base, crc = tokens_for(req, 1)
    assert rest.tolist() == [10, 11] and base == 5 and crc == zlib.crc32(np.array([5, 6, 7, 8, 9], np.int32))
    assert tokens_for(req, 1)[0].tolist() == [] and tokens_for(req, 1)[1] == 7  # (nothing new: nothing sent)
    assert tokens_for(req, 2)[0].tolist() == [5, 6, 7, 8, 9, 10, 11]  # (another worker: all of them)
    req.output.append(12)
    assert tokens_for(req, 2, full=True)[1] == 0 and req.known[2][0] == 7  # (full_tokens: every task whole)
    assert tokens_for(req, 2)[0].tolist() == [12] and req.known[2] == (8, zlib.crc32(req.tokens))


def test_a_book_rebuilds_the_sequence_and_refuses_a_base_it_lacks() -> None:
    req, book = _request(list(range(10, 30))), TokenBook()
    assert book.tokens(_spec(1, tokens_for(req, 1))).tolist() == list(range(10, 30))
    for step in range(3):
        req.output += [100 + step, 200 + step]
        whole = book.tokens(_spec(1, tokens_for(req, 1)))
        assert whole.tolist() == req.tokens.tolist() and whole.dtype == np.int64 and not whole.flags.writeable
    # a base shorter than what the book holds (a task sent before a later one was lost): its prefix
    req.known[1] = (21, zlib.crc32(req.tokens[:21]))
    assert book.tokens(_spec(1, tokens_for(req, 1))).tolist() == req.tokens.tolist()

    def refused(spec: TaskSpec) -> str:
        with pytest.raises(ProtocolError) as exc:
            book.tokens(spec)
        return exc.value.code

    stranger = _request([1, 2, 3], rid=2)
    stranger.known[1] = (3, zlib.crc32(np.array([1, 2, 3], np.int32)))
    assert refused(_spec(2, tokens_for(stranger, 1))) == TOKENS_MISSING  # never sent here
    req.output.append(7)
    rest, base, crc = tokens_for(req, 1)
    assert refused(_spec(1, (rest, base, crc ^ 1))) == TOKENS_MISSING  # other tokens than the broker's
    assert refused(_spec(1, (rest[1:], base + 1, crc))) == TOKENS_MISSING  # more than it holds
    book.forget([1])
    assert refused(_spec(1, (rest, base, crc))) == TOKENS_MISSING and book.held == 0
    assert book.missing == 4


def test_a_bounded_book_drops_the_least_recently_sent_request() -> None:
    book = TokenBook(max_tokens=25)
    reqs = [_request(list(range(10, 20)), rid) for rid in (1, 2, 3)]
    sent = [tokens_for(r, 1) for r in reqs]
    for r, s in zip(reqs, sent):
        book.tokens(_spec(r.rid, s))
    assert list(book.entries) == [2, 3] and book.held == 20  # (the first went: 30 tokens > 25)
    reqs[0].output.append(5)
    with pytest.raises(ProtocolError):
        book.tokens(_spec(1, tokens_for(reqs[0], 1)))


@pytest.mark.parametrize("broken", [False, True])
def test_a_worker_lacking_the_tokens_gets_the_task_again_whole(tiny_pair: Path, tmp_path: Path, broken: bool) -> None:
    """A real broker on real sockets; stand-in workers rebuild every task with a real book and
    check it against the request's committed tokens. The draft worker forgets the request once:
    the task it cannot rebuild comes again whole, and the request ends as if nothing happened (the
    policy log replays it). A ``broken`` draft worker says it lacks the tokens of every task, even
    whole ones: the request fails with a clear error after ``MAX_RESENDS``, no endless loop."""
    books, prompt, n = {"draft": TokenBook(), "target": TokenBook()}, [5, 6, 7, 8, 9, 10], 20
    with stand_ins(tiny_pair, policy_log=str(tmp_path / "policy.jsonl")) as (broker, socks):
        client = socks["client"]
        client.send_multipart(protocol.encode(build_submit("r", None, prompt, False, max_new_tokens=n, ignore_eos=True)))
        committed, bases, resent, forgot, end = list(prompt), [], [], False, None
        deadline = time.monotonic() + 30
        while not isinstance(end, Done | Error):
            assert time.monotonic() < deadline, "the request did not end"
            end = protocol.decode(client.recv_multipart(copy=False)) if client.poll(0) else None
            for role in ("draft", "target"):
                sock = socks[role]
                if not sock.poll(0):
                    now = time.monotonic()
                    broker.receive([broker.peers, broker.clients], now)
                    broker.step(now)
                    continue
                msg = protocol.decode(sock.recv_multipart(copy=False))
                if not isinstance(msg, Tasks):
                    continue
                outs = []
                for t in msg.tasks:
                    bases.append(t.base)
                    if role == "draft" and (t.base and not forgot or broken):  # (evicted, say)
                        books[role].forget([t.rid])
                        forgot = True
                        t.base = max(t.base, 1)  # (broken: a whole task too)
                    try:
                        whole = books[role].tokens(t)
                    except ProtocolError as exc:
                        resent.append(t.round)
                        outs.append(TaskResult(t.rid, t.kind, t.round, t.attempt, error=f"{exc.code}: {exc.message}"))
                        continue
                    assert whole.tolist() == committed, (role, t.round)
                    out = answer(t)
                    committed += out.committed or []
                    outs.append(out)
                sock.send_multipart(protocol.encode(Result(outs)))
                sock.send_multipart(protocol.encode(Pull(4, True)))
        if broken:
            assert isinstance(end, Error) and "tokens_missing" in end.message, end
            assert len(resent) == broker.counters["tokens_resent"] == MAX_RESENDS + 1
            return
        assert isinstance(end, Done) and end.finish_reason == "length"
        assert len(resent) == 1 and broker.counters["tokens_resent"] == 1
        assert not broker.errors and "worker_error" not in str(broker.counters)
        assert bases.count(0) == 3  # (each worker's first task, and the one sent again)
        assert len(committed) >= len(prompt) + n
        records = broker.scheduler.records
        assert [r[0] for r in records].count("retry") == 1
        assert policy_log.replay(records, policy_log.policy_of(records)).identical


def test_a_real_worker_answers_a_base_it_lacks_with_tokens_missing(tmp_path: Path) -> None:
    """A real ``Worker`` (emulated device) against a stand-in broker on a real socket."""
    profile = tmp_path / "target.json"
    profile.write_text(json.dumps(PROFILE))
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    worker = Worker(WorkerOptions("target", f"tcp://127.0.0.1:{port}", device="emulated", profile=str(profile),
                                  kv_transport="none", heartbeat_s=5.0))
    req = _request(list(range(5, 25)))
    sent = [tokens_for(req, 1)]
    req.output += [40, 41]
    sent.append(tokens_for(req, 1))
    stranger = _request([1, 2, 3, 4], rid=2)
    stranger.known[1] = (4, zlib.crc32(np.array([1, 2, 3, 4], np.int32)))
    sent.append(tokens_for(stranger, 1))
    results: list[TaskResult] = []

    def stand_in() -> None:
        try:
            pulls, parked = 0, False  # (a PULL sent while computing waits; the batch's idle RESULT wakes it)
            while len(results) < 3:
                assert router.poll(30_000), "the worker went silent"
                identity, *frames = router.recv_multipart(copy=False)
                msg = protocol.decode(frames)
                if isinstance(msg, Register):
                    router.send_multipart([identity, *protocol.encode(Welcome(1, 0, "pooled", {"heartbeat_s": 5.0}))])
                    continue
                if isinstance(msg, Result):
                    results.extend(msg.results)
                if isinstance(msg, Pull):
                    parked = msg.credits > 0
                if parked and isinstance(msg, (Pull, Result)) and msg.idle and pulls < 3:
                    rid, (tokens, base, crc) = (1, 1, 2)[pulls], sent[pulls]
                    spec = TaskSpec(rid, "verify", pulls + 1, 1, tokens, 0, SamplingParams(max_new_tokens=8).to_wire(),
                                    rid, Holder(), base=base, base_crc=crc)
                    router.send_multipart([identity, *protocol.encode(Tasks([spec]))])
                    pulls, parked = pulls + 1, False
        finally:
            worker._stop()

    thread = threading.Thread(target=stand_in)
    thread.start()
    try:
        assert worker.run() == 0
    finally:
        thread.join(timeout=30)
        router.close(linger=0)
    assert [bool(r.committed) for r in results] == [True, True, False]
    assert results[2].error.startswith(f"{TOKENS_MISSING}:") and worker.errors == 0
    assert worker.book.entries[1][0].tolist() == req.tokens.tolist()


@pytest.mark.parametrize("full_tokens", [False, True])
def test_deployments_stay_lossless_and_deltas_send_a_fraction_of_the_tokens(tiny_pair: Path, full_tokens: bool) -> None:
    """Real worker processes, two a role, a new worker every round (``migrate``): each task's base is
    what that worker was sent rounds ago."""
    cfg = deploy_config(tiny_pair, "pooled", 2, 2)
    cfg.broker.policy = cfg.broker.policy.replace(migrate=True)
    cfg.broker.full_tokens = full_tokens
    prompts = [[5, 6, 7, 8] * 30, [9, 10, 11] * 20]
    with Deployment(cfg) as dep, Client(dep.address) as client:
        outs = [client.generate(token_ids=p, max_new_tokens=24) for p in prompts]
        counters = client.status()["counters"]
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_pair / "target", p, 24) for p in prompts]
    sent, covered = counters["task_tokens"], counters["task_positions"]
    assert counters.get("tokens_resent", 0) == 0
    assert sent == covered if full_tokens else sent < covered / 4, (sent, covered)
