"""Fused model drafters (``nebula_flow/fusion.py``): a round drafted by two drafters at once, their
drafts verified in one token tree. The policy (pure), the simulator, and the live deployment."""

from __future__ import annotations

import pytest

from nebula_flow import fusion, policy_log
from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.request import DRAFT, VERIFY, Request
from nebula_flow.scheduler import Scheduler
from nebula_flow.speclen import Acceptance

GOOD, OTHER, TARGET, OTHER2 = 1, 2, 3, 4


def _sched(**knobs: object) -> Scheduler:
    s = Scheduler("pooled", PolicyConfig(**{"k": 4, "fuse_drafters": 2, **knobs}))
    s.register(GOOD, "draft", 4, "good")
    s.register(OTHER, "draft", 4, "other")
    s.register(TARGET, "target", 4)
    return s


def _admit(s: Scheduler, rid: int = 1, good: float = 0.9) -> Request:
    req = Request(rid, str(rid), [5, 6, 7], SamplingParams(max_new_tokens=64), seed=0)
    # (routing: "good" first, "other", at the prior's 0.5, second)
    req.by_drafter["good"] = Acceptance(accepted=10 * good, rejected=10 * (1 - good))
    s.admit(req)
    return req


def _serve(s: Scheduler, wid: int) -> list[Request]:
    s.pull(wid, 4, True, 0.0)
    got = dict(s.dispatch())
    return got.get(wid, [])


def test_a_fused_round_drafts_on_both_drafters_and_verifies_once_with_both_chains() -> None:
    s = _sched()
    req = _admit(s)
    assert req.drafter == "good" and req.second is not None and req.second.drafter == "other"
    [first] = _serve(s, GOOD)
    [second] = _serve(s, OTHER)
    assert first is second is req and req.second.attempt < 0 and fusion.is_second(s.workers[OTHER], req)
    assert fusion.accepts(s, OTHER, req.rid, req.second.attempt) is req
    assert fusion.accepts(s, OTHER, req.rid, req.attempt) is None  # (the first's attempt is not the second's)
    s.draft_done(req, GOOD, [1, 2, 3, 4], {})
    assert req.phase == VERIFY and req.rid not in s.topics["target"]  # the verify waits for the running second
    s.second_done(req, OTHER, [1, 2, 8, 9])
    assert req.rid in s.topics["target"] and fusion.chains(req) == [[1, 2, 8, 9]]
    [verify] = _serve(s, TARGET)
    assert verify is req
    # the target took the second chain's way: 1 2 8 9 and one more
    s.end_round(req, TARGET, [1, 2, 8, 9, 5], draft_accepted=2, second=4)
    st = s.fusion_stats
    assert (st.rounds, st.tokens_won, st.won_by) == (1, 2, {"other": 1})
    # (each drafter computed KV for all but its last token; the good one keeps what was committed of it)
    assert req.holders["draft/other"] == (OTHER, 3 + 3) and req.holders["draft/good"][1] == 3 + 2
    assert req.round == 2 and req.second is not None and req.second.round == 2  # (the next round is fused too)


def test_a_second_still_queued_when_the_first_comes_back_is_dropped_and_the_round_goes_on() -> None:
    s = _sched()
    req = _admit(s)
    [_] = _serve(s, GOOD)
    s.draft_done(req, GOOD, [1, 2, 3, 4], {})
    assert req.rid in s.topics["target"] and req.second is None and s.fusion_stats.dropped == 1
    assert not s.topics[fusion.TOPIC] and fusion.chains(req) == []
    assert _serve(s, OTHER) == []


def test_a_second_whose_worker_dies_goes_to_another_worker_of_its_drafter_or_is_dropped() -> None:
    s = _sched()
    s.register(OTHER2, "draft", 4, "other")
    req = _admit(s)
    [_] = _serve(s, GOOD)
    [_] = _serve(s, OTHER)
    old = req.second.attempt
    s.draft_done(req, GOOD, [1, 2, 3, 4], {})
    s.unregister(OTHER)
    assert req.second is not None and req.second.attempt < old and s.fusion_stats.requeued == 1
    assert req.rid not in s.topics["target"]  # (still waiting: its second runs again)
    [again] = _serve(s, OTHER2)
    assert again is req and fusion.accepts(s, OTHER2, req.rid, old) is None
    s.unregister(OTHER2)  # no worker of "other" left: the round verifies the first draft alone
    assert req.second is None and req.rid in s.topics["target"] and s.fusion_stats.dropped == 1


def test_a_failed_second_draft_lets_its_round_verify_alone() -> None:
    s = _sched()
    req = _admit(s)
    [_] = _serve(s, GOOD)
    [_] = _serve(s, OTHER)
    s.draft_done(req, GOOD, [1, 2, 3, 4], {})
    s.second_done(req, OTHER, None)
    assert req.rid in s.topics["target"] and fusion.chains(req) == [] and not s.workers[OTHER].second


