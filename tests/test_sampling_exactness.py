"""Sampled output follows the target's distribution over whole multi-round requests, with the
live policy planning every round (adaptive k, fused prompt-lookup chains), and the
test has the power to see a plan that reads draft draws the output never showed.

Why a whole-request test: every random draw is ``uniform(seed, position, stream)``, so a draft
position rejected in one round is drafted again next round with the same uniform. Rejection
sampling stays exact only while nothing that decides the next round (its k, its drafter, whether
it drafts at all) depends on those discarded draws. The single-round tests in
``test_specdec.py`` cannot see a leak across rounds; this one runs the real broker's result
handling and scheduler, the real task encoding and the real model runners, in process.

The statistic: for an exact sampler each token is a draw from the target's distribution given
the tokens before it, so its randomized probability integral transform (tokens ordered by the
target's probability, most likely first) is uniform and independent of the past; the values of
every token of every request are i.i.d. uniform, and a chi-square test over their histogram is
exact whatever the policy did. A plan that skews drafted tokens away from (or towards) the
draft's first choice shifts mass between the bins."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from nebula_flow import protocol, specdec
from nebula_flow.deploy import free_port
from nebula_flow.options import BrokerOptions
from nebula_flow.params import SamplingParams
from nebula_flow.penalties import Penalties
from nebula_flow.policy import PolicyConfig
from nebula_flow.protocol import Register, Result, Submit, TaskResult, Tasks
from nebula_flow.scheduler import Scheduler
from nebula_flow_broker.server import Broker
from nebula_flow_broker.tasks import task_specs
from nebula_flow_workers.runner import ModelRunner
from nebula_flow_workers.tasks import runnable
from nebula_flow_workers.token_book import TokenBook
from tests.test_specdec import _tiny_vocab_model, chi2_critical, chi_square

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2]  # (a repeat: prompt-lookup chains to fuse)
PARAMS = {"temperature": 1.0, "max_new_tokens": 12}
BATCH = 1000  # tasks per worker batch (a TASKS message's header stays small)


def serve_in_process(n: int, policy: PolicyConfig, plant: Callable[[Scheduler], None] | None = None,
                     params: dict | None = None) -> tuple[list[list[int]], Broker]:
    """``n`` seeded sampled requests through a broker and one draft and one target worker, all in
    this process: the broker's own result handling and policy, tasks encoded and decoded as on
    the wire, the worker's runners. The target is the tiny-vocabulary model; the draft is the same
    model, so most drafts are accepted and a skewed draft would show in the output."""
    runners = {b"d": ModelRunner(_tiny_vocab_model(1, 2), proposal_top_k=4),
               b"t": ModelRunner(_tiny_vocab_model(1, 2), proposal_top_k=4)}
    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port(), policy=policy,
                                  max_pending=n, max_inflight_per_client=n))
    broker.bind()
    if plant is not None:
        plant(broker.scheduler)
    try:
        for identity, role in ((b"d", "draft"), (b"t", "target")):
            broker.on_worker(identity, protocol.encode(Register(role, role, BATCH, {})), 0.0)
        for i in range(n):
            broker.on_client(b"c", protocol.encode(Submit(f"r{i}", dict(params or PARAMS, seed=i),
                                                          prompt_tokens=np.array(PROMPT, np.int32))), 0.0)
        requests = list(broker.scheduler.requests.values())
        assert len(requests) == n
        now, books = 1.0, {identity: TokenBook() for identity in runners}  # (each worker's: tasks carry new tokens)
        while broker.scheduler.requests:
            for identity, runner in runners.items():
                broker.scheduler.pull(broker.by_identity[identity], BATCH, True, now)
                for wid, batch in broker.scheduler.dispatch():
                    specs = task_specs(broker.scheduler, wid, batch, broker.workers)
                    tasks = [runnable(s, VOCAB, books[identity]) for s in protocol.decode(protocol.encode(Tasks(specs))).tasks]
                    broker.on_worker(identity, protocol.encode(Result(run_tasks(runner, tasks))), now)
                    now += 1.0
        assert not broker.errors, broker.errors
    finally:
        broker.clients.close()
        broker.peers.close()
    return [r.output for r in requests], broker


def run_tasks(runner: ModelRunner, tasks: list) -> list[TaskResult]:
    """What a worker's batch loop sends back for draft or verify tasks."""
    outs = [TaskResult(t.rid, t.kind, t.round, t.attempt) for t in tasks]
    if tasks[0].kind == "draft":
        for out, d in zip(outs, runner.draft(tasks)):
            out.draft, out.runner_ups, out.chains = d.tokens, d.runner_ups, d.chains
            out.propose(d.q_idx, d.q_prob)
    else:
        for out, t, committed in zip(outs, tasks, runner.verify(tasks)):
            out.committed = committed
            if t.chains and not t.draft:  # (a chain the target looked up itself)
                out.chains = t.chains
    return outs


