"""The service as a user meets it: client library, errors, malformed input, CLI commands."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import orjson
import pytest
import zmq
from click.testing import CliRunner

from nebula_flow import protocol
from nebula_flow.cli import main
from nebula_flow.client import AsyncClient, Chunk, Client, Completion, RequestError, RequestTimeout
from nebula_flow.deploy import Deployment, DeploymentError, free_port
from nebula_flow.policy import PolicyConfig
from nebula_flow.protocol import (
    Done,
    Error,
    Heartbeat,
    Holder,
    Pull,
    Register,
    Rejected,
    Result,
    Submit,
    TaskResult,
    Tasks,
    TaskSpec,
    Tokens,
    Welcome,
)
from tests.conftest import SAMPLE_TRACE, deploy_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tiny_pair):  # noqa: ANN001, ANN201
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.broker.metrics_port = 0
    with Deployment(cfg) as dep:
        yield dep


def raw_socket(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(address)
    return sock


@pytest.mark.parametrize("max_new_tokens", [20, 10])
def test_stream_chunks_add_up_to_the_completion(live, max_new_tokens) -> None:  # noqa: ANN001
    """(The tiny pair's 10th token here leaves a character partial: the stream holds it back until
    the end, then gives it out as the final decode does, U+FFFD, in a chunk of text alone.)"""
    with Client(live.address) as c:
        items = list(c.stream("def add(a, b):", max_new_tokens=max_new_tokens))
    chunks, final = items[:-1], items[-1]
    assert all(isinstance(x, Chunk) for x in chunks) and isinstance(final, Completion)
    assert [t for ch in chunks for t in ch.token_ids] == final.token_ids
    assert "".join(ch.text for ch in chunks) == final.text
    assert len(final.token_ids) == max_new_tokens and final.finish_reason == "length"
    rounds = [ch for ch in chunks if ch.token_ids]
    assert final.rounds == len(rounds) == len(final.tokens_per_round) and len(chunks) - len(rounds) <= 1
    assert 0 < final.ttft_s <= final.latency_s
    if max_new_tokens == 10:
        assert final.text.endswith("\ufffd") and chunks[-1].text == "\ufffd" and not chunks[-1].token_ids


def test_stop_string_cuts_the_text(live) -> None:  # noqa: ANN001
    with Client(live.address) as c:
        full = c.generate("import os\n", max_new_tokens=30)
        stop = full.text[5:8]
        assert stop and stop not in full.text[:5]
        cut = c.generate("import os\n", max_new_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    # streamed, the pieces add up to the text cut before the stop string, wherever the rounds split it
    # (a tail that may begin one is held back until the next round shows whether it does)
    for at in range(6, min(len(full.text) - 3, 30), 3):
        stop = full.text[at:at + 3]
        if stop.strip() and stop not in full.text[:at]:
            with Client(live.address) as c:
                items = list(c.stream("import os\n", max_new_tokens=30, stop=[stop]))
            assert "".join(i.text for i in items[:-1]) == items[-1].text == full.text[:at], stop


def test_chat_template_is_applied(live) -> None:  # noqa: ANN001
    with Client(live.address) as c:
        plain = c.generate("hello", max_new_tokens=4)
        chat = c.generate("hello", max_new_tokens=4, chat=True)
    assert chat.stats["prompt_tokens"] > plain.stats["prompt_tokens"]


@pytest.mark.parametrize("kwargs, code", [
    ({"prompt": "x", "max_new_tokens": 2000}, "too_long"),
    ({"token_ids": [1, 99999]}, "invalid_prompt"),
    ({"token_ids": []}, "invalid_prompt"),
])
def test_bad_requests_get_clear_errors(live, kwargs: dict, code: str) -> None:  # noqa: ANN001
    with Client(live.address) as c:
        with pytest.raises(RequestError) as err:
            c.generate(**kwargs)
        assert err.value.code == code
        assert c.generate("still fine", max_new_tokens=3).token_ids  # and the service goes on


def test_rules_that_leave_no_token_fail_their_request_alone(live) -> None:  # noqa: ANN001
    """allowed_token_ids whose one id a bad word bars ("ith" is the tiny pair's token 445): no token
    is left for the first output token. Greedy used to take id 0 against every rule, sampling to
    draw from NaN; the request now fails with an error that says why, and a request sent beside it
    is unharmed. (Rules that leave nothing plainly, as only EOS allowed under min_tokens, the broker
    refuses before they run.)"""
    allowed = list(range(40, 90))

    async def side_by_side(extra: dict) -> list:
        async with AsyncClient(live.address) as ac:
            return await asyncio.gather(
                ac.generate(token_ids=[5, 6, 7], max_new_tokens=5, allowed_token_ids=[445], bad_words=["ith"], **extra),
                ac.generate(token_ids=[5, 6, 7], max_new_tokens=5, allowed_token_ids=allowed, **extra),
                return_exceptions=True)

    for extra in ({}, {"temperature": 0.9, "seed": 1}):
        doomed, fine = asyncio.run(side_by_side(extra))
        assert isinstance(doomed, RequestError) and "no token is allowed at output token 1" in str(doomed), doomed
        assert len(fine.token_ids) == 5 and set(fine.token_ids) <= set(allowed)


def test_a_subnormal_temperature_gets_a_clear_error_and_harms_no_other_request(live) -> None:  # noqa: ANN001
    """5e-324 passed validation once and turned the target's distribution into NaN, failing the
    whole batch; now the broker refuses it, whatever client sent it."""
    sock = raw_socket(live.address)
    with Client(live.address) as c:
        stream = c.stream("def add(a, b):", max_new_tokens=12, ignore_eos=True)
        first = next(stream)  # another request in flight
        sock.send_multipart(protocol.encode(Submit("tiny-t", {"max_new_tokens": 4, "temperature": 5e-324},
                                                   prompt="x")))
        reply = protocol.decode(sock.recv_multipart())
        assert isinstance(reply, Error) and reply.code == "invalid_params" and "at least" in reply.message
        rest = list(stream)
        assert isinstance(rest[-1], Completion) and len(first.token_ids) + sum(len(x.token_ids) for x in rest[:-1]) == 12
    sock.close()


def test_client_validates_parameters_before_sending(live) -> None:  # noqa: ANN001
    with Client(live.address) as c, pytest.raises(ValueError, match="temperature"):
        c.generate("x", temperature=float("nan"))


def test_timeout_when_no_broker_answers() -> None:
    with Client(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3) as c, pytest.raises(RequestTimeout):
        c.generate("x")


def test_cancel_frees_the_request(live) -> None:  # noqa: ANN001
    with Client(live.address) as c:
        before = c.status()["counters"].get("requests_cancelled", 0)
        stream = c.stream("a long one", max_new_tokens=800, ignore_eos=True)
        next(stream)
        stream.close()  # abandoning a stream cancels the request
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = c.status()
            if st["pool"] == 0 and st["counters"].get("requests_cancelled", 0) == before + 1:
                break
            time.sleep(0.1)
        assert st["pool"] == 0 and st["counters"]["requests_cancelled"] == before + 1
        assert len(c.generate("after cancel", max_new_tokens=5).token_ids) >= 1


GARBAGE = [
    [b"x"], [b"SUBMIT", b"{"], [b"SUBMIT", b"[]"], [b"SUBMIT", orjson.dumps({"v": 2})],
    [b"NOPE", orjson.dumps({"v": protocol.VERSION})], [b"SUBMIT", orjson.dumps({"v": protocol.VERSION, "req_id": "a", "params": {}})],
    [b"SUBMIT", orjson.dumps({"v": protocol.VERSION, "req_id": "b", "params": {"max_new_tokens": -4}, "prompt": "x"})],
    [b"SUBMIT", orjson.dumps({"v": protocol.VERSION, "req_id": "c", "params": {}, "prompt_tokens": {"f": 0, "dtype": "int32", "shape": [9]}}), b"abc"],
    [b"CANCEL", orjson.dumps({"v": protocol.VERSION, "req_id": "never"})],
    [b"PULL", orjson.dumps({"v": protocol.VERSION, "credits": 1, "idle": True})],
]


def test_malformed_client_messages_are_answered_and_counted(live) -> None:  # noqa: ANN001
    sock = raw_socket(live.address)
    with Client(live.address) as c:
        before = sum(c.status()["errors"].values())
        for frames in GARBAGE:
            sock.send_multipart(frames)
            reply = protocol.decode(sock.recv_multipart())
            assert isinstance(reply, Error) and reply.code
        after = c.status()["errors"]
        assert sum(after.values()) - before >= len(GARBAGE)
        assert c.generate("still serving", max_new_tokens=5).token_ids
    sock.close()


def test_malformed_worker_messages_are_answered_and_counted(live) -> None:  # noqa: ANN001
    sock = raw_socket(live.cfg.broker.worker_address)
    bad = [[b"RESULT", orjson.dumps({"v": protocol.VERSION, "results": [], "busy_s": 0})],  # not registered
           [b"REGISTER", orjson.dumps({"v": protocol.VERSION, "role": "wizard", "name": "x", "capacity": 1, "model": {}})],
           [b"REGISTER", orjson.dumps({"v": protocol.VERSION, "role": "draft", "name": "x", "capacity": 0, "model": {}})],
           [b"REGISTER", orjson.dumps({"v": protocol.VERSION, "role": "draft", "name": "x", "capacity": 1, "model": {},
                                       "kv_endpoint": "shm:///dev/shm/x;http://127.0.0.1:1"})],
           [b"garbage"], [b"PULL", b"\xff\xfe"]]
    for frames in bad:
        sock.send_multipart(frames)
        reply = protocol.decode(sock.recv_multipart())
        assert isinstance(reply, Error)
    sock.close()
    with Client(live.address) as c:
        errors = c.status()["errors"]
        assert errors.get("unknown_worker", 0) >= 1 and errors.get("wrong_role", 0) >= 1
        assert errors.get("invalid_params", 0) >= 1
        assert c.generate("still serving", max_new_tokens=5).token_ids


def test_a_real_worker_survives_malformed_messages(tiny_pair) -> None:  # noqa: ANN001
    """A fake broker feeds a real worker process garbage, then a valid task it must run."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, 60_000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "worker", "--role", "target",
                             "--model", str(tiny_pair / "target"), "--broker", f"tcp://127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def recv_kind(kind: type) -> tuple[bytes, protocol.Msg]:
            while True:
                ident, *frames = router.recv_multipart()
                msg = protocol.decode(frames)
                if isinstance(msg, kind):
                    return ident, msg

        def send(*tasks: TaskSpec) -> None:
            router.send_multipart([ident, *protocol.encode(Tasks(list(tasks)))])

        def task(rid: int = 7, tokens: tuple[int, ...] = (1, 2, 3), **extra: object) -> TaskSpec:
            return TaskSpec(rid, "verify", 1, 1, np.array(tokens, np.int32), extra.pop("k", 0), {"max_new_tokens": 4},
                            1, Holder(0, 0), **extra)

        def result() -> TaskResult:
            _, msg = recv_kind(Result)
            return msg.results[0]

        ident, _ = recv_kind(Register)
        # The broker's interval (0.25 s here, 1 s the worker's own default) sets the worker's pace.
        router.send_multipart([ident, *protocol.encode(Welcome(1, 0, "pooled", {"heartbeat_s": 0.25}))])
        recv_kind(Pull)
        head = {"rid": 7, "kind": "verify", "round": 1, "attempt": 1, "k": 0, "params": {"max_new_tokens": 4},
                "seed": 1, "holder": {"worker": 0, "valid": 0}}
        garbage = [[b"junk"], [b"TASKS", b"{"], [b"TASKS", orjson.dumps({"v": protocol.VERSION, "tasks": [{"rid": 1}]})],
                   [b"TASKS", orjson.dumps({"v": protocol.VERSION, "tasks": [dict(head, tokens={"f": 0, "dtype": "int32", "shape": [50]})]}), b"short"]]
        for frames in garbage:
            router.send_multipart([ident, *frames])
        errors = 0
        while errors < 3:  # three are answered with ERROR, the last with an error result for rid 7
            recv_kind(Error)
            errors += 1
        failed = result()
        assert failed.rid == 7 and failed.error
        send(task())
        done = result()
        assert done.rid == 7 and done.error is None and len(done.committed) == 1
        # Token-tree alternatives: refused beyond the limit, without a draft, or repeating the first
        # draft token; accepted on a greedy verify with a draft.
        for rid, extra in ((8, {"alts": protocol.MAX_ALTERNATIVES + 1}), (9, {"runner_ups": [4]}),
                           (10, {"draft": [5], "runner_ups": [5]})):
            send(task(rid, **extra))
            failed = result()
            assert failed.rid == rid and "runner_ups" in failed.error
        send(task(11, k=2, draft=[5, 6], runner_ups=[9, 10]))
        done = result()
        assert done.rid == 11 and 1 <= len(done.committed) <= 3
        # Fused chains: refused empty, too many or out of the vocabulary; a greedy verify with one
        # commits a path of its tree, and one without a draft looks a chain up itself.
        for rid, extra in ((14, {"draft": [5], "chains": [[]]}), (15, {"draft": [5], "chains": [[4]] * 5}),
                           (16, {"draft": [5], "chains": [[1 << 20]]}), (17, {"fuse": 99})):
            send(task(rid, **extra))
            failed = result()
            assert failed.rid == rid and ("chains" in failed.error or "fuse" in failed.error), failed.error
        send(task(18, k=2, draft=[5, 6], chains=[[5, 9, 9, 9]]))
        done = result()
        assert done.rid == 18 and 1 <= len(done.committed) <= 5
        assert done.committed[:-1] in ([5, 6][:len(done.committed) - 1], [5, 9, 9, 9][:len(done.committed) - 1])
        send(task(19, (2, 3, 4, 5, 6, 2, 3), fuse=3))  # no draft: the worker looks up 2, 3 -> 4, 5, 6 itself
        done = result()
        assert done.rid == 19 and done.chains == [[4, 5, 6]]
        assert 1 <= len(done.committed) <= 4 and done.committed[:-1] == [4, 5, 6][:len(done.committed) - 1]
        # Idle now (its PULL unanswered), the worker beats at the broker's pace, never a whole
        # extra interval late: 2 s of silence from it hold about 8 beats.
        recv_kind(Heartbeat)
        beats = [time.monotonic()]
        while beats[-1] - beats[0] < 2.0:
            recv_kind(Heartbeat)
            beats.append(time.monotonic())
        gaps = np.diff(beats)
        assert 0.2 < float(np.median(gaps)) < 0.35 and gaps.max() < 1.0, gaps
    finally:
        proc.terminate()
        proc.wait(10)
        router.close()


def test_the_broker_checks_the_alternatives_a_draft_brings() -> None:
    from nebula_flow.params import SamplingParams
    from nebula_flow.request import Request
    from nebula_flow_broker.results import alternatives

    greedy = Request(1, "a", [1, 2], SamplingParams(), seed=1, k=3, alts=2)  # (what the policy asked for)
    assert alternatives(greedy, [4, 5], [3, 6, 7]) == [4, 5]
    assert alternatives(greedy, [], [3, 6, 7]) == []
    for bad in ([4, 4], [3], [4, 5, 6]):  # repeated, the first draft token, too many
        with pytest.raises(protocol.ProtocolError):
            alternatives(greedy, bad, [3, 6, 7])
    # not token ids: refused when the result is decoded (that item alone: the rest of a RESULT counts)
    [item] = protocol.decode(protocol.encode(Result([TaskResult(1, "draft", 1, 1, draft=[3], runner_ups=["x"])]))).results
    assert isinstance(item, Rejected) and item.error.code == "malformed" and item.head["rid"] == 1
    sampled = Request(2, "b", [1, 2], SamplingParams(temperature=1.0), seed=1, k=3, alts=1)
    assert alternatives(sampled, [4], [3, 6, 7]) == [4]  # (runner-ups to the token drawn)
    with pytest.raises(protocol.ProtocolError):  # more than the policy asked for
        alternatives(sampled, [4, 5], [3, 6, 7])


def test_the_broker_takes_workers_forward_times_and_counts_malformed_ones() -> None:
    from nebula_flow_broker.server import Broker, BrokerOptions

    broker = Broker(BrokerOptions(policy=PolicyConfig(adaptive_k=True), client_port=free_port(), worker_port=free_port()))
    broker.bind()  # (real sockets; nobody is at the other end, so its replies go nowhere)
    for ident, role in ((b"d", "draft"), (b"t", "target")):
        broker.on_worker(ident, protocol.encode(Register(role, role, 4, {})), 0.0)
    draft, target = broker.by_identity[b"d"], broker.by_identity[b"t"]

    def result(wid: int, step_costs: object) -> None:
        ident = {draft: b"d", target: b"t"}[wid]
        broker.on_worker(ident, protocol.encode(Result([], 0.5, device={"step_costs": step_costs})), 1.0)

    for wid, bad in ((target, [0.05]), (target, {"target": "fast"}), (target, {"target": []}),
                     (target, {"target": [0.05, -1.0]}), (target, {"target": [True]}), (target, {"target": [1e9]}),
                     (target, {"target": [0.05] * 17}), (draft, {"target": [0.05]})):  # (a draft's own model only)
        result(wid, bad)
    assert broker.errors["malformed"] == 8 and broker.scheduler.costs == (0.073, 0.03, 1.1)
    assert broker.workers[target].busy_s == 3.5 and broker.workers[draft].busy_s == 0.5  # the results still counted
    result(target, {"target": [None, 0.05, 0.052]})
    result(draft, {"draft": [0.0025]})
    costs = broker.state(2.0)["spec_costs"]
    assert costs[0] == pytest.approx(0.0025 / 0.048) and broker.state(2.0)["verify_costs"][1] == pytest.approx(0.05 / 0.048)
    broker.clients.close()
    broker.peers.close()


def test_cli_generate_says_at_once_when_no_broker_answers() -> None:
    """`generate` to an address where no broker runs says so once the connection has had its
    time, instead of waiting out the request's timeout (300 s by default) in silence."""
    address = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    res = CliRunner().invoke(main, ["generate", "--broker", address, "--timeout-s", "2", "hi"])
    assert res.exit_code == 1 and time.monotonic() - started < 30, res.output
    assert res.output.strip() == (f"Error: cannot reach {address} within 2 s (no broker there, or it refused this "
                                  "client's keys)"), res.output


def test_cli_generate_json_and_status(live) -> None:  # noqa: ANN001
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "--broker", live.address, "--json", "--max-new-tokens", "8", "def f():"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert {"text", "token_ids", "rounds", "tokens_per_round", "ttft_s", "latency_s"} <= set(out)
    assert len(out["token_ids"]) == 8 and out["rounds"] == len(out["tokens_per_round"])
    res = runner.invoke(main, ["status", "--broker", live.address])
    assert res.exit_code == 0 and "draft" in res.output and "target" in res.output
    with Client(live.address) as c:  # every worker says what it serves from its registration on
        workers = c.status()["workers"]
    assert all(w["model"]["device"] == "cpu" and w["model"]["vocab_size"] > 0 for w in workers)
    assert res.output.count(" on cpu ") == len(workers)  # (and the target's numerics: the broker checks them)
    assert res.output.count(" on cpu (float32) ") + res.output.count(" on cpu (bfloat16 batch-invariant) ") == 1
    # the workers' forward times came back with their results: the costs adaptive k would weigh
    assert "speculation costs in target decode steps: draft step" in res.output
    assert "verify blocks by rows: not measured yet" not in res.output
    res = runner.invoke(main, ["generate", "--broker", live.address, "--temperature", "-1", "x"])
    assert res.exit_code != 0 and "temperature" in res.output
    # the prompt's logprobs: every prompt token's after the first, in --json and as lines
    with Client(live.address) as c:
        prompt = c.generate("def f():", max_new_tokens=1, prompt_logprobs=2).prompt_logprobs
    res = runner.invoke(main, ["generate", "--broker", live.address, "--json", "--max-new-tokens", "2",
                               "--prompt-logprobs", "2", "def f():"])
    assert res.exit_code == 0 and json.loads(res.output)["prompt_logprobs"] == prompt and len(prompt) > 2
    res = runner.invoke(main, ["generate", "--broker", live.address, "--max-new-tokens", "2", "--prompt-logprobs", "1",
                               "--logprobs", "0", "def f():"])
    lines = res.output.splitlines()
    assert res.exit_code == 0 and lines.index("[prompt logprobs]") + len(prompt) == lines.index("[output logprobs]")
    # vLLM's output rules from the command line: each option reaches the request as the library's keyword does
    rules = {"min_p": 0.05, "include_stop_str_in_output": True, "skip_special_tokens": False, "bad_words": ("def",),
             "allowed_token_ids": tuple(range(100, 200)), "truncate_prompt_tokens": 3}
    with Client(live.address) as c:
        want = c.generate("import os\ndef f():", max_new_tokens=6, temperature=0.9, seed=3, **rules)
    res = runner.invoke(main, ["generate", "--broker", live.address, "--json", "--max-new-tokens", "6", "--temperature",
                               "0.9", "--seed", "3", "--min-p", "0.05", "--include-stop-str-in-output",
                               "--keep-special-tokens", "--bad-word", "def", "--truncate-prompt-tokens", "3",
                               *[f"--allowed-token-id={t}" for t in range(100, 200)], "import os\ndef f():"])
    got = json.loads(res.output)
    assert res.exit_code == 0 and got["token_ids"] == want.token_ids and set(got["token_ids"]) <= set(range(100, 200))
    assert got["stats"]["prompt_tokens"] == 3


def free_port_pair() -> int:
    """A port P with P + 1 free too, both checked by binding them (a lone free port's neighbour may
    be any process's ephemeral port)."""
    import socket

    while True:
        port = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def test_serve_starts_prints_the_address_and_stops_cleanly(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'mode = "pooled"\n[draft]\nmodel = "{tiny_pair / "draft"}"\n[target]\nmodel = "{tiny_pair / "target"}"\n')
    port = free_port_pair()  # (--port P binds P and P + 1)
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "serve", "--config", str(cfg), "--port",
                                 str(port)], stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ))
    try:
        address = proc.stdout.readline().strip()
        assert address == f"tcp://127.0.0.1:{port}", log.read_text()[-2000:]
        with Client(address) as c:
            assert len(c.generate("hi", max_new_tokens=6).token_ids) >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_rejects_a_bad_config(tmp_path) -> None:  # noqa: ANN001
    cfg = tmp_path / "bad.toml"
    cfg.write_text('mode = "warp"\n[target]\nmodel = "x"\n')
    res = CliRunner().invoke(main, ["serve", "--config", str(cfg)])
    assert res.exit_code != 0 and "mode must be one of" in res.output
    # A liveness under two heartbeats would declare healthy workers dead; an emulated pool needs its profile.
    pair = '[draft]\nmodel = "d"\n[target]\nmodel = "t"\n'
    for text, message in (('[broker]\nheartbeat_s = 1.0\nliveness_s = 1.5\n' + pair, "at least twice heartbeat_s"),
                          ('[broker]\nheartbeat_s = 0\n' + pair, "heartbeat_s must be > 0"),
                          ('[draft]\nmodel = "d"\ndevice = "emulated"\n[target]\nmodel = "t"\n', "needs a profile"),
                          ('[draft]\nmodel = "d"\n[target]\nmodel = "t"\nkv_pool_gb = -1\n', "kv_pool_gb >= 0"),
                          ('[draft]\nmodel = "d"\nmax_kv_gb = 0\n[target]\nmodel = "t"\n', "max_kv_gb must be > 0")):
        cfg.write_text(text)
        res = CliRunner().invoke(main, ["serve", "--config", str(cfg)])
        assert res.exit_code != 0 and message in res.output, res.output
    res = CliRunner().invoke(main, ["broker", "--heartbeat-s", "1", "--liveness-s", "1"])
    assert res.exit_code != 0 and "at least twice heartbeat_s" in res.output, res.output
    res = CliRunner().invoke(main, ["worker", "--role", "target", "--model", str(tmp_path), "--kv-pool-gb", "-0.5"])
    assert res.exit_code != 0 and "--kv-pool-gb >= 0" in res.output, res.output
    res = CliRunner().invoke(main, ["worker", "--role", "target", "--model", str(tmp_path), "--draft-max-batch", "32"])
    assert res.exit_code != 0 and "--draft-max-batch is for role any" in res.output, res.output
    cfg.write_text('mode = "elastic"\n[draft]\nmodel = "d"\nelastic = "no"\n[target]\nmodel = "t"\n')
    res = CliRunner().invoke(main, ["serve", "--config", str(cfg)])
    assert res.exit_code != 0 and "elastic must be true or false" in res.output, res.output