def test_a_second_draft_that_prefilled_a_chunk_of_its_prompt_runs_again_for_the_rest() -> None:
    s = _sched(max_forward_tokens=2)
    req = _admit(s)
    [_] = _serve(s, GOOD)
    [_] = _serve(s, OTHER)
    first = req.second.attempt
    s.draft_done(req, GOOD, [1, 2, 3, 4], {})
    s.second_done(req, OTHER, None, prefilled=2)  # (2 of the 3 prompt tokens' KV)
    assert req.holders["draft/other"] == (OTHER, 2) and req.second.attempt < first
    assert req.rid not in s.topics["target"]  # (the verify still waits for it)
    [again] = _serve(s, OTHER)
    assert again is req and fusion.accepts(s, OTHER, req.rid, req.second.attempt) is req
    s.second_done(req, OTHER, [1, 2, 3, 9])
    assert req.rid in s.topics["target"] and fusion.chains(req) == [[1, 2, 3, 9]]


def test_a_worker_never_takes_both_drafts_of_one_round() -> None:
    """With no worker of the first drafter left, its draft may go to any draft worker, but never to
    the one running the same round's second draft."""
    s = _sched()
    req = _admit(s)
    [_] = _serve(s, OTHER)  # (the second)
    s.unregister(GOOD)  # "good" is gone: its draft may go to any draft worker
    assert req.phase == DRAFT and _serve(s, OTHER) == []
    s.second_done(req, OTHER, [1, 2, 3, 4])
    [first] = _serve(s, OTHER)
    assert first is req and not fusion.is_second(s.workers[OTHER], req)


def test_fusing_where_it_pays_weighs_the_second_chains_rows() -> None:
    """``fuse_drafters = 1``: a second chain pays while verify rows are cheap (a GPU's) and the first
    drafter is fair, not when each row costs nearly a decode step (a CPU's) or the first is nearly
    always right, and a request whose second chains never win stops asking for them."""
    def fused(verify_row: float, good: float) -> bool:
        s = _sched(fuse_drafters=1, measure_costs=False, spec_costs=(0.05, verify_row, 1.1))
        return _admit(s, good=good).second is not None

    assert fused(0.02, 0.6) and not fused(0.9, 0.6) and not fused(0.02, 0.9)
    s = _sched(fuse_drafters=1, measure_costs=False, spec_costs=(0.05, 0.02, 1.1))
    req = _admit(s, good=0.6)
    for _ in range(12):  # every round: the first's draft wins half, the second's nothing
        if req.second is None:
            break
        _serve(s, GOOD)
        _serve(s, OTHER)
        s.draft_done(req, GOOD, [1, 2, 3, 4], {})
        s.second_done(req, OTHER, [9, 9, 9, 9])
        _serve(s, TARGET)
        s.end_round(req, TARGET, [1, 2, 5], draft_accepted=2, second=0)
    assert req.second is None and 0 < s.fusion_stats.rounds < 12 and req.by_drafter["good"].rate < 0.75
    # a new request starts from what the pool saw of the second drafter (nothing won), not the hopeful estimate
    seen = s.fusion_stats.pool[("other", True)]
    assert seen.won == 0 and seen.rounds > 0
    assert _admit(s, rid=2, good=0.7).second is None
    assert _admit(_sched(fuse_drafters=1, measure_costs=False, spec_costs=(0.05, 0.02, 1.1)), rid=2, good=0.7).second


def test_fused_rounds_in_the_simulator_win_tokens_and_replay_from_the_policy_log() -> None:
    from nebula_flow.sim.acceptance import AcceptanceModel
    from nebula_flow.sim.engine import Simulator, simulate
    from nebula_flow.sim.scenario import Drafter, Pool, Workload
    from tests.test_sim import flat_profile, small_scenario

    wl = Workload(requests=12, output_tokens=64, prompt_tokens=(8, 8), concurrency=3)

    def scenario(fuse: int):  # noqa: ANN202
        return small_scenario(workload=wl, fuse_drafters=fuse, acceptance=AcceptanceModel(rates=[0.6]),
                              drafters=[Drafter("second", Pool(1, 16, flat_profile(0.001)), AcceptanceModel(rates=[0.6]))])

    alone, fused = simulate(scenario(0), "pooled"), simulate(scenario(2), "pooled")
    assert fused["fusion"]["rounds"] > 0.8 * fused["rounds"] and fused["fusion"]["tokens_won"] > 0
    assert fused["tokens_per_round"] > alone["tokens_per_round"] + 0.3
    sim = Simulator(scenario(2), "pooled", policy=policy_log.RecordingScheduler)
    sim.run()
    assert any(r[0] == "second_done" for r in sim.policy.records)
    report = policy_log.replay(sim.policy.records, policy_log.policy_of(sim.policy.records))
    assert report.decisions > 20 and report.identical, report.mismatches[:3]


