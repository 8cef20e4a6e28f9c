"""A deployment that heals itself: `serve` restarts a worker or the broker that died, gives up on
one that crash-loops, and clients carry their requests across a broker's restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from nebula_flow.chaos import Kill, default_kills
from nebula_flow.client import AsyncClient, Client, Completion
from nebula_flow.config import ConfigError, load_config
from nebula_flow.deploy import Deployment
from nebula_flow.supervisor import REFUSED_EXIT, ChildRecord, RestartPolicy, judge
from tests.conftest import deploy_config, hf_greedy, workers_lost


def test_restarts_back_off_and_a_crash_loop_is_given_up() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=1.0, max_backoff_s=3.0)
    record = ChildRecord()
    delays = []
    for now in (0.0, 10.0, 20.0):
        verdict = judge(policy, record, -9, now)
        delays.append(verdict.delay_s)
        record.restarts.append(now + verdict.delay_s)
    assert delays == [1.0, 2.0, 3.0]  # doubling, capped
    verdict = judge(policy, record, 1, 30.0)  # a fourth death within the window
    assert verdict.delay_s is None and "crash loop" in verdict.reason
    # restarts older than the window are forgiven: a child that then ran a while is tried again
    assert judge(policy, record, -9, 200.0).delay_s == 1.0
    refused = judge(policy, ChildRecord(), REFUSED_EXIT, 0.0)
    assert refused.delay_s is None and "configuration" in refused.reason
    assert judge(RestartPolicy(max_restarts=0), ChildRecord(), -9, 0.0).delay_s is None  # (0: never restart)


def test_the_default_drill_kills_a_drafter_then_a_verifier_in_every_mode() -> None:
    assert default_kills(["broker", "draft-0", "draft-1", "target-2", "target-3"]) == [Kill("draft-1", 0.0),
                                                                                    Kill("target-3", 3.0)]
    # no draft-only worker (autoregressive, colocated, elastic): the last two
    assert default_kills(["broker", "target-0", "target-1"]) == [Kill("target-0", 0.0), Kill("target-1", 3.0)]
    assert default_kills(["broker", "any-0", "any-1", "any-2"]) == [Kill("any-1", 0.0), Kill("any-2", 3.0)]
    assert default_kills(["broker", "draft-0", "any-1"]) == [Kill("draft-0", 0.0), Kill("any-1", 3.0)]


def test_the_restart_policy_comes_from_the_config(tmp_path) -> None:  # noqa: ANN001
    pair = '[draft]\nmodel = "d"\n[target]\nmodel = "t"\n'
    path = tmp_path / "c.toml"
    path.write_text(pair + "[supervise]\nmax_restarts = 2\nbackoff_s = 0.5\n")
    cfg = load_config(path)
    cfg.validate()
    assert cfg.supervise == RestartPolicy(max_restarts=2, backoff_s=0.5)
    for bad, message in (("max_restarts = -1", "max_restarts must be >= 0"), ("backoff_s = 60", "backoff_s <= max_backoff_s"),
                         ("restarts = 3", "unknown keys")):
        path.write_text(pair + f"[supervise]\n{bad}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path).validate()


def _serve(tiny_pair: Path, tmp_path: Path, draft_workers: int, target_workers: int,
           mode: str = "pooled", more: str = "") -> tuple[subprocess.Popen, str]:
    """`serve` of the tiny pair; ``more``: tables added to its config."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'mode = "{mode}"\n[broker]\nheartbeat_s = 0.5\nliveness_s = 3.0\n'
                   f'[draft]\nmodel = "{tiny_pair / "draft"}"\nworkers = {draft_workers}\nthreads = 1\n'
                   f'[target]\nmodel = "{tiny_pair / "target"}"\nworkers = {target_workers}\nthreads = 1\n{more}')
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "serve", "--config", str(cfg),
                             "--port", "0", "--log-dir", str(tmp_path / "logs")],  # (0: free ports, picked again if one is taken)
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "w"), text=True,
                            env=dict(os.environ))
    address = proc.stdout.readline().strip()
    assert address.startswith("tcp://"), (tmp_path / "serve.err").read_text()
    return proc, address


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _stream_while(address: str, prompts: list[list[int]], max_new_tokens: int, timeout_s: float,
                  meanwhile: Callable[[AsyncClient, Callable[[], int]], Awaitable[None]]) -> list[Completion]:
    """Stream ``prompts`` at once (greedy) while ``meanwhile(client, tokens)`` runs (``tokens()``: the
    tokens streamed so far, so a kill can land mid-run whatever the machine's speed); the completions."""
    async def run() -> list[Completion]:
        async with AsyncClient(address, timeout_s=timeout_s) as client:
            tokens = 0

            async def one(p: list[int]) -> Completion:
                nonlocal tokens
                async for item in client.stream(token_ids=p, max_new_tokens=max_new_tokens):
                    if isinstance(item, Completion):
                        return item
                    tokens += len(item.token_ids)
                raise AssertionError("no completion")

            results = await asyncio.gather(*(one(p) for p in prompts), meanwhile(client, lambda: tokens))
            return results[:-1]

    return asyncio.run(run())