def test_run_serving_the_http_api_names_its_broker_for_the_other_commands(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """`run --http-port` (what `make run` does) serves on after its demo, its broker on a port of its
    own choosing: it prints the broker's client address, and `nebula-flow status` reaches the
    deployment there (at the default address it found nothing); Ctrl-C stops it cleanly."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'mode = "pooled"\n[draft]\nmodel = "{tiny_pair / "draft"}"\n'
                   f'[target]\nmodel = "{tiny_pair / "target"}"\n')
    err = tmp_path / "run.err"
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "run", "--config", str(cfg), "--http-port", "0",
                             "--max-new-tokens", "4", "--log-dir", str(tmp_path / "logs"), "The fox"],
                            stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    try:
        deadline = time.monotonic() + 120
        while "the broker's client address: " not in err.read_text():  # (printed once the demo is done)
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        line = next(x for x in err.read_text().splitlines() if x.startswith("the broker's client address: "))
        address = line.split(": ", 1)[1].split()[0]
        assert address.startswith("tcp://127.0.0.1:") and f"nebula-flow status --broker {address}" in line, line
        status = subprocess.run([sys.executable, "-m", "nebula_flow.cli", "status", "--broker", address, "--json"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        state = json.loads(status.stdout)
        assert state["mode"] == "pooled" and state["counters"]["tokens_out"] >= 4  # (the demo's: the deployment it ran)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_port_that_is_taken_is_one_clear_error(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """`serve --http-port P` and `api --port P` where P is taken: one line that names the address
    and why, before any deployment starts (it was a traceback whose cause the log's tail cut off);
    a deployment's gateway on a taken port is refused, never mistaken for whatever answers there.
    A broker's port that is taken is one such line too."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        cfg = tmp_path / "cfg.toml"
        cfg.write_text(f'mode = "pooled"\n[draft]\nmodel = "{tiny_pair / "draft"}"\n'
                       f'[target]\nmodel = "{tiny_pair / "target"}"\n')
        message = f"the HTTP API cannot listen on 127.0.0.1:{port}: address already in use"
        res = CliRunner().invoke(main, ["serve", "--config", str(cfg), "--port", "0", "--http-port", str(port),
                                        "--log-dir", str(tmp_path / "logs")])
        assert res.exit_code == 1 and res.output.strip() == f"Error: {message}", res.output
        assert not (tmp_path / "logs").exists()  # (nothing was started)
        res = CliRunner().invoke(main, ["api", "--broker", "tcp://127.0.0.1:1", "--port", str(port)])
        assert res.exit_code == 1 and res.output.strip() == f"Error: {message}", res.output
        res = CliRunner().invoke(main, ["broker", "--client-port", str(port)])  # (the broker's ports alike)
        assert res.exit_code == 1, res.output
        assert res.output.strip() == f"Error: cannot listen on tcp://127.0.0.1:{port}: Address already in use", res.output
        with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:
            with pytest.raises(DeploymentError, match=message):
                dep.start_api("127.0.0.1", port)
            url = dep.start_api("127.0.0.1", 0)  # (a free one: served, through the socket bound before uvicorn)
            with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
                assert json.loads(answer.read())["status"] == "ok"
    finally:
        taken.close()


def test_replay_jsonl_and_azure_csv_write_records_summary_and_plots(live, tiny_pair, tmp_path) -> None:  # noqa: ANN001
    trace = tmp_path / "t.jsonl"
    trace.write_text(SAMPLE_TRACE)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["replay", str(trace), "--broker", live.address, "--tokenizer",
                                    str(tiny_pair / "target"), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["requests"] == 3 and summary["errors"] == 0 and summary["shaping"]["clipped_prompts"] == 1
    assert {"tokens_per_s", "round_rate", "tokens_per_round", "ttft_s", "latency_s"} <= set(summary)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records] == [6, 5, 4]
    assert records[2]["prompt_tokens"] == 1024 - 4  # clipped to the context
    for name in ("latency_cdf.png", "throughput.png", "acceptance.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,40,3\n"
                     "2023-11-16 18:17:04.0319600,12,2\n2023-11-16 18:17:09.0319600,5000,3\n")
    # (no --tokenizer: the broker's own, as its status names it; the bundled model's ids were refused here)
    res = CliRunner().invoke(main, ["replay", str(azure), "--broker", live.address, "--out", str(out), "--json",
                                    "--time-scale", "10", "--limit", "2"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["requests"] == 2 and summary["completed"] == 2 and summary["tokens"] == 5
    assert [json.loads(line)["prompt_tokens"] for line in (out / "requests.jsonl").read_text().splitlines()] == [40, 12]


MOONCAKE = "\n".join([  # (Mooncake's format: the second starts as the first, the third as the second, the fourth alone)
    '{"timestamp": 0, "input_length": 300, "output_length": 4, "hash_ids": [1]}',
    '{"timestamp": 400, "input_length": 400, "output_length": 4, "hash_ids": [1]}',
    '{"timestamp": 800, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}',
    '{"timestamp": 1200, "input_length": 200, "output_length": 4, "hash_ids": [3]}'])


def test_replay_of_a_mooncake_trace_shares_the_prompt_starts_its_hash_ids_share(live, tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """Mooncake's traces hold no text but name each prompt's 512-token blocks: requests naming the
    same first blocks begin with the same tokens, so each starts from the KV of the one before it
    (the records' and summary's cached prompt tokens), and one of other blocks from nothing."""
    from nebula_flow.traces import HASH_BLOCK, PromptSource, TraceError, load_trace

    trace = tmp_path / "mooncake.jsonl"
    trace.write_text(MOONCAKE)
    reqs = load_trace(trace)
    assert [(r.arrival_s, r.prompt_len, r.max_new_tokens, r.blocks) for r in reqs[:2]] == [(0.0, 300, 4, [1]), (0.4, 400, 4, [1])]
    source = PromptSource(str(tiny_pair / "target"))
    one, two = source.blocks([1, 2], 2 * HASH_BLOCK), source.blocks([1], 300)
    assert len(one) == 2 * HASH_BLOCK and two == one[:300] and one[:HASH_BLOCK] != one[HASH_BLOCK:]
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["replay", str(trace), "--broker", live.address, "--tokenizer",
                                    str(tiny_pair / "target"), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert summary["completed"] == 4 and [r["prompt_tokens"] for r in records] == [300, 400, 600, 200]
    cached = [r["cached_tokens"] for r in records]
    assert cached[0] == 0 and cached[1] >= 288 and cached[2] >= 384 and cached[3] == 0, cached
    assert summary["prompt_cached"] == sum(cached) / 1500
    for bad, message in (('{"timestamp": 0, "input_length": 10, "output_length": 4, "hash_ids": []}', "hash_ids"),
                         ('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1]}', "input_length"),
                         ('{"input_length": 10, "output_length": 4, "hash_ids": [1]}', "timestamp")):
        trace.write_text(bad)
        with pytest.raises(TraceError, match=message):
            load_trace(trace)


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_endpoint_counters_move(live) -> None:  # noqa: ANN001
    def caught_up(c: Client) -> dict[str, float]:
        """A scrape once the snapshot (rendered at most every 0.5 s) shows the broker's round count now."""
        rounds = c.status()["counters"].get("rounds", 0)
        deadline = time.monotonic() + 10
        while (samples := _scrape(port)).get("nebula_rounds_total", 0) != rounds:
            assert time.monotonic() < deadline, "the metrics snapshot never caught up"
            time.sleep(0.1)
        return samples

    with Client(live.address) as c:
        port = c.status()["metrics_port"]
        before = caught_up(c)
        out = c.generate("def metrics():", max_new_tokens=12)
        after = caught_up(c)
    assert after["nebula_rounds_total"] - before["nebula_rounds_total"] == out.rounds
    assert after["nebula_output_tokens_total"] - before["nebula_output_tokens_total"] == 12
    sent, covered = (after[f'nebula_task_tokens_total{{kind="{k}"}}'] - before.get(f'nebula_task_tokens_total{{kind="{k}"}}', 0)
                     for k in ("task_tokens", "task_positions"))
    assert 0 < sent < covered  # (after its first tasks a request's tasks carry only its new tokens)
    assert after['nebula_requests_total{outcome="length"}'] >= before.get('nebula_requests_total{outcome="length"}', 0) + 1
    assert after['nebula_draft_tokens_proposed_total{position="1"}'] > before.get('nebula_draft_tokens_proposed_total{position="1"}', 0)
    busy = [k for k in after if k.startswith("nebula_worker_busy_seconds_total")]
    assert len(busy) == 2 and all(after[k] > 0 for k in busy)
    assert after['nebula_workers{role="draft"}'] == 1 and 'nebula_topic_depth{topic="draft"}' in after
    assert any(k.startswith("nebula_batch_size_total") for k in after)
    key = 'nebula_drafter_rounds_total{drafter="draft"}'  # (the tiny pair's one drafter: its folder's name)
    assert 0 < after[key] - before.get(key, 0) <= out.rounds
    assert {'nebula_token_tree_total{kind="fused_chains"}', 'nebula_token_tree_total{kind="alternatives_accepted"}'} <= set(after)
    assert after['nebula_fused_drafts_total{kind="rounds"}'] == 0  # (one drafter: nothing to fuse)
    assert after["nebula_prefix_waits_total"] == 0 and after["nebula_requests_waiting_for_prefix"] == 0  # (one at a time)
    # where the rounds' time went: the decode rounds of this request (all but its first) and their parts
    rounds = 'nebula_round_times_rounds_total{kind="decode"}'
    assert after[rounds] - before.get(rounds, 0) == out.rounds - 1
    verify = 'nebula_round_seconds_total{kind="decode",part="verify_forward"}'
    total = 'nebula_round_seconds_total{kind="decode",part="total"}'
    assert 0 < after[verify] - before.get(verify, 0) < after[total] - before.get(total, 0)
    # Predicted Outputs: a request with a prediction, and how much of it its output held
    with Client(live.address) as c:
        c.generate("def metrics():", max_new_tokens=12, prediction=out.token_ids + [7, 7])
        later = caught_up(c)
    moved = {k: later[f'nebula_prediction_tokens_total{{kind="{k}"}}'] - after[f'nebula_prediction_tokens_total{{kind="{k}"}}']
             for k in ("requests", "tokens_accepted", "tokens_rejected")}
    assert moved == {"requests": 1, "tokens_accepted": 12, "tokens_rejected": 2}
    # the prefix cache: a prompt that starts as the one before it did, on the draft and the target worker

    def summed(samples: dict[str, float], family: str) -> float:
        return sum(v for k, v in samples.items() if k.startswith(family + "{"))

    head = "def metrics_prefix():\n" + "    total = total + 1\n" * 12
    with Client(live.address) as c:
        c.generate(head + "# a", max_new_tokens=4)
        c.generate(head + "# b", max_new_tokens=4)
        last = caught_up(c)
    assert summed(last, "nebula_kv_prefix_hits_total") - summed(later, "nebula_kv_prefix_hits_total") >= 2
    assert summed(last, "nebula_kv_prefix_reused_positions_total") - summed(later, "nebula_kv_prefix_reused_positions_total") >= 2 * 60


def test_resubmitting_a_request_id_is_idempotent(live) -> None:  # noqa: ANN001
    sock = raw_socket(live.address)
    # (the same session: what the client library sends, so the retry is the owner's)
    submit = Submit("fixed-id-1", {"max_new_tokens": 40, "ignore_eos": True}, prompt="def retry():",
                    session="s" * 32)
    sock.send_multipart(protocol.encode(submit))
    first = protocol.decode(sock.recv_multipart())
    assert isinstance(first, Tokens)
    other = raw_socket(live.address)  # the client "reconnects" with a new socket and retries
    other.send_multipart(protocol.encode(submit))
    seen, done = [], None
    while done is None:
        msg = protocol.decode(other.recv_multipart())
        if isinstance(msg, Done):
            done = msg
        else:
            assert isinstance(msg, Tokens)
            seen.append(msg)
    assert seen[0].offset == 0 and len(seen[0].token_ids) >= len(first.token_ids)
    assert len(done.token_ids) == 40
    other.send_multipart(protocol.encode(submit))  # a retry after the end replays the result
    replay = protocol.decode(other.recv_multipart())
    assert isinstance(replay, Done) and replay.token_ids == done.token_ids
    with Client(live.address) as c:
        counters = c.status()["counters"]
    assert counters["requests_reattached"] >= 1 and counters["requests_replayed"] >= 1
    sock.close()
    other.close()


def test_a_bug_in_a_handler_costs_one_message_not_the_broker() -> None:
    """An unexpected exception while handling a message is answered (code "internal") and counted;
    the broker goes on serving (it once died on a chat template it could not render)."""
    from nebula_flow_broker.server import Broker, BrokerOptions

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port()))
    broker.bind()
    try:
        def broken(*_args: object) -> None:
            raise RuntimeError("a bug")

        real, broker.admission.request = broker.admission.request, broken
        broker.on_client(b"c", protocol.encode(Submit("r1", {"max_new_tokens": 2}, prompt_tokens=np.array([1, 2],
                                                                                                         np.int32))), 0.0)
        [(ident, reply)] = broker.client_outbox
        assert ident == b"c" and isinstance(reply, Error) and reply.code == "internal" and reply.req_id == "r1"
        assert broker.errors["internal"] == 1 and not broker.scheduler.requests
        broker.admission.request = real  # the next request is admitted as usual
        broker.on_client(b"c", protocol.encode(Submit("r2", {"max_new_tokens": 2}, prompt_tokens=np.array([1, 2],
                                                                                                         np.int32))), 0.0)
        assert [r.req_id for r in broker.scheduler.requests.values()] == ["r2"]
        broker.on_worker(b"w", protocol.encode(Register("target", "w", 4, {})), 0.0)
        broker.scheduler.register = broken  # (a worker message too)
        broker.on_worker(b"v", protocol.encode(Register("target", "v", 4, {})), 0.0)
        assert broker.errors["internal"] == 2 and len(broker.workers) == 1
    finally:
        broker.clients.close()
        broker.peers.close()


def test_a_forged_draft_ends_its_request_with_a_clear_error_and_is_counted() -> None:
    """A draft worker that returns a token outside its own proposal: the result is refused (and
    counted), the request ends with an error instead of hanging, and other requests go on."""
    from nebula_flow_broker.server import Broker, BrokerOptions

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port()))
    broker.bind()
    try:
        broker.on_worker(b"d", protocol.encode(Register("draft", "d", 4, {})), 0.0)
        broker.on_worker(b"t", protocol.encode(Register("target", "t", 4, {})), 0.0)
        for req_id in ("forged", "honest"):
            broker.on_client(b"c", protocol.encode(Submit(req_id, {"max_new_tokens": 8, "temperature": 1.0, "seed": 1},
                                                          prompt_tokens=np.array([1, 2, 3], np.int32))), 0.0)
        draft_id = broker.by_identity[b"d"]
        broker.scheduler.pull(draft_id, 4, True, 0.0)
        [(_, batch)] = broker.scheduler.dispatch()  # (what the broker would send the draft worker)
        forged, honest = sorted(batch, key=lambda r: r.req_id != "forged")
        outs = []
        for req, token in ((forged, 9), (honest, 3)):
            out = TaskResult(req.rid, req.phase, req.round, req.attempt, draft=[token])
            out.propose([np.array([3], np.int32)], [np.array([1.0], np.float32)])  # (9 is not in its proposal)
            outs.append(out)
        broker.on_worker(b"d", protocol.encode(Result(outs)), 1.0)
        assert broker.errors["malformed"] == 1
        errors = [m for _, m in broker.client_outbox if isinstance(m, Error)]
        assert [(e.req_id, e.code) for e in errors] == [("forged", "worker_error")] and "outside" in errors[0].message
        assert [r.req_id for r in broker.scheduler.requests.values()] == ["honest"]  # (now waiting for its verify)
    finally:
        broker.clients.close()
        broker.peers.close()


def test_committed_ids_outside_the_vocabulary_are_refused_and_counted(tiny_pair) -> None:  # noqa: ANN001
    """A target worker that commits an id the target's vocabulary lacks: refused, counted, and
    only its request ends (with a clear error)."""
    from nebula_flow_broker.server import Broker, BrokerOptions

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port(), model=str(tiny_pair / "target")))
    vocab = broker.admission.vocab_size
    broker.bind()
    try:
        broker.on_worker(b"d", protocol.encode(Register("draft", "d", 4, {})), 0.0)
        broker.on_worker(b"t", protocol.encode(Register("target", "t", 4, {})), 0.0)
        for req_id in ("forged", "honest"):
            broker.on_client(b"c", protocol.encode(Submit(req_id, {"max_new_tokens": 8},
                                                          prompt_tokens=np.array([1, 2, 3], np.int32))), 0.0)
        broker.scheduler.pull(broker.by_identity[b"d"], 4, True, 0.0)
        [(_, batch)] = broker.scheduler.dispatch()
        broker.on_worker(b"d", protocol.encode(Result([TaskResult(r.rid, r.phase, r.round, r.attempt, draft=[3])
                                                       for r in batch])), 1.0)
        broker.scheduler.pull(broker.by_identity[b"t"], 4, True, 1.0)
        [(_, batch)] = broker.scheduler.dispatch()
        outs = [TaskResult(r.rid, r.phase, r.round, r.attempt, committed=[3, vocab + 5 if r.req_id == "forged" else 4])
                for r in batch]
        broker.on_worker(b"t", protocol.encode(Result(outs)), 2.0)
        assert broker.errors["malformed"] == 1
        errors = [m for _, m in broker.client_outbox if isinstance(m, Error)]
        assert [(e.req_id, e.code) for e in errors] == [("forged", "worker_error")] and "vocabulary" in errors[0].message
        assert [r.req_id for r in broker.scheduler.requests.values()] == ["honest"]
        assert broker.scheduler.requests[broker.by_req_id["honest"]].output == [3, 4]
    finally:
        broker.clients.close()
        broker.peers.close()


