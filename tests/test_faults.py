"""Faults and bad input: killed workers, malformed floods, overload, a restarted broker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time

import orjson
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_flow import protocol
from nebula_flow.client import AsyncClient, Busy, Client, RequestError, build_submit
from nebula_flow.deploy import Deployment, free_port
from tests.conftest import deploy_config, hf_greedy, workers_lost

pytestmark = pytest.mark.slow


def _ref_outputs(tiny_pair, prompts: list[list[int]], n: int) -> list[list[int]]:  # noqa: ANN001
    return [hf_greedy(tiny_pair / "target", p, n) for p in prompts]


@pytest.mark.parametrize("mode", ["pooled", "elastic", "pooled+ahead"])
def test_chaos_kill_a_draft_and_a_target_worker_during_a_replay(tiny_pair, mode: str) -> None:  # noqa: ANN001
    """Two workers killed mid-run (elastic: two that hold both models; +ahead: with draft-ahead, the
    drafter killed with its pre-drafts): every request completes, token for token the target's own
    greedy output."""
    mode, ahead = mode.removesuffix("+ahead"), mode.endswith("+ahead")
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randrange(2, 12))] for _ in range(64)]
    refs = _ref_outputs(tiny_pair, prompts, 24)
    cfg = deploy_config(tiny_pair, mode, 2, 2, max_batch=8)
    cfg.broker.policy = cfg.broker.policy.replace(draft_ahead=16 if ahead else 0)
    victims = ("draft-0", "target-3") if mode == "pooled" else ("any-0", "any-3")
    cfg.broker.liveness_s = 2.0
    cfg.broker.heartbeat_s = 0.5  # four beats per liveness window: a beat late on a loaded machine is no death
    cfg.kv_transport = "zmq"
    with Deployment(cfg) as dep:
        async def run() -> list:
            async with AsyncClient(dep.address, timeout_s=120) as client:
                done = 0

                async def one(i: int):  # noqa: ANN202
                    nonlocal done
                    # a replay: arrivals spread over ~1.3 s (with draft-ahead ~10 s: a pool light enough
                    # for pre-drafts, so the drafter dies holding some)
                    await asyncio.sleep(i * (0.15 if ahead else 0.02))
                    out = await client.generate(token_ids=prompts[i], max_new_tokens=24)
                    done += 1
                    return out

                async def killer() -> None:
                    kills = {rng.randrange(4, 20): victims[0], rng.randrange(20, 40): victims[1]}
                    while kills:
                        for at in [a for a in kills if done >= a]:
                            dep.kill(kills.pop(at))
                        await asyncio.sleep(0.01)

                results = await asyncio.gather(*(one(i) for i in range(64)), killer())
                return results[:64]

        outs = asyncio.run(run())
        # A worker killed near the end may hold no task: the broker then learns of its death only
        # from its silence, up to liveness_s after its last heartbeat. Wait for that, no longer.
        # (One it sends tasks to first is dropped as unreachable instead: also a detected death.)
        deadline = time.monotonic() + 3 * cfg.broker.liveness_s
        with Client(dep.address) as c:
            state = c.status()
            while workers_lost(state) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
                state = c.status()
    assert [o.token_ids for o in outs] == refs
    assert workers_lost(state) == 2 and state["counters"]["requests_length"] + \
        state["counters"].get("requests_stop", 0) == 64
    assert (state["draft_ahead"]["branches"] > 0) == ahead


FUZZ_KINDS = list(protocol.KINDS) + ["", "SUBMITX", "\x00"]
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False),
                                     st.text(max_size=12)), lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
headers = st.dictionaries(st.sampled_from(["v", "req_id", "params", "prompt", "prompt_tokens", "credits", "idle",
                                           "role", "name", "capacity", "model", "results", "busy_s", "seq", "rid",
                                           "start", "end", "tokens", "rows", "f", "x"]), json_values, max_size=6)
frames_st = st.one_of(
    st.lists(st.binary(max_size=40), min_size=0, max_size=4),  # random bytes, truncated messages
    st.tuples(st.sampled_from(FUZZ_KINDS), headers, st.lists(st.binary(max_size=16), max_size=2)).map(
        lambda t: [t[0].encode(), orjson.dumps(dict(t[1], v=t[1].get("v", 1)) if t[1].get("v") != 1 else t[1]), *t[2]]),
)


def test_fuzz_ten_thousand_malformed_messages(tiny_pair) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.broker.liveness_s = 2.0
    cfg.broker.heartbeat_s = 0.5  # four beats per liveness window: a beat late on a loaded machine is no death
    cfg.kv_transport = "zmq"
    with Deployment(cfg) as dep:
        with Client(dep.address) as c:
            state = c.status()
        kv_endpoint = next(w["kv_endpoint"] for w in state["workers"] if w["role"] == "target")
        ctx = zmq.Context.instance()
        socks = {}
        for name, addr in (("client", dep.address), ("worker", dep.cfg.broker.worker_address), ("kv", kv_endpoint)):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            socks[name] = s
        errors = {"client": 0, "worker": 0, "kv": 0}
        sent = {"n": 0}

        def drain(timeout_ms: int) -> None:
            for name, sock in socks.items():
                while sock.poll(timeout_ms):
                    try:
                        if isinstance(protocol.decode(sock.recv_multipart()), protocol.Error):
                            errors[name] += 1
                    except protocol.ProtocolError:
                        pass

        @settings(max_examples=3400, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(frames_st)
        def fuzz(frames: list[bytes]) -> None:
            for sock in socks.values():
                sock.send_multipart(frames or [b""])
                sent["n"] += 1
            if sent["n"] % 300 == 0:
                drain(0)  # keep the reply queues short without waiting on each message

        fuzz()
        drain(1000)
        assert sent["n"] >= 10_000
        with Client(dep.address, timeout_s=60) as c:
            out = c.generate(token_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True)  # the service still answers
            state = c.status()
        assert len(out.token_ids) == 8
        counted = sum(state["errors"].values())
        assert counted >= errors["client"] + errors["worker"] > 1000
        target = next(w for w in state["workers"] if w["role"] == "target" and w["kv"])
        assert target["kv"]["server_errors"] >= errors["kv"] > 1000
        for s in socks.values():
            s.close()


def test_overload_gets_busy_and_every_admitted_request_completes(tiny_pair) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.broker.max_pending = 8
    with Deployment(cfg) as dep:
        broker_pid = next(p.pid for n, p in dep.procs if n == "broker")

        def rss_mb() -> float:
            with open(f"/proc/{broker_pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

        async def flood() -> list:
            async with AsyncClient(dep.address, timeout_s=120) as client:
                async def one(i: int):  # noqa: ANN202
                    try:
                        # (ignore_eos: the tiny target's greedy output of some of these prompts, e.g.
                        # [14, 2], ends before 16 tokens, so the test failed whenever one was admitted)
                        return await client.generate(token_ids=[1 + i % 400, 2], max_new_tokens=16, ignore_eos=True)
                    except Busy:
                        return "busy"
                return await asyncio.gather(*(one(i) for i in range(80)))

        before = rss_mb()
        results = asyncio.run(flood())
        results += asyncio.run(flood())
        after = rss_mb()
    busy = sum(r == "busy" for r in results)
    done = [r for r in results if r != "busy"]
    assert busy >= 100 and len(done) >= 16
    assert all(len(r.token_ids) == 16 for r in done)
    assert after - before < 50, f"broker memory grew {after - before:.0f} MB"


def test_workers_rejoin_a_restarted_broker(tiny_pair) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    with Deployment(cfg) as dep:
        with Client(dep.address) as c:
            first = c.generate(token_ids=[4, 5, 6], max_new_tokens=10)
        broker = next(p for n, p in dep.procs if n == "broker")
        broker.kill()
        broker.wait()
        b = dep.cfg.broker
        log = open(dep.log_dir / "broker2.log", "wb")
        new = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "broker", "--client-port", str(b.client_port),
                                "--worker-port", str(b.worker_port), "--model", str(b.model)], stdout=log,
                               stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            deadline = time.monotonic() + 180  # generous: a loaded CI machine restarts slowly
            with Client(dep.address, timeout_s=5) as c:
                while time.monotonic() < deadline:
                    try:
                        if len(c.status()["workers"]) == 2:
                            break
                    except Exception:
                        pass
                    time.sleep(0.3)
                with Client(dep.address, timeout_s=120) as fresh:
                    again = fresh.generate(token_ids=[4, 5, 6], max_new_tokens=10)
        finally:
            new.terminate()
            new.wait(10)
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_client_retries_after_a_timeout_without_duplicating(tiny_pair, kind: str) -> None:  # noqa: ANN001
    port = free_port()
    client = (Client if kind == "blocking" else AsyncClient)(f"tcp://127.0.0.1:{port}", timeout_s=1.0, retries=30)
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.broker.client_port = port
    result: dict = {}

    import threading

    def late_start() -> None:
        time.sleep(2.5)  # the broker comes up after the client's first attempts timed out
        result["dep"] = Deployment(cfg)
        result["dep"].start()

    t = threading.Thread(target=late_start)
    t.start()
    async def ask_async():  # noqa: ANN202
        async with client:
            return await client.generate(token_ids=[7, 8, 9], max_new_tokens=12, temperature=0.8, ignore_eos=True)

    try:
        if kind == "blocking":
            with client:
                out = client.generate(token_ids=[7, 8, 9], max_new_tokens=12, temperature=0.8, ignore_eos=True)
        else:
            out = asyncio.run(ask_async())
        chunks_ok = len(out.token_ids) == 12  # ignore_eos: an EOS drawn at temperature 0.8 cannot end it early
    finally:
        t.join()
        result["dep"].stop()
    assert chunks_ok and out.stats["seed"] is not None


def test_cancel_frees_kv_on_every_worker(tiny_pair) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    with Deployment(cfg) as dep, Client(dep.address) as c:
        stream = c.stream(token_ids=[3, 4, 5], max_new_tokens=500, ignore_eos=True)
        next(stream)
        stream.close()  # cancel
        deadline = time.monotonic() + 10  # the broker has dropped it (and sent FREE) before the next request
        while c.status()["counters"].get("requests_cancelled", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        c.generate(token_ids=[6, 7], max_new_tokens=6, ignore_eos=True)  # a batch applies the FREE
        workers = c.status()["workers"]
    assert all(w["kv"]["held_requests"] == 1 for w in workers)  # only the second request's KV is left


def test_broker_sigterm_finishes_in_flight_requests_and_refuses_new_ones(tiny_pair) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    with Deployment(cfg) as dep:
        broker = next(p for n, p in dep.procs if n == "broker")
        with Client(dep.address) as c, Client(dep.address) as late:
            stream = c.stream(token_ids=[3, 4, 5], max_new_tokens=200, ignore_eos=True)
            next(stream)
            broker.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not late.status()["draining"]:  # the broker has taken the signal
                assert time.monotonic() < deadline, "the broker never started draining"
                time.sleep(0.02)
            with pytest.raises(RequestError) as err:
                late.generate(token_ids=[1], max_new_tokens=4)
            assert err.value.code == "shutting_down"
            final = list(stream)[-1]
        assert len(final.token_ids) == 200 and final.finish_reason == "length"
        assert broker.wait(30) == 0


def test_worker_sigterm_hands_its_work_back(tiny_pair) -> None:  # noqa: ANN001

    prompts = [[i + 1, i + 2] for i in range(12)]
    refs = _ref_outputs(tiny_pair, prompts, 40)
    cfg = deploy_config(tiny_pair, "pooled", 2, 2, max_batch=4)
    with Deployment(cfg) as dep:
        async def run() -> list:
            async with AsyncClient(dep.address, timeout_s=120) as client:
                async def stopper() -> None:
                    await asyncio.sleep(0.5)
                    dep.kill("target-3", signal.SIGTERM)
                    dep.kill("draft-0", signal.SIGTERM)
                res = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=40) for p in prompts), stopper())
                return res[:-1]

        outs = asyncio.run(run())
        exits = {n: p.wait(30) for n, p in dep.procs if n in ("target-3", "draft-0")}
        with Client(dep.address) as c:
            counters = c.status()["counters"]
    assert [o.token_ids for o in outs] == refs
    assert set(exits.values()) == {0}  # both drained and exited cleanly
    # Each said BYE ("left"); one the broker sent tasks to between its BYE and the broker reading
    # it is dropped as "unreachable" instead (its tasks are re-queued either way).
    assert counters.get("workers_left", 0) + counters.get("workers_unreachable", 0) == 2


def test_children_exit_when_the_deploying_process_dies(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    script = tmp_path / "deploy.py"
    script.write_text(
        "import sys, time\nfrom pathlib import Path\nsys.path.insert(0, {!r})\n"
        "from tests.conftest import deploy_config\nfrom nebula_flow.deploy import Deployment\n"
        "dep = Deployment(deploy_config(Path({!r}), 'pooled', 1, 1))\ndep.start()\ndep.start_api('127.0.0.1', 0)\n"
        "print(' '.join(str(p.pid) for _, p in dep.procs), flush=True)\ntime.sleep(600)\n".format(str(__import__("pathlib").Path(__file__).resolve().parent.parent), str(tiny_pair)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 4  # broker, two workers and the HTTP gateway
    proc.kill()  # the parent dies without stopping its deployment
    proc.wait()
    alive = _wait_gone(pids, 30)
    assert not alive, f"orphans still running: {alive}"


def test_a_second_interrupt_stops_serve_at_once_and_leaves_no_process(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """Ctrl-C while a request is in flight: serve tells the broker and the gateway to stop, and the
    broker waits (its drain time) for the request. Ctrl-C again: serve kills them all and exits at
    once, with no process left behind. (The second Ctrl-C used to abort serve itself, leaving the
    broker and the HTTP gateway running on their own.)"""
    proc, address, err = _serve_with_gateway(tiny_pair, tmp_path, "drain_s = 60",
                                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (as a terminal's job)
    try:
        deadline = time.monotonic() + 60
        kids = {pid: _cmdline(pid) for pid in _children(proc.pid)}
        assert sum("nebula_flow.cli api" in c for c in kids.values()) == 1 and len(kids) >= 4, kids
        streaming = threading.Event()

        def long_request() -> None:  # (~6 s of tokens: in flight when its workers leave)
            with contextlib.suppress(Exception), Client(address, timeout_s=120) as c:
                for _ in c.stream(token_ids=[5, 6, 7], max_new_tokens=900, ignore_eos=True):
                    streaming.set()

        threading.Thread(target=long_request, daemon=True).start()
        assert streaming.wait(60)
        proc.send_signal(signal.SIGINT)
        while "stopping" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline + 60, err.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0, err.read_text()
        left = [(pid, cmd) for pid, cmd in kids.items() if "worker-zygote" not in cmd and _wait_gone([pid], 0)]
        assert not left, f"still running after serve exited: {left}\n{err.read_text()}"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _wait_gone(list(kids), 30)  # (the workers' zygote leaves once serve is gone)


def test_sigterm_to_serve_lets_in_flight_requests_finish_through_the_gateway_too(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """What an operator's SIGTERM (a rolling restart) must do: requests in flight, a client
    library stream and an HTTP stream through the gateway, finish whole, as the workers keep
    computing them, while new connections are refused; then serve exits 0. (The workers used to
    be stopped with the broker, so both requests were cut off, the gateway's after 5 s.) serve's
    terminal shows the broker's activity lines meanwhile."""
    import openai

    proc, address, err = _serve_with_gateway(tiny_pair, tmp_path, "stats_log_s = 1")
    try:
        deadline = time.monotonic() + 60
        url = err.read_text().split("HTTP API (OpenAI-compatible) on ", 1)[1].split()[0].rstrip(",")
        http = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        streaming = threading.Barrier(3, timeout=60)
        finals: dict[str, tuple[int, str | None]] = {}

        def library() -> None:
            with Client(address, timeout_s=120) as c:
                stream = c.stream(token_ids=[5, 6, 7], max_new_tokens=400, ignore_eos=True)
                next(stream)
                streaming.wait()
                final = list(stream)[-1]
                finals["library"] = (len(final.token_ids), final.finish_reason)

        def gateway() -> None:
            chunks = http.completions.create(model="tiny-target", prompt=[8, 9], max_tokens=400, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
            ids: list[int] = []
            for i, chunk in enumerate(chunks):
                if i == 0:
                    streaming.wait()
                ids += chunk.choices[0].model_extra.get("token_ids") or []
                reason = chunk.choices[0].finish_reason
            finals["gateway"] = (len(ids), reason)

        with Client(address, timeout_s=120) as c:  # serve shows the broker's activity as it serves (each second here)
            while not (activity := [line for line in err.read_text().splitlines() if " broker: last " in line]):
                assert time.monotonic() < deadline + 60, err.read_text()
                c.generate(token_ids=[4], max_new_tokens=50, ignore_eos=True)
        threads = [threading.Thread(target=f, daemon=True) for f in (library, gateway)]
        for t in threads:
            t.start()
        streaming.wait()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, err.read_text()
        for t in threads:
            t.join(10)
        assert finals == {"library": (400, "length"), "gateway": (400, "length")}, err.read_text()
        said = err.read_text()  # (and serve's terminal showed how the drain went)
        assert " broker: draining: new requests are refused; 2 in flight may finish within 30 s" in said, said
        assert " broker: stopped: every request in flight finished" in said, said
        assert activity and all(" tokens/s out, " in line and line.endswith("2 workers") for line in activity), activity
        with pytest.raises(openai.APIConnectionError):  # (the gateway is gone with serve: nothing listens)
            http.completions.create(model="tiny-target", prompt="a", max_tokens=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_drain_that_runs_out_says_what_it_cut_off(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """SIGTERM with a request that outlasts drain_s: the request fails with shutting_down, and
    serve's terminal says the drain began and that one request did not finish in time."""
    proc, address, err = _serve_with_gateway(tiny_pair, tmp_path, "drain_s = 1")
    try:
        with Client(address, timeout_s=120) as c:
            stream = c.stream(token_ids=[5, 6, 7], max_new_tokens=900, ignore_eos=True)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(RequestError) as failed:
                list(stream)
        assert failed.value.code == "shutting_down"
        assert proc.wait(60) == 0, err.read_text()
        said = err.read_text()
        assert " broker: draining: new requests are refused; 1 in flight may finish within 1 s" in said, said
        assert " broker: stopped: 1 in flight did not finish within drain_s 1 s (each fails with shutting_down)" in said
    finally:
        if proc.poll() is None:
            proc.kill()


def _serve_with_gateway(tiny_pair, tmp_path, broker_settings: str, **popen) -> tuple:  # noqa: ANN001, ANN003
    """`serve --http-port 0` on the tiny pair (model "tiny-target"), its config's ``[broker]``
    table holding ``broker_settings``; returned once its gateway answers, with its client address
    and the file of what it printed."""
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    path = tmp_path / "cfg.toml"
    path.write_text(f'mode = "pooled"\n[broker]\n{broker_settings}\n[draft]\nmodel = "{cfg.draft.model}"\n'
                    f'[target]\nmodel = "{cfg.target.model}"\nname = "tiny-target"\n')
    err = tmp_path / "serve.err"
    proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "serve", "--config", str(path), "--port", "0",
                             "--http-port", "0", "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=open(err, "w"), text=True, **popen)
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://"), err.read_text()
        deadline = time.monotonic() + 60
        while "HTTP API" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        raise
    return proc, address, err


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # (gone meanwhile)
    return kids


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Poll until none of ``pids`` runs (zombies count as gone) or the timeout; those still running."""
    def running() -> list[int]:
        alive = []
        for p in pids:
            try:
                if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(p)
            except OSError:
                pass
        return alive

    deadline = time.monotonic() + timeout_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.3)
    return running()


def test_a_worker_the_broker_refuses_exits_with_a_clear_error(tiny_pair) -> None:  # noqa: ANN001
    """A draft worker pointed at an autoregressive broker cannot ever join: it says why and
    exits (code 2) instead of retrying for ever, and the running deployment is unharmed."""
    cfg = deploy_config(tiny_pair, "autoregressive", 1, 1)
    with Deployment(cfg) as dep:
        out = subprocess.run([sys.executable, "-m", "nebula_flow.cli", "worker", "--role", "draft", "--model",
                              str(tiny_pair / "draft"), "--broker", cfg.broker.worker_address, "--kv-transport", "none"],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert out.returncode == 2, out.stderr[-2000:]
        assert "refused to register" in out.stderr and "no 'draft' workers" in out.stderr
        with Client(dep.address) as c:
            assert len(c.generate(token_ids=[4, 5, 6], max_new_tokens=5).token_ids) == 5
            assert c.status()["errors"].get("wrong_role", 0) >= 1


def test_a_deployment_retries_when_its_chosen_port_is_taken_before_the_broker_binds(tiny_pair, monkeypatch) -> None:  # noqa: ANN001
    import socket

    import nebula_flow.deploy as deploy

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([busy, free_port()])  # the first pick is stolen before the broker binds it
    monkeypatch.setattr(deploy, "free_port", lambda: next(ports, None) or free_port())
    try:
        with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:
            assert dep.cfg.broker.client_port != busy
            with Client(dep.address) as c:
                assert len(c.generate(token_ids=[4, 5, 6], max_new_tokens=4).token_ids) == 4
    finally:
        taken.close()


GONE_CLIENT = """
import asyncio, sys
from nebula_flow.client import AsyncClient

async def main():
    async with AsyncClient(sys.argv[1]) as client:
        streams = [client.stream(token_ids=[3 + i, 4, 5], max_new_tokens=1000, ignore_eos=True) for i in range(2)]
        for stream in streams:
            await stream.__anext__()
        print("streaming", flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


def test_the_requests_of_a_client_that_went_away_end_unless_it_comes_back(tiny_pair) -> None:  # noqa: ANN001
    """A client process killed mid-stream: its requests ran to their last token, for nobody. Now they
    end ``client_gone_s`` after a send to it fails (counted); a client whose connection drops and
    that sends its request again from a new one within that time keeps it, whole."""
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    cfg.broker.client_gone_s, cfg.broker.heartbeat_s = 1.0, 0.25  # (2 s left ~1,500 of the 2,000 tokens run)
    with Deployment(cfg) as dep, Client(dep.address, timeout_s=60) as c:
        gone = subprocess.Popen([sys.executable, "-c", GONE_CLIENT, dep.address], stdout=subprocess.PIPE, text=True)
        assert gone.stdout.readline().strip() == "streaming"
        gone.kill()
        gone.wait()
        deadline = time.monotonic() + 60
        while (state := c.status())["pool"] and time.monotonic() < deadline:
            time.sleep(0.1)
        counters = state["counters"]
        assert state["pool"] == 0 and counters["requests_abandoned"] == 2, counters
        assert counters.get("requests_length", 0) == 0 and counters["tokens_out"] < 1500  # (not run to the end)

        # A connection that drops (a raw socket, closed without a CANCEL) and a retry from another
        session = "5e55" * 8
        first = zmq.Context.instance().socket(zmq.DEALER)
        first.connect(dep.address)
        first.send_multipart(protocol.encode(build_submit("back", None, [3, 4, 5], False, session, max_new_tokens=300,
                                                          ignore_eos=True)))
        assert isinstance(protocol.decode(first.recv_multipart()), protocol.Tokens)
        first.close(linger=0)
        failures = c.status()["counters"].get("send_failures", 0)
        while c.status()["counters"].get("send_failures", 0) == failures and time.monotonic() < deadline:
            time.sleep(0.02)  # (until the broker has found the first connection gone)
        c.session = session
        out = c.generate(token_ids=[3, 4, 5], max_new_tokens=300, ignore_eos=True, request_id="back")
        assert c.status()["counters"]["requests_abandoned"] == 2
    assert out.token_ids == hf_greedy(tiny_pair / "target", [3, 4, 5], 300)


@pytest.mark.parametrize(("per_client", "pending", "first", "admitted"),
                         [(None, 300, 290, [290, 4]), (None, 10, 12, [10, 0]), (3, 10, 12, [3, 3])])
def test_admission_bounds_the_pool_and_a_client_only_where_asked(tiny_pair, tmp_path, per_client, pending, first,  # noqa: ANN001
                                                                 admitted) -> None:
    """A broker (no workers: what it admits waits) of max_pending ``pending``; two clients, the
    first sends ``first`` requests, the second 4. Each client's own limit used to be 256 by default,
    under max_pending, so an HTTP gateway, one client for all its callers, was refused load the pool
    had room for (the first case); now there is none unless configured, and then it bounds each
    client apart."""
    from nebula_flow.options import BrokerOptions, write_options

    opts = BrokerOptions(client_port=free_port(), worker_port=free_port(), model=str(tiny_pair / "target"),
                         max_pending=pending, max_inflight_per_client=per_client, drain_s=0)
    broker = subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "broker", "--options",
                               str(write_options(opts, tmp_path / "broker.json"))], stderr=subprocess.DEVNULL)
    socks = []
    try:
        with Client(opts.client_address) as c:
            c.wait_connected(60)
        refused = []
        for n, name in ((first, "a"), (4, "b")):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 30_000)
            sock.connect(opts.client_address)
            socks.append(sock)
            for i in range(n):
                sock.send_multipart(protocol.encode(build_submit(f"{name}{i}", None, [3, 4], False, max_new_tokens=4)))
            sock.send_multipart(protocol.encode(protocol.Status()))
            errors = []
            while not isinstance(msg := protocol.decode(sock.recv_multipart()), protocol.State):
                errors.append(msg)  # (the refusals come before the state that follows them)
            assert all(isinstance(e, protocol.Error) and e.code == "busy" for e in errors), errors
            refused.append(len(errors))
            pool = msg.state["pool"]
        assert [n - r for n, r in zip((first, 4), refused)] == admitted and pool == sum(admitted)
    finally:
        for sock in socks:
            sock.close()
        broker.terminate()
        broker.wait(timeout=30)
