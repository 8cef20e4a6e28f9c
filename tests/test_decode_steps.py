"""Multi-step decoding (``nebula_flow/steps.py``): in autoregressive mode a round's verify decodes
several tokens, one forward each, for a request alone in the broker's pool. Output stays the target's
own, greedy and seeded-sampled, whatever the steps; a stop token ends it mid-steps; the broker
refuses a result with more tokens than the steps it asked for."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nebula_flow.client import Client
from nebula_flow.deploy import Deployment
from nebula_flow.models.loader import load_model
from nebula_flow.params import SamplingParams
from nebula_flow.protocol import Holder, ProtocolError, TaskResult, TaskSpec
from nebula_flow.request import Request
from nebula_flow.sim.engine import simulate
from nebula_flow.sim.scenario import HostCosts, Workload
from nebula_flow.steps import decode_steps
from nebula_flow_broker import results
from nebula_flow_workers.runner import ModelRunner, Task
from tests.conftest import deploy_config, hf_greedy
from tests.test_sim import small_scenario

PROMPTS = [[(5 * i + 3 * j) % 400 + 7 for j in range(n)] for i, n in enumerate((6, 23, 11))]
NEW = 18


def test_a_verify_decodes_several_tokens_only_alone_and_where_no_rule_is_kept() -> None:
    plain = SamplingParams(max_new_tokens=50)
    assert decode_steps(4, "autoregressive", 1, 50, plain) == 4
    assert decode_steps(4, "autoregressive", 1, 3, plain) == 3  # (never past max_new_tokens)
    assert decode_steps(4, "autoregressive", 2, 50, plain) == 1  # another request in the pool
    assert decode_steps(1, "autoregressive", 1, 50, plain) == 1  # the knob off
    assert decode_steps(4, "autoregressive", 1, 50, plain, first=True) == 1  # the prefill's round: its token at once
    for mode in ("pooled", "paired", "colocated", "elastic"):  # speculation replans every round
        assert decode_steps(4, mode, 1, 50, plain) == 1
    for kept in (SamplingParams(presence_penalty=0.5), SamplingParams(min_tokens=3), SamplingParams(logprobs=2),
                 SamplingParams(logit_bias={"5": 1.0})):  # rules the broker keeps per token, or per-token logprobs
        assert decode_steps(4, "autoregressive", 1, 50, kept) == 1


def test_steps_travel_only_on_a_draft_less_verify_or_round() -> None:
    def task(kind: str, draft: list[int], steps: int) -> TaskSpec:
        return TaskSpec(1, kind, 1, 0, np.arange(1, 5, dtype=np.int32), 0, {}, 0, Holder(), draft=draft, steps=steps)

    task("verify", [], 8).check()
    task("round", [], 2).check()
    for bad in (task("verify", [3], 2), task("draft", [], 2), task("verify", [], 0), task("verify", [], 65)):
        with pytest.raises(ProtocolError):
            bad.check()


def test_the_broker_refuses_more_tokens_than_the_steps_it_asked_for() -> None:
    req = Request(1, "r", [1, 2, 3], SamplingParams(max_new_tokens=10), 0, phase="verify")
    req.steps = 3
    assert results.verified(req, TaskResult(1, "verify", 1, 0, committed=[4, 5, 6])).committed == [4, 5, 6]
    with pytest.raises(ProtocolError):
        results.verified(req, TaskResult(1, "verify", 1, 0, committed=[4, 5, 6, 7]))
    req.steps = 1  # one token a round: a draft-less verify commits exactly one
    with pytest.raises(ProtocolError):
        results.verified(req, TaskResult(1, "verify", 1, 0, committed=[4, 5]))


def _run(pair, steps: int, stop: int) -> list:  # noqa: ANN001
    """The requests one after another (each alone in the pool) on one target worker."""
    cfg = deploy_config(pair, "autoregressive", 0, 1, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(decode_steps=steps)
    with Deployment(cfg) as dep, Client(dep.address, timeout_s=120) as client:
        outs = [client.generate(token_ids=p, max_new_tokens=NEW) for p in PROMPTS]
        outs.append(client.generate(token_ids=PROMPTS[0], max_new_tokens=NEW, stop_token_ids=[stop]))
        outs += [client.generate(token_ids=p, max_new_tokens=NEW, temperature=0.9, seed=11 + i)
                 for i, p in enumerate(PROMPTS)]
    return outs


@pytest.mark.slow
def test_multi_step_decoding_is_the_target_s_own_output_greedy_and_seeded(tiny_pair) -> None:  # noqa: ANN001
    refs = [hf_greedy(tiny_pair / "target", p, NEW) for p in PROMPTS]
    stop_at = 6  # a stop token id in the middle of a round's steps (the first output's 7th token, first seen there)
    while refs[0][stop_at] in refs[0][:stop_at]:
        stop_at += 1
    stop = refs[0][stop_at]
    one, four = _run(tiny_pair, 1, stop), _run(tiny_pair, 4, stop)
    for outs in (one, four):
        assert [o.token_ids for o in outs[:3]] == refs
        assert outs[3].token_ids == refs[0][:stop_at + 1] and outs[3].finish_reason == "stop"
    assert [o.token_ids for o in four[4:]] == [o.token_ids for o in one[4:]]  # seeded samples: the same draws
    assert len({tuple(o.token_ids) for o in one[4:]}) == 3
    assert all(o.rounds == len(o.token_ids) for o in one)
    # the first round one token (the prefill's), then four a round
    assert [o.rounds for o in four[:4]] == [1 + -(-(len(o.token_ids) - 1) // 4) for o in four[:4]]


def test_the_simulator_decodes_several_steps_with_the_live_policy() -> None:
    """Single stream in the simulator: the same tokens in about a quarter of the rounds (the first,
    the prefill's, one token), each round's message hops paid once for four forwards."""
    sc = small_scenario(workload=Workload(requests=6, output_tokens=24, prompt_tokens=(8, 8), concurrency=1),
                        host=HostCosts(message_latency_us=500.0))
    one, four = (simulate(replace(sc, policy=sc.policy.replace(decode_steps=n)), "autoregressive", 0, 1) for n in (1, 4))
    assert one["tokens"] == four["tokens"] == 6 * 24
    assert one["tokens_per_round"] == 1.0 and four["tokens_per_round"] == pytest.approx(24 / 7)  # (1 + 6 rounds)
    assert four["tokens_per_s"] > 1.05 * one["tokens_per_s"]


def test_the_runner_s_steps_are_its_single_verifies_and_a_failed_step_ends_them(tiny_pair, monkeypatch) -> None:  # noqa: ANN001
    """In one runner: a task of 5 steps commits what 5 verifies of a token each commit; a step that
    fails alone (its grammar, say) stops the decode there, with the tokens before it kept."""
    runner = ModelRunner(load_model(str(tiny_pair / "target")))
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    tokens = np.asarray(PROMPTS[1], dtype=np.int64)
    one_by_one = []
    for r in range(5):
        one_by_one += runner.verify([Task(1, "verify", r, 0, np.concatenate([tokens, one_by_one]).astype(np.int64), 0,
                                          params, 0)])[0]
    assert runner.verify([Task(2, "verify", 0, 0, tokens, 0, params, 0, steps=5)])[0] == one_by_one
    calls, verify_once = [], runner._verify

    def failing_third(tasks, ends=None):  # noqa: ANN001, ANN202
        calls.append(1)
        return [None] * len(tasks) if len(calls) == 3 else verify_once(tasks, ends)

    monkeypatch.setattr(runner, "_verify", failing_third)
    assert runner.verify([Task(3, "verify", 0, 0, tokens, 0, params, 0, steps=5)])[0] == one_by_one[:2]
    assert len(calls) == 3