def test_while_draining_a_retry_reattaches_and_a_finished_one_replays_but_new_work_is_refused() -> None:
    """A client that reconnects while the broker drains (SIGTERM) must still get its running
    request back; it was refused as shutting_down before the re-attach check."""
    from nebula_flow_broker.server import Broker, BrokerOptions

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port()))
    broker.bind()
    try:
        def submit(ident: bytes, req_id: str) -> None:
            broker.on_client(ident, protocol.encode(Submit(req_id, {"max_new_tokens": 4},  # (one client's session)
                                                           prompt_tokens=np.array([1, 2], np.int32),
                                                           session="c" * 32)), 0.0)

        submit(b"c", "running")
        submit(b"c", "done-soon")
        broker._finish(broker.by_req_id["done-soon"], "length")  # (as if it had finished)
        broker.client_outbox.clear()
        broker.draining_since = 1.0  # SIGTERM: no new requests, in-flight ones finish
        submit(b"c2", "running")  # the client reconnected (a new socket) and retries
        submit(b"c2", "done-soon")
        submit(b"c2", "new")
        replies = [(ident, type(m).__name__, getattr(m, "code", None)) for ident, m in broker.client_outbox]
        assert replies == [(b"c2", "Tokens", None), (b"c2", "Done", None), (b"c2", "Error", "shutting_down")]
        assert broker.counters["requests_reattached"] == 1 and broker.counters["requests_replayed"] == 1
        assert broker.scheduler.requests[broker.by_req_id["running"]].owner == b"c2"  # its stream goes there now
    finally:
        broker.clients.close()
        broker.peers.close()