def transforms(outputs: list[list[int]], seed: int = 0, raw: dict | None = None) -> np.ndarray:
    """Each output token's randomized probability integral transform under the target's own
    distribution given the tokens before it (tokens ordered most likely first; with penalties,
    the penalized distribution at each position): i.i.d. uniform for an exact sampler."""
    target = _tiny_vocab_model(1, 2)
    params = SamplingParams(**(raw or PARAMS))
    rng = np.random.default_rng(seed)
    values = []
    with torch.no_grad():
        for out in outputs:
            logits = target([target.new_cache()], [PROMPT + out[:-1]], [len(out)])[0]
            if params.penalized:
                logits = torch.stack([Penalties(params, np.array(PROMPT + out[:j]), len(PROMPT)).row(row, [])
                                      for j, row in enumerate(logits)])
            for p, token in zip(specdec.target_probs(logits, params).numpy(), out):
                order = np.argsort(-p, kind="stable")
                before = p[order[:int(np.flatnonzero(order == token)[0])]].sum()
                values.append(before + rng.random() * p[token])
    return np.array(values)


def first_choice_decides_the_next_k(scheduler: Scheduler) -> None:
    """A planted leak: the next round's plan reads the draft token drawn (and discarded) at the
    position that round drafts again. Drafting goes on only where that draw missed the draft's
    first choice, so the uniform reused there is skewed."""
    recorded = scheduler.verify_done

    def verify_done(req, worker_id, accepted, *args, **kwargs) -> None:  # noqa: ANN001
        recorded(req, worker_id, accepted, *args, **kwargs)
        discarded = accepted + 1  # (the draft position after the rejected one: next round's first)
        if req.q and discarded < len(req.draft):
            first = int(req.q["q_idx"][sum(req.q["q_len"][:discarded])])
            req.acceptance.accepted = 0.0 if req.draft[discarded] == first else 50.0

    scheduler.verify_done = verify_done


def uniformity(values: np.ndarray, bins: int = 5) -> float:
    counts = np.histogram(values, bins=bins, range=(0.0, 1.0))[0].astype(float)
    return chi_square(counts, np.full(bins, 1.0 / bins))


@pytest.mark.parametrize("planted", [False, True], ids=["live-policy", "planted-leak"])
def test_multi_round_sampling_follows_the_target_and_the_test_sees_a_leak(planted: bool) -> None:
    """2,000 seeded requests of 12 tokens at temperature 1, the live policy choosing each round's
    k and fused chain: the tokens' transforms are uniform (p = 0.001, seeds fixed).
    The same run with a plan that reads discarded draws fails the same test: its power."""
    policy = PolicyConfig(k=4, adaptive_k=True, fuse_ngram=4)
    outputs, broker = serve_in_process(2000, policy, first_choice_decides_the_next_k if planted else None)
    assert all(len(out) == PARAMS["max_new_tokens"] for out in outputs)
    counters = broker.stats.counters
    # drafts were rejected (and their positions drafted again), chains were fused, and won
    assert 0 < sum(broker.stats.accepted_by_position) < sum(broker.stats.proposed_by_position), counters
    assert counters["fused_chains"] > 1000 and counters["fused_rounds_won"] > 10, counters
    statistic, critical = uniformity(transforms(outputs)), chi2_critical(4)
    if planted:
        assert statistic > 1.5 * critical, statistic
    else:
        assert statistic < critical, statistic


def test_min_p_sampling_follows_the_cut_target() -> None:
    """The same test with vLLM's min-p: the draft proposes from its whole distribution, the target's
    is cut to the tokens at least ``min_p`` times as likely as its best, and the output follows the
    cut one exactly (and not the uncut one: the test sees the difference)."""
    raw = {**PARAMS, "min_p": 0.5}
    outputs, broker = serve_in_process(2000, PolicyConfig(k=4, fuse_ngram=4), params=raw)
    assert 0 < sum(broker.stats.accepted_by_position) < sum(broker.stats.proposed_by_position)
    assert uniformity(transforms(outputs, raw=raw)) < chi2_critical(4)
    assert uniformity(transforms(outputs)) > 2 * chi2_critical(4)


def test_penalized_sampling_follows_the_penalized_target() -> None:
    """The same test with presence, frequency and repetition penalties: the draft (the same model,
    unpenalized) proposes from another distribution than the penalized target's, which every row
    of a verify (each with its own path's tokens counted) must still follow exactly."""
    raw = {**PARAMS, "presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.5}
    outputs, broker = serve_in_process(2000, PolicyConfig(k=4, fuse_ngram=4), params=raw)
    assert 0 < sum(broker.stats.accepted_by_position) < sum(broker.stats.proposed_by_position)
    assert uniformity(transforms(outputs, raw=raw)) < chi2_critical(4)
    # (and the penalties matter here: the unpenalized distribution does not fit these outputs)
    assert uniformity(transforms(outputs)) > 2 * chi2_critical(4)