def _wait_for(check, timeout_s: float, address: str):  # noqa: ANN001, ANN202
    """Poll the broker's status until ``check(state)`` holds; the state, or None at the deadline."""
    deadline = time.monotonic() + timeout_s
    with Client(address, timeout_s=5) as c:
        while time.monotonic() < deadline:
            try:
                state = c.status()
                if check(state):
                    return state
            except Exception:  # (the broker may be restarting)
                pass
            time.sleep(0.2)
    return None


def test_serve_restarts_killed_workers_and_every_request_completes(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """The operations issue's run: pooled 2 + 2, 16 concurrent greedy requests, kill -9 of a draft
    worker and then of a target worker mid-run: all 16 complete as the target alone writes them,
    and both workers are back in `status`, restarted, within 30 s."""
    prompts = [[i + 3, 2 * i + 5, 7] for i in range(16)]
    refs = [hf_greedy(tiny_pair / "target", p, 40) for p in prompts]
    proc, address = _serve(tiny_pair, tmp_path, 2, 2)
    try:
        state = _wait_for(lambda s: len(s["workers"]) == 4, 60, address)
        pids = {w["name"]: w["pid"] for w in state["workers"]}
        killed_at: dict[str, float] = {}

        async def killer(_client: AsyncClient, tokens: Callable[[], int]) -> None:
            # the draft worker once the requests are under way, the target worker after
            # more tokens came out (each kill lands mid-run, whatever the machine's speed)
            for name, after in (("draft-1", 16), ("target-3", 64)):
                while tokens() < after:
                    await asyncio.sleep(0.005)
                os.kill(pids[name], signal.SIGKILL)
                killed_at[name] = time.monotonic()

        outs = _stream_while(address, prompts, 40, 120, killer)
        assert [o.token_ids for o in outs] == refs
        back = _wait_for(lambda s: len(s["workers"]) == 4 and s["restarts"]["workers"] == 2, 30, address)
        assert back is not None, (tmp_path / "serve.err").read_text()
        assert time.monotonic() - killed_at["target-3"] < 30 + 5  # (+ the status poll's own time)
        restarted = {w["name"]: w for w in back["workers"] if w["restarts"]}
        assert set(restarted) == {"draft-1", "target-3"}
        assert all(w["pid"] != pids[n] for n, w in restarted.items())
        assert workers_lost(back) == 2
    finally:
        _stop(proc)
    err = (tmp_path / "serve.err").read_text()
    assert "draft-1 was killed by SIGKILL; starting it again" in err and "target-3 started again" in err, err


def test_a_restarted_elastic_worker_takes_rounds_of_the_requests_in_flight(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """Elastic, two workers, 16 long greedy requests; kill -9 of one worker once they are under way:
    its restart takes rounds of those requests while they run (no other request is sent), and every
    output is the target's own. Before, the survivor took back all of its rounds at every batch's
    end (served first: idle the shortest) and the restarted worker sat idle until new requests came."""
    prompts = [[i + 3, 2 * i + 5, 7] for i in range(8)]
    refs = [hf_greedy(tiny_pair / "target", p, 1000) for p in prompts]  # (long: they outlast the restart)
    proc, address = _serve(tiny_pair, tmp_path, 1, 1, mode="elastic", more="[supervise]\nbackoff_s = 0.1\n")
    try:
        state = _wait_for(lambda s: len(s["workers"]) == 2, 60, address)
        victim = next(w for w in state["workers"] if w["name"] == "any-0")
        rejoined: list[int] = []

        async def killer(client: AsyncClient, tokens: Callable[[], int]) -> None:
            while tokens() < 32:
                await asyncio.sleep(0.005)
            os.kill(victim["pid"], signal.SIGKILL)
            while not any(w["restarts"] for w in (await client.status())["workers"]):
                await asyncio.sleep(0.05)
            rejoined.append(tokens())

        outs = _stream_while(address, prompts, 1000, 300, killer)
        assert [o.token_ids for o in outs] == refs
        assert rejoined and rejoined[0] < 0.75 * sum(map(len, refs)), rejoined  # (back with much of the work to come)
        with Client(address) as client:
            back = next(w for w in client.status()["workers"] if w["restarts"])
        assert back["name"] == "any-0" and back["tasks"] > 0, back
    finally:
        _stop(proc)


def test_serve_restarts_a_killed_broker_and_clients_carry_their_requests(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """kill -9 of the broker mid-stream: serve starts it again on the same ports, the workers
    register again, the client sends its in-flight request again on reconnecting and the stream
    goes on where it was (the same tokens, none twice), and new requests succeed."""
    prompt = [5, 9, 13]
    ref = hf_greedy(tiny_pair / "target", prompt, 200)
    proc, address = _serve(tiny_pair, tmp_path, 1, 1)
    try:
        state = _wait_for(lambda s: len(s["workers"]) == 2, 60, address)
        broker_pid = state["pid"]
        streamed, final = [], []
        first_chunk = threading.Event()

        def consume() -> None:
            with Client(address, timeout_s=120) as c:
                for item in c.stream(token_ids=prompt, max_new_tokens=200):
                    if isinstance(item, Completion):
                        final.append(item)
                    else:
                        streamed.extend(item.token_ids)
                        first_chunk.set()

        t = threading.Thread(target=consume)
        t.start()
        assert first_chunk.wait(60)
        os.kill(broker_pid, signal.SIGKILL)
        t.join(120)
        assert not t.is_alive() and final, (tmp_path / "serve.err").read_text()
        assert final[0].token_ids == ref and streamed == ref  # nothing lost, nothing twice
        state = _wait_for(lambda s: len(s["workers"]) == 2, 60, address)
        assert state is not None and state["pid"] != broker_pid and state["restarts"]["broker"] == 1
        with Client(address, timeout_s=60) as c:
            assert c.generate(token_ids=prompt, max_new_tokens=12).token_ids == ref[:12]
    finally:
        _stop(proc)
    assert "broker was killed by SIGKILL; starting it again" in (tmp_path / "serve.err").read_text()


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_a_sampled_stream_without_a_seed_goes_on_after_a_killed_broker(tiny_pair, tmp_path, kind: str) -> None:  # noqa: ANN001
    """kill -9 of the broker mid-stream, a sampled request without a seed (one the policy may plan by
    load): the client sends it again with the tokens it has had, the restarted broker's run goes on
    after them, and the stream is one sample: what was streamed is the final output, nothing twice.
    (Run anew from the start, its draws would differ from the tokens already streamed.)"""
    proc, address = _serve(tiny_pair, tmp_path, 1, 1)
    ask = {"token_ids": [5, 9, 13], "max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    try:
        state = _wait_for(lambda s: len(s["workers"]) == 2, 60, address)
        broker_pid = state["pid"]
        streamed, final, before_kill = [], [], []
        first_chunk = threading.Event()

        def took(item: object) -> None:
            if isinstance(item, Completion):
                final.append(item)
            else:
                streamed.extend(item.token_ids)
                first_chunk.set()

        def consume() -> None:
            if kind == "blocking":
                with Client(address, timeout_s=120) as c:
                    for item in c.stream(**ask):
                        took(item)
                return

            async def run() -> None:
                async with AsyncClient(address, timeout_s=120) as c:
                    async for item in c.stream(**ask):
                        took(item)
            asyncio.run(run())

        t = threading.Thread(target=consume)
        t.start()
        assert first_chunk.wait(60)
        os.kill(broker_pid, signal.SIGKILL)
        before_kill.extend(streamed)
        t.join(120)
        assert not t.is_alive() and final, (tmp_path / "serve.err").read_text()
        out = final[0]
        assert len(out.token_ids) == 200 and out.token_ids == streamed  # one sample: nothing lost, nothing twice
        assert out.token_ids[:len(before_kill)] == before_kill
        state = _wait_for(lambda s: len(s["workers"]) == 2, 60, address)
        assert state["pid"] != broker_pid and state["counters"].get("requests_resumed") == 1, state["counters"]
    finally:
        _stop(proc)


def test_a_crash_looping_worker_is_given_up_while_the_rest_serve(tiny_pair) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, "pooled", 2, 1)
    cfg.broker.heartbeat_s, cfg.broker.liveness_s = 0.5, 3.0
    cfg.supervise = RestartPolicy(max_restarts=1, backoff_s=0.1)  # ([supervise] in a config file)
    with Deployment(cfg) as dep:
        events: list[str] = []

        def supervise_until(text: str) -> None:
            deadline = time.monotonic() + 60
            while not any(text in e for e in events) and time.monotonic() < deadline:
                events.extend(dep.supervise())
                time.sleep(0.05)
            assert any(text in e for e in events), events

        dep.kill("draft-0")
        supervise_until("draft-0 started again")
        assert _wait_for(lambda s: any(w["name"] == "draft-0" and w["restarts"] == 1 for w in s["workers"]),
                         60, dep.address)
        dep.kill("draft-0")
        supervise_until("giving up on it")
        assert [e for e in events if "giving up" in e][0].startswith("draft-0 was killed by SIGKILL")
        # the rest keep serving
        with Client(dep.address, timeout_s=60) as c:
            assert len(c.generate(token_ids=[3, 4, 5], max_new_tokens=8, ignore_eos=True).token_ids) == 8
        assert dep.supervise() == []  # given up: never started again
        assert next(p for n, p in dep.procs if n == "draft-0").poll() is not None


def test_a_worker_that_exits_by_itself_is_restarted_with_why_in_the_event(tiny_pair) -> None:  # noqa: ANN001
    """A worker that exits rather than being killed (here stopped by a stray SIGTERM; a crash alike)
    is started again, and the event carries its log's last line, so an operator reads why without
    opening the log. (The event said only "exited with code N".)"""
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.supervise = RestartPolicy(backoff_s=0.1)
    with Deployment(cfg) as dep:
        dep.kill("draft-0", signal.SIGTERM)
        events: list[str] = []
        deadline = time.monotonic() + 60
        while not any("draft-0 started again" in e for e in events) and time.monotonic() < deadline:
            events.extend(dep.supervise())
            time.sleep(0.05)
        exited = [e for e in events if e.startswith("draft-0 exited")]
        assert exited and exited[0].startswith("draft-0 exited with code 0 (its log ends: ") and \
            exited[0].split("; starting it again")[0].endswith("draft INFO draft-0 stopped)"), events


def test_a_killed_worker_is_dropped_before_its_silence_runs_out(tiny_pair) -> None:  # noqa: ANN001
    """A killed worker's connection closes at once: the broker's next heartbeat to it fails and its
    tasks are re-queued then, not after liveness_s of silence (set long here)."""
    cfg = deploy_config(tiny_pair, "pooled", 2, 1)
    cfg.broker.heartbeat_s, cfg.broker.liveness_s = 0.5, 600.0
    with Deployment(cfg) as dep:
        dep.kill("draft-0")
        state = _wait_for(lambda s: workers_lost(s) == 1, 20, dep.address)
        assert state is not None and state["counters"].get("workers_unreachable") == 1


def test_chaos_drill_reports_completions_recovery_and_equality(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """`nebula-flow chaos`: what an operator runs to see the healing: every request completes,
    the killed processes serve again, and the output equals the target alone's."""
    import json

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'mode = "pooled"\n[broker]\nheartbeat_s = 0.5\nliveness_s = 3.0\n'
                   f'[draft]\nmodel = "{tiny_pair / "draft"}"\nworkers = 2\nthreads = 1\n'
                   f'[target]\nmodel = "{tiny_pair / "target"}"\nthreads = 1\n')
    # (64 tokens each: the load outlasts the broker's kill 0.2 s after the first token; with 24, a quiet
    # machine finished it first, and that kill tested a restart, not a recovery mid-load)
    res = subprocess.run([sys.executable, "-m", "nebula_flow.cli", "chaos", "--config", str(cfg), "--requests", "6",
                          "--max-new-tokens", "64", "--kill", "draft-1", "--kill", "broker@0.2", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["completed"] == 6 and report["equal_to_target_alone"] == 6 and not report["failures"]
    assert [k["name"] for k in report["kills"]] == ["draft-1", "broker"]
    assert all(k["recovered_s"] is not None and k["during_load"] for k in report["kills"])
    assert isinstance(report["kills"][0]["tasks_since"], int) and "tasks_since" not in report["kills"][1]
    assert report["restarts"]["broker"] == 1
    # a kill after the load has ended is said to be one no request saw (a drill too small for its schedule)
    res = subprocess.run([sys.executable, "-m", "nebula_flow.cli", "chaos", "--config", str(cfg), "--requests", "1",
                          "--max-new-tokens", "2", "--kill", "draft-1@2", "--no-reference"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "killed draft-1 at 2.0 s: serving again" in res.stdout and "no request saw it" in res.stdout, res.stdout
    res = subprocess.run([sys.executable, "-m", "nebula_flow.cli", "chaos", "--config", str(cfg), "--kill", "draft-9"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and "no process ['draft-9']" in res.stderr
