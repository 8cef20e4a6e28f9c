"""Priority scheduling (vLLM's request ``priority``, lower first): with the policy's
``priority_scheduling`` on, queued tasks go by their requests' priority, then by arrival, every
round again; off, a priority other than 0 is refused. It changes when a request's rounds run,
never what they compute: outputs stay the target's own greedy output, and a seeded sample is the
same whatever the priority.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from nebula_flow import policy_log
from nebula_flow.client import AsyncClient, Client, Completion, RequestError
from nebula_flow.deploy import Deployment
from nebula_flow.params import MAX_PRIORITY, InvalidParams, SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.request import Request
from nebula_flow.scheduler import Scheduler
from nebula_flow.topic import Topic
from tests.conftest import deploy_config, hf_greedy


def _req(rid: int, priority: int = 0) -> Request:
    return Request(rid, str(rid), [1, 2, 3], SamplingParams(max_new_tokens=16, priority=priority), seed=rid)


def test_a_topic_serves_lower_priorities_first_and_arrival_within_each() -> None:
    t = Topic()
    for rid, holder, priority in ((1, 7, 0), (2, None, 5), (3, 7, -1), (4, 8, 0), (5, 7, -1)):
        t.append(rid, holder, priority)
    t.appendleft(6, 8, 0)  # (a re-queued task: first among its own priority, not before a lower one)
    assert list(t) == [3, 5, 6, 1, 4, 2] and len(t) == 6
    assert list(t.held_by([7])) == [3, 5, 1] and list(t.held_by([None, 8])) == [6, 4, 2]
    assert t.held(7) == 3 and sorted(t.holders(), key=str) == [7, 8, None]
    t.forget_holder(7)  # its tasks are held by no one, each still in its place
    assert list(t.held_by([None])) == [3, 5, 1, 2] and 7 not in t.holders()
    for rid in (3, 5):
        t.remove(rid)
    assert list(t) == [6, 1, 4, 2] and 3 not in t and 6 in t
    t.append(7, None, -1)  # (a priority seen before, then emptied, comes back in its place)
    assert list(t) == [7, 6, 1, 4, 2]


@pytest.mark.parametrize("mode", ["pooled", "paired", "colocated", "elastic", "autoregressive"])
def test_every_round_goes_to_the_most_urgent_requests_first(mode: str) -> None:
    s = Scheduler(mode, PolicyConfig(k=4, priority_scheduling=True))
    role = {"pooled": "target", "paired": "target", "colocated": "colocated", "elastic": "any",
            "autoregressive": "target"}[mode]
    if mode in ("pooled", "paired"):
        s.register(1, "draft", 2)
    s.register(2, role, 2)
    low = [_req(rid, priority=3) for rid in range(4)]
    for r in low:
        s.admit(r)
    s.admit(urgent := _req(9, priority=-2))
    for now in range(6):  # every stage the requests pass through, a batch of two at a time
        for wid in s.workers:
            s.pull(wid, 2, idle=True, now=float(now))
        batches = s.dispatch()
        # the urgent task was taken wherever it was queued, while low ones wait
        assert not any(urgent.rid in t for t in s.topics.values()), (mode, now)
        assert any(r.rid in t for t in s.topics.values() for r in low), (mode, now)
        for wid, batch in batches:
            for r in batch:  # (the batch comes back: its tasks queue again behind the urgent one)
                if r.phase == "draft":
                    s.draft_done(r, wid, [5] * r.k, {})
                else:
                    s.end_round(r, wid, [5])
                    s.start_round(r)


@pytest.mark.parametrize("urgent_priority", [-1, 2])
def test_a_busy_worker_takes_an_urgent_task_another_busy_worker_holds(urgent_priority: int) -> None:
    """Locality leaves a task held by a busy worker to it; a task more urgent than a worker would run
    otherwise waits for no one: the first worker with room takes it (its KV moves), not the less
    urgent ones of others."""
    s = Scheduler("pooled", PolicyConfig(k=4, locality=True, priority_scheduling=True))
    s.register(1, "draft", 8)
    s.register(2, "draft", 8)
    urgent, own, others = _req(0, priority=urgent_priority), _req(1, priority=2), _req(2, priority=2)
    urgent.holders["draft"] = others.holders["draft"] = (2, 3)  # worker 2 holds them and is busy
    for r in (urgent, own, others):  # (holders are set before a task is queued)
        s.admit(r)
    s.pull(1, 8, idle=False, now=0.0)  # worker 1 is busy too, prefetching
    taken = [r.rid for r in dict(s.dispatch())[1]]
    assert taken == ([0, 1] if urgent_priority < 2 else [1])  # (as urgent as the rest: left to its holder)
    if urgent_priority < 2:  # running an urgent one itself, it leaves another as urgent to its holder
        again = _req(3, priority=urgent_priority)
        again.holders["draft"] = (2, 3)
        s.admit(again)
        s.pull(1, 6, idle=False, now=1.0)
        assert dict(s.dispatch()).get(1, []) == []


def test_priority_is_checked_where_it_enters_and_a_policy_log_replays_it() -> None:
    for bad in (1.5, True, "1", MAX_PRIORITY + 1):
        with pytest.raises(InvalidParams, match="priority"):
            SamplingParams(priority=bad).validate()
    SamplingParams(priority=-MAX_PRIORITY).validate()
    s = policy_log.RecordingScheduler("pooled", PolicyConfig(k=2, priority_scheduling=True))
    s.register(1, "draft", 1)
    for r in (_req(0, 1), _req(1, 0), _req(2, -1)):
        s.admit(r)
    s.pull(1, 1, idle=True, now=0.0)
    assert [r.rid for _, b in s.dispatch() for r in b] == [2]
    report = policy_log.replay(s.records, policy_log.policy_of(s.records))
    assert report.decisions == 1 and report.identical, report.mismatches


MAX_NEW = 48


async def _contended(address: str, lows: list[list[int]], urgent: list[int], priority: int,
                     **params: object) -> tuple[list[str], dict[str, Completion]]:
    """The ``lows`` sent first, and under way, then ``urgent`` at ``priority``: the order they ended in, and
    each result."""
    order, done = [], {}
    async with AsyncClient(address) as client:
        async def one(name: str, prompt: list[int], started: asyncio.Event | None = None, **kw: object) -> None:
            async for item in client.stream(token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True, **kw):
                if started is not None:
                    started.set()
                if isinstance(item, Completion):
                    order.append(name)
                    done[name] = item
        started = asyncio.Event()  # (one low request has committed a round; one socket: the broker has them all)
        tasks = [asyncio.create_task(one(f"low{i}", p, started, **params)) for i, p in enumerate(lows)]
        await started.wait()
        await asyncio.gather(*tasks, one("urgent", urgent, priority=priority, **params))
    return order, done


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pooled", "elastic", "colocated"])
def test_an_urgent_request_overtakes_a_full_pool_with_the_same_output(tiny_pair, mode: str) -> None:  # noqa: ANN001
    """Twelve requests a worker that runs rounds sent first, on workers with room for two a batch, then
    an urgent twin of the first of them (the same prompt, parameters and length: the same rounds to
    run). With priority scheduling the twin sent last ends before the first (it joins every batch it
    can; the twelve share what is left); by arrival it would end after it. Every output is the
    target's own greedy output, and a seeded sample is the same urgent, in company, as at priority 0
    alone.

    Twelve a worker: a worker runs a batch while the next is dispatched, so a request is in at most
    every other batch, and the urgent one runs about 4x as often as each of twelve (two elastic
    workers with twelve between them: only 2x, and a head start of low0's, with a slow spell, once
    made it end first)."""
    lows = [[30 + i, 31 + i, 32 + i, 33 + i] for i in range(24 if mode == "elastic" else 12)]
    urgent = list(lows[0])
    cfg = deploy_config(tiny_pair, mode, 0 if mode == "colocated" else 1, 1, max_batch=2)
    cfg.broker.policy = cfg.broker.policy.replace(priority_scheduling=True)
    with Deployment(cfg) as dep:
        order, done = asyncio.run(_contended(dep.address, lows, urgent, priority=-5))
        sampled_order, sampled = asyncio.run(_contended(dep.address, lows, urgent, priority=-5, temperature=0.9, seed=11))
        with Client(dep.address) as client:
            alone = client.generate(token_ids=urgent, max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.9, seed=11)
            assert client.status()["queued_by_priority"] == {}  # (all done: nothing queued, at any priority)
    for ended, out in ((order, done), (sampled_order, sampled)):
        assert ended.index("urgent") < ended.index("low0"), ended
        assert out["urgent"].token_ids == out["low0"].token_ids and out["urgent"].rounds == out["low0"].rounds
    for name, prompt in (("urgent", urgent), ("low11", lows[11])):
        ref = hf_greedy(tiny_pair / "target", prompt, MAX_NEW)
        assert done[name].token_ids[:len(ref)] == ref, name
    assert sampled["urgent"].token_ids == alone.token_ids  # (the seed decides, not the priority or the company)


@pytest.mark.slow
def test_a_replayed_trace_sends_each_requests_priority_and_reports_each_priority_apart(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """Where the broker schedules by priority, every request completes and the summary has each priority
    apart; where it schedules by arrival, the two urgent requests are refused (so they were sent urgent)."""
    from click.testing import CliRunner

    from nebula_flow.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_s": 0.01 * i, "prompt_tokens": [30 + i, 31, 32], "max_new_tokens": 8,
                                           "ignore_eos": True, **({"priority": -1} if i % 4 == 0 else {})})
                               for i in range(8)))
    cfg = deploy_config(tiny_pair, "pooled", 1, 1, max_batch=2)
    cfg.broker.policy = cfg.broker.policy.replace(priority_scheduling=True)
    with Deployment(cfg) as dep:
        res = CliRunner().invoke(main, ["replay", str(trace), "--broker", dep.address, "--out", str(tmp_path / "out"),
                                        "--json"])
        plain = CliRunner().invoke(main, ["replay", str(trace), "--broker", dep.address, "--out", str(tmp_path / "o2")])
    assert res.exit_code == 0 and plain.exit_code == 0, res.output + plain.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["errors"] == 0 and {p: g["completed"] for p, g in summary["by_priority"].items()} == {"-1": 2, "0": 6}
    assert "priority   -1: 2 completed" in plain.output and "priority    0: 6 completed" in plain.output
    with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:  # (by arrival: the urgent two are refused)
        res = CliRunner().invoke(main, ["replay", str(trace), "--broker", dep.address, "--out", str(tmp_path / "o3"),
                                        "--json"])
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["errors"] == 2 and summary["by_priority"]["-1"]["completed"] == 0


@pytest.mark.slow
def test_a_priority_is_refused_where_the_broker_schedules_by_arrival(tiny_pair) -> None:  # noqa: ANN001
    """Priority scheduling off (the default, as vLLM's): a priority other than 0 is a clear error, through
    the client library and as a 400 to the real ``openai`` client, which also has an out-of-range one named."""
    import openai

    with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep, Client(dep.address) as client:
        with pytest.raises(RequestError, match="priority") as refused:
            client.generate(token_ids=[7, 8, 9], max_new_tokens=4, priority=1)
        assert refused.value.code == "invalid_params" and "queued_by_priority" not in client.status()
        assert len(client.generate(token_ids=[7, 8, 9], max_new_tokens=4, ignore_eos=True, priority=0).token_ids) == 4
        from click.testing import CliRunner

        from nebula_flow.cli import main

        cli = ["generate", "def f(x):\n    return x * 2\n" * 8, "--broker", dep.address, "--max-new-tokens", "2", "--json"]
        refused_cli = CliRunner().invoke(main, [*cli, "--priority", "2"])
        assert refused_cli.exit_code != 0 and "priority must be 0" in refused_cli.output
        cached = []  # (generate's --cache-salt: the second shares nothing with the first, the third all but its last)
        for extra in ([], ["--cache-salt", "tenant-a"], ["--priority", "0"]):
            out = CliRunner().invoke(main, [*cli, *extra])
            assert out.exit_code == 0, out.output
            cached.append(json.loads(out.output.strip().splitlines()[-1])["stats"]["cached_tokens"])
        assert cached[0] == cached[1] == 0 < cached[2], cached
        dep.start_api("127.0.0.1", 0, model_name="tiny")
        api = openai.OpenAI(base_url=dep.http_url + "/v1", api_key="none", max_retries=0, timeout=60)
        for priority, param in ((3, None), (2**40, "priority"), ("high", "priority")):
            with pytest.raises(openai.BadRequestError, match="priority") as err:
                api.completions.create(model="tiny", prompt="def f(x):", max_tokens=4, extra_body={"priority": priority})
            assert err.value.body["param"] == param
        answer = api.completions.create(model="tiny", prompt="def f(x):", max_tokens=4, extra_body={"priority": 0})
        assert answer.usage.completion_tokens >= 1
        counters = client.status()["errors"]
    assert counters.get("invalid_params", 0) >= 2, counters


@pytest.mark.slow
def test_bench_reports_urgent_requests_apart_and_sends_them_urgent_only_where_the_mode_takes_priorities(
        tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """``bench --urgent 2``: the first and third of four requests are urgent. Sent at priority -1 to
    the mode that schedules by priority and at 0 to the one that does not (which would refuse -1: the
    run would fail); both report the urgent requests' latency and the others' apart."""
    from click.testing import CliRunner

    from nebula_flow.cli import main
    from tests.conftest import tiny_config_file

    config = tiny_config_file(tiny_pair, tmp_path)
    result = CliRunner().invoke(main, ["bench", "--config", str(config), "--modes", "pooled,pooled@priority_scheduling=true",
                                       "--requests", "4", "--concurrency", "2", "--max-new-tokens", "4", "--repeats", "1",
                                       "--urgent", "2", "--json"])
    assert result.exit_code == 0, result.output
    modes = json.loads(result.output.strip().splitlines()[-1])["modes"]
    for r in modes.values():
        assert 0 < r["urgent_latency_s"]["p50"] and 0 < r["other_latency_s"]["p50"] and 0 < r["urgent_ttft_s"]["p50"]
        assert r["repeats"][0]["requests"] == 4
    refused = CliRunner().invoke(main, ["bench", "--config", str(config), "--requests", "2", "--urgent", "3"])
    assert refused.exit_code != 0 and "--urgent" in refused.output


def test_a_trace_carries_each_requests_priority(tmp_path) -> None:  # noqa: ANN001
    from nebula_flow.traces import load_trace

    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0.0, "prompt": "a", "max_new_tokens": 4, "priority": -1}\n'
                    '{"arrival_s": 0.1, "prompt": "b", "max_new_tokens": 4}\n')
    first, second = load_trace(path)
    assert first.params == {"priority": -1} and second.params == {}


@pytest.mark.parametrize("mode", ["pooled", "paired", "colocated", "elastic"])
def test_the_simulator_runs_urgent_requests_sooner_with_priority_scheduling(mode: str) -> None:
    """The simulator drives the live policy: a saturated small scenario, every fourth request urgent.
    By arrival the urgent ones wait as the rest do; by priority they end sooner and start at once,
    the others paying for it, and the same tokens are made."""
    from nebula_flow.sim.engine import simulate
    from nebula_flow.sim.scenario import Workload
    from tests.test_sim import small_scenario

    workload = Workload(requests=96, output_tokens=24, prompt_tokens=(8, 24), urgent_every=4)
    fcfs, prio = (simulate(small_scenario(priority_scheduling=on, workload=workload), mode) for on in (False, True))
    assert fcfs["tokens"] == prio["tokens"] == 96 * 24
    assert prio["urgent_latency_s"]["p50"] < 0.97 * fcfs["urgent_latency_s"]["p50"], (fcfs, prio)
    assert prio["urgent_latency_s"]["p50"] < prio["other_latency_s"]["p50"]
    assert prio["urgent_ttft_s"]["p50"] <= fcfs["urgent_ttft_s"]["p50"]


def test_a_scenario_checks_urgent_every(tmp_path) -> None:  # noqa: ANN001
    from nebula_flow.config import ConfigError
    from nebula_flow.sim.scenario import load_scenario

    path = tmp_path / "s.toml"
    path.write_text('[workload]\nrequests = 8\nurgent_every = 1\n[draft]\nprofile = "configs/profiles/qwen3-0.6b-rtx4090.json"\n'
                    '[target]\nprofile = "configs/profiles/qwen3-8b-rtx4090.json"\n')
    with pytest.raises(ConfigError, match="urgent_every"):
        load_scenario(path)


def test_simulate_urgent_prints_urgent_requests_apart() -> None:
    from click.testing import CliRunner

    from nebula_flow.cli import main

    paper = Path(__file__).resolve().parents[1] / "configs" / "sim" / "paper-2d2t.toml"
    result = CliRunner().invoke(main, ["simulate", str(paper), "--modes",
                                       "pooled,pooled@priority_scheduling=true", "--urgent", "4"])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if "urgent requests" in ln]
    assert [ln.split(":")[0] for ln in lines] == ["pooled", "pooled@priority_scheduling=true"]


def test_status_shows_queued_tasks_by_priority_summed_over_shards() -> None:
    from nebula_flow.cli.status_text import status_lines
    from nebula_flow.shards import merge_states
    from nebula_flow.topic import queued_by_priority

    s = Scheduler("pooled", PolicyConfig(k=2, priority_scheduling=True))
    for r in (_req(0, 3), _req(1, -1), _req(2, 3), _req(3, 0)):
        s.admit(r)
    queued = queued_by_priority(s.topics.values())
    assert queued == {"-1": 1, "0": 1, "3": 2} and list(queued) == ["-1", "0", "3"]
    base = {"mode": "pooled", "uptime_s": 1.0, "pool": 4, "topics": s.depth(), "workers": [], "roles": ["target"],
            "counters": {}, "errors": {}}
    merged = merge_states([{**base, "queued_by_priority": queued}, {**base, "queued_by_priority": {"-1": 2, "10": 1}}])
    assert merged["queued_by_priority"] == {"-1": 3, "0": 1, "3": 2, "10": 1}
    assert "  queued by priority: -1: 3, 0: 1, 3: 2, 10: 1" in status_lines(merged)
    assert not any("queued by priority" in line for line in status_lines(base))  # (scheduling by arrival: no line)


def test_a_full_pool_turns_away_its_least_urgent_unstarted_request_for_a_more_urgent_one() -> None:
    from nebula_flow.displace import displaced_by
    from nebula_flow.prefixes import PrefixRoutes

    s = Scheduler("pooled", PolicyConfig(k=2, priority_scheduling=True))
    s.prefixes = PrefixRoutes()
    reqs = {rid: _req(rid, priority) for rid, priority in ((0, 5), (1, 5), (2, 3), (3, 9), (4, 0))}
    for r in reqs.values():
        s.admit(r)
    assert list(s.topics["draft"].least_urgent(3)) == [3, 1, 0]  # (least urgent first, each priority's latest first)
    assert displaced_by(s, 0) is reqs[3] and displaced_by(s, 8) is reqs[3]
    reqs[3].holders = {"draft": (1, 2)}  # (its prompt's KV is computed somewhere: started, never turned away)
    assert displaced_by(s, 0) is reqs[1]
    reqs[1].output = [7]  # (started: it has output)
    assert displaced_by(s, 0) is reqs[0] and displaced_by(s, 3) is reqs[0]
    assert displaced_by(s, 5) is None and displaced_by(s, 9) is None  # (none less urgent than the new one)
    # a request waiting for another computing its prompt's start is on no topic, and not started
    late = _req(9, 7)
    s.requests[late.rid] = late
    s.prefixes.followers[4] = [(late.rid, 64)]
    assert displaced_by(s, 0) is late and displaced_by(s, 6) is late and displaced_by(s, 7) is None


def test_an_urgent_request_takes_the_place_of_the_last_queued_one_in_a_full_pool(tiny_pair) -> None:  # noqa: ANN001
    """A pool of eight with its workers frozen (what reached them is not started: their results have
    not come back), eight background requests, then an urgent one: the last background request is
    turned away (busy) and the urgent one admitted; a ninth background request is refused itself.
    Thawed, the urgent one and the seven others end with the target's own greedy output."""
    import signal

    from nebula_flow.client import Busy
    from nebula_flow.deploy import is_broker
    from nebula_flow.metrics import render

    lows = [[30 + i, 31 + i, 32 + i] for i in range(9)]
    urgent = [90, 91, 92]
    cfg = deploy_config(tiny_pair, "elastic", 1, 1, max_batch=2)
    cfg.broker.policy = cfg.broker.policy.replace(priority_scheduling=True)
    cfg.broker.max_pending = 8

    async def run(dep: Deployment, frozen: list[str]) -> tuple[dict[str, object], dict]:
        out: dict[str, object] = {}
        async with AsyncClient(dep.address) as client:
            async def one(name: str, prompt: list[int], priority: int) -> None:
                try:
                    out[name] = await client.generate(token_ids=prompt, max_new_tokens=8, ignore_eos=True,
                                                      priority=priority)
                except Busy as exc:
                    out[name] = exc
            sent = [asyncio.create_task(one(f"low{i}", p, 5)) for i, p in enumerate(lows[:8])]
            async with asyncio.timeout(60):
                while (await client.status())["pool"] < 8:  # (all eight admitted before the urgent one comes)
                    await asyncio.sleep(0.01)
                sent.append(asyncio.create_task(one("urgent", urgent, 0)))
                while not {"low7", "urgent"} & set(out):  # (an answer: the last one turned away, or the urgent refused)
                    await asyncio.sleep(0.01)
            await one("low8", lows[8], 5)  # (the pool is full of requests as urgent as it)
            for name in frozen:
                dep.kill(name, signal.SIGCONT)
            await asyncio.gather(*sent)
            return out, await client.status()

    with Deployment(cfg) as dep:
        frozen = [name for name, _ in dep.procs if not is_broker(name)]
        for name in frozen:
            dep.kill(name, signal.SIGSTOP)
        out, state = asyncio.run(run(dep, frozen))
    for name in ("low7", "low8"):
        assert isinstance(out[name], Busy), out
    assert "more urgent" in out["low7"].message and "more urgent" not in out["low8"].message
    assert out["urgent"].token_ids == hf_greedy(tiny_pair / "target", urgent, 8)
    for i in range(7):
        assert out[f"low{i}"].token_ids == hf_greedy(tiny_pair / "target", lows[i], 8), i
    assert state["counters"]["displaced"] == 1 and state["errors"]["busy"] == 2
    assert "nebula_requests_displaced_total 1.0" in render(state)