def test_a_finished_request_replays_with_its_logprobs_while_they_are_kept() -> None:
    """A client that reconnects after its request finished gets the result again, and, if it asked
    for log-probabilities, its tokens with them first (the chunks that carried them may be lost);
    past the broker's budget the oldest are dropped and a replay gives tokens and text only."""
    from nebula_flow_broker import intake
    from nebula_flow_broker.server import Broker, BrokerOptions

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port()))
    broker.bind()
    try:
        def submit(ident: bytes, req_id: str) -> None:
            broker.on_client(ident, protocol.encode(Submit(req_id, {"max_new_tokens": 4, "logprobs": 1},
                                                           prompt_tokens=np.array([1, 2], np.int32),
                                                           session="c" * 32)), 0.0)

        for req_id in ("old", "new"):
            submit(b"c", req_id)
            req = broker.scheduler.requests[broker.by_req_id[req_id]]
            req.output, req.logprobs = [3, 4], [[3, "", -0.5, [[3, "", -0.5]]], [4, "", -0.25, [[4, "", -0.25]]]]
            broker._finish(req.rid, "length")
        broker.client_outbox.clear()
        submit(b"c2", "new")
        tokens, done = (m for _, m in broker.client_outbox)
        assert isinstance(tokens, Tokens) and tokens.token_ids == [3, 4] and [e[2] for e in tokens.logprobs] == [-0.5, -0.25]
        assert isinstance(done, Done) and done.token_ids == [3, 4]
        intake.FINISHED_LOGPROB_TOKENS = 2  # (a budget of one request's: finishing another drops the oldest)
        submit(b"c", "third")
        req = broker.scheduler.requests[broker.by_req_id["third"]]
        req.output, req.logprobs = [5], [[5, "", -1.0, [[5, "", -1.0]]]]
        broker._finish(req.rid, "length")
        broker.client_outbox.clear()
        submit(b"c2", "old")
        assert [type(m).__name__ for _, m in broker.client_outbox] == ["Done"]
    finally:
        intake.FINISHED_LOGPROB_TOKENS = 1 << 18
        broker.clients.close()
        broker.peers.close()