@pytest.mark.slow
def test_fused_drafters_end_to_end_greedy_lossless_and_seeded_samples_placement_independent(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """The tiny draft fused with the tiny target as a second drafter, every round: greedy output is
    the target's own, seeded samples are the same on 1 and 2 workers per drafter (not the same as
    without fusion: a fixed chain may be accepted where the draft's token was not, another sample of
    the same distribution), and the broker's policy log replays decision for decision."""
    from nebula_flow.config import PoolConfig
    from nebula_flow.metrics import render
    from tests.conftest import deploy_config
    from tests.test_drafters import PROMPTS, assert_targets_greedy, serve_each

    greedy = [{"prompt": p, "max_new_tokens": 20 + 3 * i} for i, p in enumerate(PROMPTS)]
    sampled = [{"prompt": p, "max_new_tokens": 20, "temperature": 0.8, "seed": 500 + i} for i, p in enumerate(PROMPTS)]
    cfgs = {}
    for n in (1, 2):
        cfg = cfgs[n] = deploy_config(tiny_pair, "pooled", n, n, max_batch=4)
        cfg.broker.policy = cfg.broker.policy.replace(fuse_drafters=2, adaptive_k=False, k=3)
        cfg.drafters = [PoolConfig(str(tiny_pair / "target"), n, 4, threads=1, drafter="oracle")]
        cfg.broker.policy_log = str(tmp_path / f"policy-{n}.jsonl")
    runs = serve_each(cfgs, greedy + sampled)
    for n, (outs, state) in runs.items():
        assert_targets_greedy(tiny_pair, greedy, outs)
        fused = state["fusion"]
        assert fused["rounds"] > 0.5 * state["counters"]["rounds"] and fused["tokens_won"] > 0, fused
        assert not state["errors"]
        metrics = render(state)  # (what /metrics serves from this status)
        assert f'nebula_fused_drafts_total{{kind="rounds"}} {float(fused["rounds"])}' in metrics
        assert sum(fused["won_by"].values()) <= fused["rounds"] and set(fused["won_by"]) <= {"draft", "oracle"}
        records = policy_log.load(tmp_path / f"policy-{n}.jsonl")
        report = policy_log.replay(records, policy_log.policy_of(records))
        assert report.decisions > 20 and report.identical, report.mismatches[:3]
    one, two = runs[1][0], runs[2][0]
    assert [o.token_ids for o in one[len(greedy):]] == [o.token_ids for o in two[len(greedy):]]


def test_a_seeded_sample_waits_for_its_queued_second_draft() -> None:
    """Timing must not decide a seeded sample's tree: its verify waits even for a second draft no
    worker has taken yet (an unseeded one's is dropped: test above)."""
    s = _sched()
    req = Request(1, "1", [5, 6, 7], SamplingParams(max_new_tokens=64, temperature=0.8, seed=3), seed=3)
    s.admit(req)
    [_] = _serve(s, req.drafter == "good" and GOOD or OTHER)
    s.draft_done(req, GOOD if req.drafter == "good" else OTHER, [1, 2, 3, 4], {"q_len": [1] * 4})
    assert req.second is not None and req.rid not in s.topics["target"]
    [_] = _serve(s, OTHER if req.drafter == "good" else GOOD)
    s.second_done(req, OTHER if req.drafter == "good" else GOOD, [1, 2, 3, 5])
    assert req.rid in s.topics["target"]


@pytest.mark.slow
def test_a_second_drafter_killed_mid_run_loses_no_request_and_changes_no_output(tiny_pair) -> None:  # noqa: ANN001
    """Fused rounds whose second drafter's only worker is killed verify without it, or re-run it."""
    from nebula_flow.config import PoolConfig
    from tests.conftest import deploy_config, hf_greedy, workers_lost
    from tests.test_drafters import kill_mid_run

    prompts = [[5 + i, 40 + 3 * i, 7, 5 + i] for i in range(10)]
    cfg = deploy_config(tiny_pair, "pooled", 1, 1, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(fuse_drafters=2)
    cfg.drafters = [PoolConfig(str(tiny_pair / "target"), 1, 4, threads=1, drafter="oracle")]
    # once a few rounds were fused: the second drafter's only worker
    outs, state, at_kill, finished_after_kill = kill_mid_run(cfg, prompts, lambda st: st["fusion"]["rounds"] >= 3, "draft-1")
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_pair / "target", p, 32) for p in prompts]
    assert workers_lost(state) == 1 and "oracle" not in {d for d, v in state["drafters"].items() if v["workers"]}
    assert not state["errors"]
    assert finished_after_kill > 0 and at_kill["fusion"]["rounds"] >= 3
