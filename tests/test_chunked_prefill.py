"""Chunked prefill: a forward computes at most ``max_forward_tokens`` new tokens; long prompts
are prefilled in chunks beside the other requests' rows. Output stays lossless and seeded
sampling placement-independent; the simulator and the broker run the same policy."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nebula_flow import policy_log
from nebula_flow.client import AsyncClient, Client
from nebula_flow.deploy import Deployment
from nebula_flow.sim.engine import Simulator
from nebula_flow.sim.scenario import Workload
from tests.conftest import _hf_model, deploy_config, hf_greedy
from tests.test_sim import small_scenario

BUDGET = 16


def long_prompts() -> list[list[int]]:
    """Prompts of 40-150 tokens (the tiny pair's vocabulary), beside short ones."""
    return [[(7 * i + 3 * j) % 480 + 5 for j in range(n)] for i, n in enumerate((3, 150, 40, 97, 5, 64))]


async def _generate(address: str, reqs: list[dict], beside_a_stream: bool = False) -> list:
    """``reqs`` at once; ``beside_a_stream``: sent while another request's output streams (a chunk
    is there to keep such streams flowing: with none, every prompt prefills whole), which is
    cancelled once they are done."""
    async with AsyncClient(address, timeout_s=120) as client:
        if not beside_a_stream:
            return await asyncio.gather(*(client.generate(**r) for r in reqs))
        stream = client.stream(token_ids=[9, 8, 7], max_new_tokens=400, ignore_eos=True)
        await anext(stream)  # (its first tokens: a stream flows)
        try:
            return await asyncio.gather(*(client.generate(**r) for r in reqs))
        finally:
            await stream.aclose()


def _requests() -> list[dict]:
    greedy = [{"token_ids": p, "max_new_tokens": 20} for p in long_prompts()]
    sampled = [{"token_ids": p, "max_new_tokens": 16, "temperature": 0.8, "seed": 50 + i}
               for i, p in enumerate(long_prompts()[:3])]
    return greedy + sampled


def unchunked(pair, mode: str) -> list:  # noqa: ANN001
    """The same requests without a budget (seeded sampling draws as the mode does: autoregressive
    samples the target alone, the speculative modes through the draft)."""
    with Deployment(deploy_config(pair, mode, 1, 1, max_batch=4)) as dep:
        return asyncio.run(_generate(dep.address, _requests()))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pooled", "colocated", "autoregressive"])
def test_chunked_prefill_is_lossless_and_placement_independent(tiny_pair, mode: str, tmp_path) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, mode, 1, 1, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(max_forward_tokens=BUDGET)
    cfg.broker.policy_log = str(tmp_path / "policy.jsonl")
    with Deployment(cfg) as dep:
        outs = asyncio.run(_generate(dep.address, _requests(), beside_a_stream=True))
        with Client(dep.address) as c:
            counters = c.status()["counters"]
    prompts = long_prompts()
    for i, out in enumerate(outs[:len(prompts)]):
        assert out.token_ids == hf_greedy(tiny_pair / "target", prompts[i], 20), f"request {i} differs in {mode}"
    # seeded sampling: the same tokens as without chunks
    assert [o.token_ids for o in outs[len(prompts):]] == [o.token_ids for o in unchunked(tiny_pair, mode)[len(prompts):]]
    # the 150-token prompt needed ceil(149 / 16) forwards at least: chunks really ran
    assert counters.get("prefill_chunks", 0) >= 149 // BUDGET, counters
    records = policy_log.load(cfg.broker.policy_log)
    assert any(r[0] == "prefilled" for r in records)
    report = policy_log.replay(records, policy_log.policy_of(records))
    assert report.identical, report.mismatches[:3]


@pytest.mark.parametrize("mode", ["pooled", "elastic"])
def test_a_request_alone_in_the_pool_prefills_whole(tiny_pair, mode: str) -> None:  # noqa: ANN001
    """A chunk keeps other requests' streams flowing; with none in the pool a long prompt's
    prefill runs in one forward (chunking it only added forwards and round trips), losslessly;
    the same prompts sent while a stream flows are chunked, and a burst of them without one is
    lossless too. (Which of a live burst's tasks go out before another's output begins is timing:
    the rule itself is checked in ``test_tasks_go_out_whole_until_an_output_begins``.)"""
    cfg = deploy_config(tiny_pair, mode, 1, 1, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(max_forward_tokens=BUDGET)
    prompt, burst = long_prompts()[1], [{"token_ids": p, "max_new_tokens": 20} for p in long_prompts()[1:4]]
    with Deployment(cfg) as dep, Client(dep.address) as c:
        out = c.generate(token_ids=prompt, max_new_tokens=20)
        alone = c.status()["counters"].get("prefill_chunks", 0)
        outs = asyncio.run(_generate(dep.address, burst))
        burst_chunks = c.status()["counters"].get("prefill_chunks", 0) - alone
        salted = [{**r, "cache_salt": "another"} for r in burst]  # (not from the prefix cache: computed again)
        beside = asyncio.run(_generate(dep.address, salted, beside_a_stream=True))
        chunks_beside = c.status()["counters"].get("prefill_chunks", 0) - alone - burst_chunks
    assert out.token_ids == hf_greedy(tiny_pair / "target", prompt, 20)
    assert [o.token_ids for o in outs] == [o.token_ids for o in beside] == [
        hf_greedy(tiny_pair / "target", r["token_ids"], 20) for r in burst]
    assert len(prompt) > BUDGET and alone == 0 and chunks_beside >= (len(prompt) - 1) // BUDGET


def test_tasks_go_out_whole_until_an_output_begins() -> None:
    """The broker's rule (``budget.prefills_whole``, through the scheduler's count of the pool's
    requests whose output has begun): every task goes out ``alone`` while no output has begun,
    none once one has, and again once that request has left the pool; none while the pool holds
    more requests than the verifying workers batch at once (a burst at saturation: chunks let the
    short prompts' streams begin first)."""
    from nebula_flow.params import SamplingParams
    from nebula_flow.policy import PolicyConfig
    from nebula_flow.request import Request
    from nebula_flow.scheduler import Scheduler
    from nebula_flow_broker.tasks import task_specs

    s = Scheduler("autoregressive", PolicyConfig(max_forward_tokens=BUDGET))
    s.register(1, "target", 3)
    reqs = [Request(i, str(i), long_prompts()[i], SamplingParams(max_new_tokens=4), seed=i) for i in (1, 2, 3)]
    for r in reqs:
        s.admit(r)

    def sent() -> list:
        s.pull(1, 2, True, 0.0)  # (two at a time, of the three slots it has)
        batch = dict(s.dispatch())[1]
        return [(r.rid, t.alone) for r, t in zip(batch, task_specs(s, 1, batch, {}))]

    assert sent() == [(1, True), (2, True)] and s.streaming == 0  # (a burst: no output yet)
    s.end_round(reqs[0], 1, [7])  # (request 1's first token)
    s.end_round(reqs[1], 1, [7])
    assert s.streaming == 2 and sent() == [(1, False), (2, False)]  # (their KV's worker: their next rounds first)
    s.finish(1)
    s.finish(2)  # (both end: no output flows)
    assert s.streaming == 0 and sent() == [(3, True)]
    more = Scheduler("autoregressive", PolicyConfig(max_forward_tokens=BUDGET))
    more.register(1, "target", 2)  # (three requests over two slots: the third waits behind the batch)
    for r in [Request(i, str(i), long_prompts()[i], SamplingParams(max_new_tokens=4), seed=i) for i in (1, 2, 3)]:
        more.admit(r)
    more.pull(1, 2, True, 0.0)
    batch = dict(more.dispatch())[1]
    assert [t.alone for t in task_specs(more, 1, batch, {})] == [False, False]


def test_a_burst_goes_out_alone_until_every_output_of_it_began() -> None:
    """While a burst's request has not begun its output, every task sent beside it goes out alone
    (``budget.sends_alone``), its first streams' rounds and later arrivals too, so the forward keeps
    the burst's budget; once the burst's outputs have all begun, tasks go out as before: chunked
    while a stream flows."""
    from nebula_flow.params import SamplingParams
    from nebula_flow.policy import PolicyConfig
    from nebula_flow.request import Request
    from nebula_flow.scheduler import Scheduler
    from nebula_flow_broker.tasks import task_specs

    s = Scheduler("autoregressive", PolicyConfig(max_forward_tokens=BUDGET, max_burst_tokens=64))
    s.register(1, "target", 3)
    first, second, later = (Request(i, str(i), long_prompts()[i], SamplingParams(max_new_tokens=4), seed=i)
                            for i in (1, 2, 3))

    def sent() -> list:
        s.pull(1, 3, True, 0.0)
        batch = dict(s.dispatch())[1]
        return sorted((r.rid, t.alone) for r, t in zip(batch, task_specs(s, 1, batch, {})))

    s.admit(first)
    s.admit(second)
    assert sent() == [(1, True), (2, True)]  # (a burst)
    s.end_round(first, 1, [7])  # (its first token: a stream flows)
    s.prefilled(second, 1, 64)  # (a chunk of the other's prompt: it goes back for the rest)
    s.admit(later)
    assert s.streaming == 1 and sent() == [(1, True), (2, True), (3, True)]
    s.end_round(first, 1, [7])
    s.end_round(second, 1, [7])
    assert not later.burst and sent() == [(1, False), (2, False)]  # (the burst's outputs began: chunked beside them)


def test_a_forward_of_tasks_all_alone_has_the_burst_budget() -> None:
    from nebula_flow.budget import alone, forward_budget, prefills_whole
    from nebula_flow.roles import WorkerState

    assert alone(1) and not alone(2)
    workers = [WorkerState(1, "draft", 0, 64), WorkerState(2, "target", 0, 4), WorkerState(3, "any", 1, 2)]
    assert prefills_whole(1, 1, workers) and prefills_whole(6, 0, workers) and not prefills_whole(6, 1, workers)
    assert not prefills_whole(7, 0, workers)  # (more requests than the verifiers' 6 slots; drafts' not counted)
    # no burst budget: a forward of tasks all alone has none
    assert forward_budget(16, 0, [True]) == forward_budget(16, 0, [True, True]) == 0
    assert forward_budget(16, 0, [True, False]) == forward_budget(16, 0, [False]) == forward_budget(16, 0, []) == 16
    # with one: a forward of tasks all alone has it, never less than the plain budget
    assert forward_budget(16, 1024, [True]) == forward_budget(16, 1024, [True, True]) == 1024
    assert forward_budget(16, 1024, [False, True]) == forward_budget(16, 1024, [False]) == forward_budget(16, 1024, []) == 16
    assert forward_budget(16, 8, [True]) == 16 and forward_budget(0, 1024, [True]) == 0  # (0: no bound at all)


@pytest.mark.parametrize("mode", ["pooled", "paired", "colocated", "autoregressive", "elastic"])
def test_a_burst_prefills_within_its_budget_losslessly(tiny_pair, mode: str) -> None:  # noqa: ANN001
    """With ``max_burst_tokens``, a lone long prompt and a burst of prompts sent while no stream
    flows (fewer than a worker batches at once) prefill in chunks of that budget (not whole), with
    the target's own greedy output and seeded sampling drawing the same tokens as without chunks."""
    cfg = deploy_config(tiny_pair, mode, 1, 1, max_batch=16)
    cfg.broker.policy = cfg.broker.policy.replace(max_forward_tokens=BUDGET, max_burst_tokens=64)
    prompt = long_prompts()[1]
    with Deployment(cfg) as dep, Client(dep.address) as c:
        out = c.generate(token_ids=prompt, max_new_tokens=20)
        lone = c.status()["counters"].get("prefill_chunks", 0)
        outs = asyncio.run(_generate(dep.address, [{**r, "cache_salt": "burst"} for r in _requests()]))
    assert out.token_ids == hf_greedy(tiny_pair / "target", prompt, 20)
    assert (len(prompt) - 1) // 64 <= lone < (len(prompt) - 1) // BUDGET  # (chunks of the burst's budget)
    prompts = long_prompts()
    assert [o.token_ids for o in outs[:len(prompts)]] == [hf_greedy(tiny_pair / "target", p, 20) for p in prompts]
    assert [o.token_ids for o in outs[len(prompts):]] == [o.token_ids for o in unchunked(tiny_pair, mode)[len(prompts):]]


@pytest.mark.parametrize("mode", ["pooled", "colocated", "autoregressive"])
def test_the_simulator_prefills_in_chunks_with_the_live_policy(mode: str) -> None:
    # (submissions 50 ms apart: prompts arrive beside flowing streams, which chunks are there for)
    wl = Workload(requests=12, output_tokens=32, prompt_tokens=(8, 2000), concurrency=6, submit_gap_us=50_000)
    base = small_scenario(workload=wl)
    chunked = small_scenario(workload=wl, max_forward_tokens=256)
    sim = Simulator(chunked, mode, policy=policy_log.RecordingScheduler)
    res = sim.run()
    assert res["requests"] == 12 and res["tokens"] == 12 * 32
    chunks = [r for r in sim.policy.records if r[0] == "prefilled"]
    assert chunks and all(0 <= r[3] < 2000 for r in chunks) and max(r[3] for r in chunks) > 256  # (0: it waited)
    assert policy_log.replay(sim.policy.records, policy_log.policy_of(sim.policy.records)).identical
    plain = Simulator(base, mode, policy=policy_log.RecordingScheduler)
    plain.run()
    assert not any(r[0] == "prefilled" for r in plain.policy.records)
    # one request at a time: each alone in the pool, so each prefills whole, as live
    single = small_scenario(workload=Workload(requests=4, output_tokens=8, prompt_tokens=(1500, 2000), concurrency=1),
                            max_forward_tokens=256)
    lone = Simulator(single, mode, policy=policy_log.RecordingScheduler)
    assert lone.run()["requests"] == 4 and not any(r[0] == "prefilled" for r in lone.policy.records)
    # a burst, all at once: no stream flows beside their prompts, so each prefills whole, as live
    burst = small_scenario(workload=Workload(requests=6, output_tokens=8, prompt_tokens=(8, 2000), concurrency=6),
                           max_forward_tokens=256)
    together = Simulator(burst, mode, policy=policy_log.RecordingScheduler)
    assert together.run()["requests"] == 6 and not any(r[0] == "prefilled" for r in together.policy.records)
    # ... and with a burst budget, in chunks of it, smallest prompts first, as live
    bounded = Simulator(small_scenario(workload=burst.workload, max_forward_tokens=256, max_burst_tokens=512), mode,
                        policy=policy_log.RecordingScheduler)
    assert bounded.run()["requests"] == 6 and any(r[0] == "prefilled" for r in bounded.policy.records)
    assert policy_log.replay(bounded.policy.records, policy_log.policy_of(bounded.policy.records)).identical


@pytest.mark.slow
def test_prompt_logprobs_come_whole_through_chunks_and_never_from_the_prefix_cache(tiny_pair) -> None:  # noqa: ANN001
    """A request asking for its prompt's logprobs (``prompt_logprobs``) prefilled in chunks gets
    every prompt position's, the target's own, although the worker holds the same prompt's KV in
    its prefix cache (such a request computes its prompt, which a twin that does not ask copies)."""
    prompt, short = long_prompts()[3], long_prompts()[0]
    cfg = deploy_config(tiny_pair, "pooled", 1, 1, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(max_forward_tokens=BUDGET)
    with Deployment(cfg) as dep:
        first = asyncio.run(_generate(dep.address, [{"token_ids": prompt, "max_new_tokens": 4}]))[0]
        with Client(dep.address) as c:
            chunks_before = c.status()["counters"].get("prefill_chunks", 0)
        _, scored, twin = asyncio.run(_generate(dep.address, [
            {"token_ids": short, "max_new_tokens": 20},
            {"token_ids": prompt, "max_new_tokens": 20, "prompt_logprobs": 1},
            {"token_ids": prompt + [7], "max_new_tokens": 4}], beside_a_stream=True))
        with Client(dep.address) as c:
            chunks = c.status()["counters"].get("prefill_chunks", 0) - chunks_before
    assert first.prompt_logprobs is None and first.stats["cached_tokens"] == 0
    assert scored.stats["cached_tokens"] == 0 and twin.stats["cached_tokens"] > 0
    assert chunks >= (len(prompt) - 1) // BUDGET, chunks  # (the scored prompt ran in chunks)
    assert scored.token_ids == hf_greedy(tiny_pair / "target", prompt, 20)
    with torch.no_grad():
        ref = torch.log_softmax(_hf_model(str(tiny_pair / "target"))(torch.tensor([prompt])).logits[0].float(), -1)
    entries = scored.prompt_logprobs
    assert [e[0] for e in entries] == prompt and entries[0][2] is None
    mine = torch.tensor([e[2] for e in entries[1:]])
    assert torch.allclose(mine, ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4)
    assert [e[3][0][0] for e in entries[1:]] == ref[:-1].argmax(-1).tolist()