def test_only_the_owner_cancels_reattaches_or_replays_a_request(live) -> None:  # noqa: ANN001
    """Without keys a request belongs to the session its client library drew: another client that
    knows (or guesses) the id can neither cancel it, nor re-attach to it, nor read its result."""
    with Client(live.address) as owner, Client(live.address) as other:
        cancelled = owner.status()["counters"].get("requests_cancelled", 0)
        stream = owner.stream(token_ids=[3, 4, 5], max_new_tokens=120, ignore_eos=True, request_id="guessable-1")
        next(stream)
        with pytest.raises(RequestError, match="request_id_taken"):  # re-attach
            other.generate(token_ids=[3, 4, 5], max_new_tokens=120, request_id="guessable-1")
        sock = raw_socket(live.address)  # cancel, from another session
        sock.send_multipart(protocol.encode(protocol.Cancel("guessable-1", "x" * 32)))
        err = protocol.decode(sock.recv_multipart())
        assert isinstance(err, protocol.Error) and err.code == "unknown_request"
        sock.close()
        final = list(stream)[-1]  # the owner's request ran to its end
        assert len(final.token_ids) == 120 and final.finish_reason == "length"
        with pytest.raises(RequestError, match="request_id_taken"):  # replay
            other.generate(token_ids=[3, 4, 5], max_new_tokens=120, request_id="guessable-1")
        again = owner.generate(token_ids=[3, 4, 5], max_new_tokens=120, request_id="guessable-1")
        assert again.token_ids == final.token_ids
        counters = owner.status()["counters"]
    assert counters["requests_not_owner"] == 2 and counters.get("requests_cancelled", 0) == cancelled


