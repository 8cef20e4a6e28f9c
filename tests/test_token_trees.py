"""Fusion of drafts into one token tree: a prompt-lookup chain verified beside each model draft
(``fuse_ngram``), checked by the policy, the broker and the worker, and end to end with real
processes (greedy output equal to HF transformers, KV of a won chain moved and pulled)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from nebula_flow import protocol
from nebula_flow.client import AsyncClient, Client
from nebula_flow.deploy import Deployment
from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.protocol import ProtocolError, Rejected, Result, TaskResult, TaskSpec
from nebula_flow.request import DRAFT, VERIFY, Request
from nebula_flow.scheduler import Scheduler
from nebula_flow.speclen import Acceptance
from nebula_flow.tree import TokenTree
from nebula_flow_broker import results
from nebula_flow_workers.runner import fused_ngram
from tests.conftest import deploy_config, hf_greedy


def test_the_fused_chain_is_the_lookup_and_a_prefix_of_the_draft_adds_no_row() -> None:
    tokens = np.array([4, 5, 6, 7, 9, 4, 5])
    assert fused_ngram(tokens, 3) == [6, 7, 9]
    assert fused_ngram(np.array([1, 2, 3]), 3) == []  # no match
    draft = [6, 7, 9, 1]
    assert len(TokenTree([draft, fused_ngram(tokens, 3)])) == len(draft)  # (the tree shares its nodes)


def test_the_next_round_is_planned_from_committed_tokens_alone() -> None:
    """Sampling exactness: two rounds that commit the same tokens but whose drafts differ after
    the rejected position (tokens the output never shows, drawn with uniforms that the same
    positions use again next round) must leave the policy in the same state. A chain dropped
    for being a prefix of the whole draft, rejected tokens included, made them differ."""
    from nebula_flow.deploy import free_port
    from nebula_flow_broker.server import Broker, BrokerOptions

    context = [4, 5, 6, 7, 9, 4, 5]  # (a repeat: the lookup's chain is 6 7 9)
    states = []
    for rejected_tail in ([7, 9], [8, 8]):  # the first makes the chain a prefix of the draft
        policy = PolicyConfig(k=3, fuse_ngram=3)  # (the acceptance state compared below is what adaptive k reads)
        broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port(), policy=policy))
        broker.bind()
        try:
            broker.on_worker(b"d", protocol.encode(protocol.Register("draft", "d", 4, {})), 0.0)
            broker.on_worker(b"t", protocol.encode(protocol.Register("target", "t", 4, {})), 0.0)
            broker.on_client(b"c", protocol.encode(protocol.Submit(
                "r", {"max_new_tokens": 50, "temperature": 1.0, "seed": 3},
                prompt_tokens=np.array(context, np.int32))), 0.0)
            broker.scheduler.pull(broker.by_identity[b"d"], 4, True, 0.0)
            [(_, [req])] = broker.scheduler.dispatch()
            draft = [6, *rejected_tail]
            assert req.k == len(draft) and req.fuse == 3
            out = TaskResult(req.rid, req.phase, req.round, req.attempt, draft=draft,
                             chains=[fused_ngram(np.array(context), req.fuse)])  # (what the draft worker sends)
            out.propose([np.array([t, 1], np.int32) for t in draft], [np.array([0.5, 0.5], np.float32)] * len(draft))
            broker.on_worker(b"d", protocol.encode(Result([out])), 1.0)
            broker.scheduler.pull(broker.by_identity[b"t"], 4, True, 1.0)
            [(_, [req])] = broker.scheduler.dispatch()
            # the target accepts 6 and rejects the next draft token, committing its own 3
            verify = TaskResult(req.rid, req.phase, req.round, req.attempt, committed=[6, 3])
            broker.on_worker(b"t", protocol.encode(Result([verify])), 2.0)
            assert not broker.errors, broker.errors
            states.append((req.k, req.fuse, req.acceptance, req.output))
        finally:
            broker.clients.close()
            broker.peers.close()
    assert states[0] == states[1]


def test_the_policy_fuses_rounds_with_drafts_and_counts_the_draft_by_its_own_tokens() -> None:
    s = Scheduler("pooled", PolicyConfig(k=3, fuse_ngram=5))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    greedy = Request(1, "a", [1, 2, 3], SamplingParams(max_new_tokens=20), seed=1)
    sampled = Request(2, "b", [1, 2, 3], SamplingParams(max_new_tokens=20, temperature=1.0), seed=2)
    last = Request(3, "c", [1, 2, 3], SamplingParams(max_new_tokens=1), seed=3)  # one token left: no draft
    for r in (greedy, sampled, last):
        s.admit(r)
    assert (greedy.fuse, sampled.fuse, last.fuse) == (5, 5, 0)
    s.pull(1, 4, True, 0.0)
    [(_, batch)] = s.dispatch()
    assert {r.rid for r in batch} == {1, 2}
    s.draft_done(greedy, 1, [7, 8, 9], {})
    greedy.chains = [[7, 6, 5, 4, 3]]
    assert greedy.phase == VERIFY and s.task_holder_key(greedy) == "target"
    s.pull(2, 4, True, 0.0)
    s.dispatch()
    # the fused chain won 4 tokens; the draft had 1 of them: its KV is good for one, and its
    # acceptance is 1 of 3
    s.verify_done(greedy, 2, accepted=4, draft_accepted=1)
    assert greedy.holders["draft"] == (1, 3 + 1) and greedy.holders["target"] == (2, 3 + 4)
    expected = Acceptance()
    expected.update(3, 1)
    assert vars(greedy.acceptance) == pytest.approx(vars(expected)) and greedy.accepted == 4
    greedy.output += [7, 6, 5, 4, 1]
    s.start_round(greedy)
    assert greedy.chains == [] and greedy.phase == DRAFT and greedy.fuse == 5
    with pytest.raises(ValueError, match="fuse_ngram"):
        Scheduler("pooled", PolicyConfig(k=3, fuse_ngram=17))
    # rounds left without drafts (here by load) still fuse: the target looks the chain up; the
    # baseline does not
    loaded = Scheduler("pooled", PolicyConfig(k=3, fuse_ngram=5, disable_by_batch_size=1))
    reqs = [Request(i, str(i), [1, 2, 3], SamplingParams(max_new_tokens=20), seed=i) for i in range(2)]
    for r in reqs:
        loaded.admit(r)
    assert reqs[1].k == 0 and reqs[1].phase == VERIFY and reqs[1].fuse == 5
    plain = Scheduler("autoregressive", PolicyConfig(k=3, fuse_ngram=5))
    plain.admit(r := Request(9, "z", [1, 2, 3], SamplingParams(max_new_tokens=20), seed=9))
    assert r.fuse == 0


def _round(draft: list[int], chains: list[list[int]]) -> Request:
    req = Request(1, "a", [1, 2, 3], SamplingParams(max_new_tokens=20), seed=1, k=4, fuse=4)
    req.draft, req.chains, req.phase = draft, chains, VERIFY
    return req


def test_the_broker_checks_fused_chains_and_that_a_round_commits_a_path_of_its_tree() -> None:
    req = _round([3, 4], [])
    assert results.fused_chains(req, [[3, 9, 9, 9]]) == [[3, 9, 9, 9]]
    assert results.fused_chains(req, []) == []
    for bad in ([[3, 9, 9, 9, 9]], [[]], [[3], [4]]):  # too long, empty, two
        with pytest.raises(ProtocolError):
            results.fused_chains(req, bad)
    req.fuse = 0
    with pytest.raises(ProtocolError):  # never asked for
        results.fused_chains(req, [[3]])
    req = _round([3, 4], [[3, 9, 8]])
    for committed in ([9, 1], [3, 4, 8, 1], [3, 9, 4, 1], []):  # not a path of the tree, then one more token
        with pytest.raises(ProtocolError, match="not a path"):
            results.verified(req, TaskResult(1, "verify", 1, 1, committed=committed))
    v = results.verified(req, TaskResult(1, "verify", 1, 1, committed=[3, 9, 8, 1]))  # the chain's path won
    assert (v.draft_accepted, v.via_alt, v.fused) == (1, False, 2)
    # a round without a draft: the chain the target looked up comes with its result
    req = _round([], [])
    with pytest.raises(ProtocolError, match="not a path"):
        results.verified(req, TaskResult(1, "verify", 1, 1, committed=[5, 6, 1], chains=[[5, 7]]))
    with pytest.raises(ProtocolError, match="fused chain"):
        results.verified(req, TaskResult(1, "verify", 1, 1, committed=[5, 1], chains=[[5, 7, 7, 7, 7]]))
    # chains that are not token ids never reach these checks: decoding refuses them
    [item] = protocol.decode(protocol.encode(Result([TaskResult(1, "verify", 1, 1, committed=[5], chains=[["x"]])]))).results
    assert isinstance(item, Rejected)


# Prompts that repeat themselves, so the tiny target's greedy continuation often follows one of
# their earlier n-grams (and some that do not).
PROMPTS = [[5 + i, 40 + 3 * i, 7, 5 + i, 40 + 3 * i, 7, 5 + i] for i in range(6)] + [[3, 9, 27, 81], [100, 4, 100]]


async def _generate_all(address: str, n: int) -> list:
    async with AsyncClient(address, timeout_s=120) as client:
        return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=n) for p in PROMPTS))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pooled", "colocated", "loaded"])
def test_fused_ngram_chains_end_to_end_are_lossless_and_win_rounds(tiny_pair, mode: str, tmp_path) -> None:  # noqa: ANN001
    """Real processes. Pooled runs 2 + 2 workers with forced migration: a round the fused chain
    won moves that chain's KV into place, and the next round's worker pulls it. "loaded": pooled
    with rounds left without drafts under load (``disable_by_batch_size``), where the target
    looks the chain up itself. The policy log replays with the same decisions."""
    from nebula_flow import policy_log

    cfg = deploy_config(tiny_pair, "pooled" if mode == "loaded" else mode, *((2, 2) if mode == "pooled" else (1, 1)),
                        k=3, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(fuse_ngram=6, first_alternatives=1)
    cfg.broker.policy = cfg.broker.policy.replace(migrate=mode == "pooled")
    cfg.broker.policy = cfg.broker.policy.replace(disable_by_batch_size=1 if mode == "loaded" else 0)
    cfg.broker.policy_log = str(tmp_path / "policy.jsonl")
    with Deployment(cfg) as dep:
        outs = asyncio.run(_generate_all(dep.address, 40))
        with Client(dep.address) as c:
            state = c.status()
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_pair / "target", p, 40) for p in PROMPTS]
    counters = state["counters"]
    assert not state["errors"] and counters["fused_chains"] > 0
    assert counters["fused_rounds_won"] > 0 and counters["fused_tokens_accepted"] >= counters["fused_rounds_won"]
    assert sum(o.stats["fused_accepted"] for o in outs) == counters["fused_tokens_accepted"]
    if mode == "pooled":
        target_kv = [w["kv"] for w in state["workers"] if w["role"] == "target"]
        assert sum(k["pulls"] for k in target_kv) > 10 and sum(k["pull_failures"] for k in target_kv) == 0
    if mode == "loaded":  # most rounds had no draft, and their chains still won
        assert sum(k == 0 for o in outs for k in o.stats["k_per_round"]) > sum(o.rounds for o in outs) / 2
    records = policy_log.load(tmp_path / "policy.jsonl")
    report = policy_log.replay(records, policy_log.policy_of(records))
    assert report.decisions > 20 and report.identical, report.mismatches[:3]


def test_fusion_is_a_config_knob_with_limits(tmp_path) -> None:  # noqa: ANN001
    from nebula_flow.config import ConfigError, load_config

    path = tmp_path / "c.toml"
    base = 'mode = "pooled"\n[draft]\nmodel = "/m/d"\n[target]\nmodel = "/m/t"\n[policy]\n'
    path.write_text(base + "fuse_ngram = 8\n")
    cfg = load_config(path)
    cfg.validate()
    assert cfg.broker.policy.fuse_ngram == 8
    path.write_text(base + "fuse_ngram = 17\n")
    with pytest.raises(ConfigError, match="fuse_ngram"):
        load_config(path).validate()
    assert TaskSpec.__dataclass_fields__["fuse"].default == 0 and TaskResult.__dataclass_fields__["chains"]


@pytest.mark.slow
def test_seeded_samples_with_fused_chains_are_placement_independent(tiny_pair) -> None:  # noqa: ANN001
    """Sampled requests (at a low temperature: the tiny target is nearly flat) sample their way
    down the tree (recursive rejection sampling), with the draft's runner-ups to the token it drew
    beside it. A seeded request's output is the same on 1 + 1 workers and on 2 + 2 with forced
    migration, and some of their rounds commit tokens only the fused chain, or a runner-up, had."""
    reqs = [{"token_ids": p, "max_new_tokens": 32, "temperature": 0.1, "seed": 500 + i} for i, p in enumerate(PROMPTS)]
    runs = []
    for workers in ((1, 1), (2, 2)):
        cfg = deploy_config(tiny_pair, "pooled", *workers, k=3, max_batch=4)
        cfg.broker.policy = cfg.broker.policy.replace(fuse_ngram=6, first_alternatives=2, migrate=True)
        with Deployment(cfg) as dep:
            async def run() -> list:
                async with AsyncClient(dep.address, timeout_s=120) as client:
                    return await asyncio.gather(*(client.generate(**r) for r in reqs))

            outs = asyncio.run(run())
            with Client(dep.address) as c:
                state = c.status()
        assert not state["errors"] and state["counters"]["fused_chains"] > 0
        runs.append(([o.token_ids for o in outs], sum(o.stats["fused_accepted"] for o in outs),
                     sum(o.stats["alternatives_accepted"] for o in outs)))
    (one, fused_one, alts_one), (two, fused_two, alts_two) = runs
    assert one == two and len({tuple(t) for t in one}) > 1
    assert fused_one == fused_two > 0
    assert alts_one == alts_two > 0