def test_big_logprob_streams_travel_in_messages_under_the_header_limit(tiny_pair) -> None:  # noqa: ANN001
    """With logprobs (each token's top tokens) a re-attached client's resend and one step's chunks
    for a busy client are split into messages well under the header limit; the client library
    puts the tokens and logprobs back together in order."""
    from nebula_flow.outputs import Collector
    from nebula_flow.protocol import Chunks, Tokens
    from nebula_flow_broker.intake import chunk_groups
    from nebula_flow_broker.server import Broker, BrokerOptions

    def entries(n: int, at: int) -> list:
        return [[7, "tok", -1.0 - at - i, [[j, f"t{j}", -0.5] for j in range(20)]] for i in range(n)]

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port(), model=str(tiny_pair / "target")))
    broker.bind()
    try:
        broker.on_client(b"c", protocol.encode(Submit("big", {"max_new_tokens": 900, "logprobs": 20},
                                                      prompt_tokens=np.array([1, 2], np.int32), session="s" * 32)), 0.0)
        req = broker.scheduler.requests[broker.by_req_id["big"]]
        req.output, req.text, req.logprobs = [7] * 700, "x" * 700, entries(700, 0)  # (as if 700 tokens were out)
        broker.client_outbox.clear()
        broker.on_client(b"c2", protocol.encode(Submit("big", {"max_new_tokens": 900, "logprobs": 20},
                                                       prompt_tokens=np.array([1, 2], np.int32), session="s" * 32)), 1.0)
        resent = [m for _, m in broker.client_outbox]
        assert len(resent) == 3 and all(isinstance(m, Tokens) for m in resent)
        collector = Collector()
        for m in resent:
            frames = protocol.encode(m)
            assert len(frames[1]) < protocol.MAX_HEADER_BYTES // 4
            collector.chunk(protocol.decode(frames))
        assert collector.seen_tokens == 700 and collector.logprobs == req.logprobs
        # a long prompt's logprobs (and its text, echo) likewise, before the tokens, in messages of their own
        prompt = (np.arange(700) % 400 + 5).astype(np.int32)
        asks = {"max_new_tokens": 4, "prompt_logprobs": 20, "echo": True}
        broker.client_outbox.clear()
        broker.on_client(b"c", protocol.encode(Submit("long", asks, prompt_tokens=prompt, session="s" * 32)), 2.0)
        req = broker.scheduler.requests[broker.by_req_id["long"]]
        [(_, echo)] = broker.client_outbox
        assert echo.prompt_text and not echo.token_ids and req.prompt_logprobs[0][:3] == [5, req.prompt_logprobs[0][1], None]
        req.prompt_logprobs = req.prompt_logprobs + entries(699, 0)
        broker.client_outbox.clear()
        broker.on_client(b"c2", protocol.encode(Submit("long", asks, prompt_tokens=prompt, session="s" * 32)), 3.0)
        resent = [m for _, m in broker.client_outbox]
        assert len(resent) == 1 + 3 and resent[0].prompt_text == echo.prompt_text  # (echo, 3 of logprobs; no tokens yet)
        collector = Collector()
        for m in resent:
            frames = protocol.encode(m)
            assert len(frames[1]) < protocol.MAX_HEADER_BYTES // 4
            assert collector.chunk(protocol.decode(frames)) is None  # (no tokens yet: nothing to pass on)
        assert collector.prompt_logprobs == req.prompt_logprobs and collector.prompt_text == echo.prompt_text
    finally:
        broker.clients.close()
        broker.peers.close()
    step = [Tokens(f"r{i}", [7] * 5, "x" * 5, 0, 0, entries(5, i)) for i in range(100)]  # 10,500 logprob items
    groups = chunk_groups(step)
    assert len(groups) == 3 and [t for g in groups for t in g] == step
    assert all(len(protocol.encode(Chunks(g))[1]) < protocol.MAX_HEADER_BYTES // 2 for g in groups)
    assert chunk_groups(step[:3]) == [step[:3]] and chunk_groups([Tokens("a", [7], "x")] * 5) == [[Tokens("a", [7], "x")] * 5]
