"""Adaptive speculation length: the pure estimate and choice, and the policy using them."""

from __future__ import annotations

import pytest

from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.request import DRAFT, VERIFY, Request
from nebula_flow.scheduler import Scheduler
from nebula_flow.speclen import (
    RECHECK_EVERY,
    Acceptance,
    StepCosts,
    choose_fuse,
    choose_k,
    choose_round,
    expected_tokens,
    fuse_pays,
    measured_costs,
)


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_k_grows_with_acceptance_and_with_cheaper_drafts() -> None:
    ks = [choose_k(Acceptance(a, 10 - a), 8) for a in range(11)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8  # monotone, from plain decoding to k_max
    assert choose_k(Acceptance(1, 1), 8) == 2  # a = 0.5 at the default (CPU) costs
    assert choose_k(Acceptance(1, 1), 8, (0.01, 0.0, 1.0)) > 2  # nearly free drafts: speculate further


def test_acceptance_follows_recent_rounds_and_relaxes_without_drafts() -> None:
    acc = Acceptance()
    for _ in range(10):
        acc.update(4, 4)
    assert acc.rate > 0.95
    for _ in range(10):
        acc.update(4, 0)
    assert acc.rate < 0.15
    for _ in range(60):
        acc.update(0, 0)  # k = 0 rounds say nothing: back toward the prior, so drafts are tried again
    assert acc.rate == pytest.approx(0.5, abs=0.01)


def _round(s: Scheduler, r: Request, accepted: int) -> None:
    if r.phase == DRAFT:
        s.draft_done(r, 1, [7] * r.k, {})
    assert r.phase == VERIFY
    s.verify_done(r, 2, accepted=accepted)
    r.output.extend([7] * (accepted + 1))
    s.start_round(r)


def test_the_policy_adapts_each_requests_k_and_keeps_probing() -> None:
    s = Scheduler("pooled", PolicyConfig(k=6, adaptive_k=True))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    easy, hard = (Request(i, str(i), [1, 2], SamplingParams(max_new_tokens=500), seed=i) for i in range(2))
    s.admit(easy)
    s.admit(hard)
    assert easy.k == hard.k == 2  # the prior: a = 0.5
    for _ in range(8):
        _round(s, easy, easy.k)
        _round(s, hard, 0)
    assert easy.k == 6 and hard.k == 0 and hard.phase == VERIFY  # no draft task for plain decoding
    seen = set()
    for _ in range(12):
        _round(s, hard, 0)
        seen.add(hard.k)
    assert seen & {1, 2}, "a request at k = 0 never tried drafting again"
    assert easy.stats()["k_per_round"][0] == 2 and easy.stats()["k_per_round"][-1] == 6
    assert Scheduler("pooled", PolicyConfig(k=6)).policy.adaptive_k is False


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="spec_costs"):
        Scheduler("pooled", PolicyConfig(k=4, adaptive_k=True, spec_costs=[0.1, 0.1]))
    with pytest.raises(ValueError, match="spec_costs"):
        Scheduler("pooled", PolicyConfig(k=4, adaptive_k=True, spec_costs=[0.1, 0.1, 0.0]))


def test_step_costs_keep_a_moving_mean_per_row_count() -> None:
    costs = StepCosts()
    assert costs.table() == []
    for rows, ms in ((1, 48), (2, 52), (3, 55), (4, 82), (6, 90)) * 3:
        costs.observe(rows, ms / 1000)
    costs.observe(120, 5.0)  # a prefill: not a round's cost
    assert costs.table() == pytest.approx([0.048, 0.052, 0.055, 0.082, None, 0.090])
    for _ in range(30):  # the machine got twice as slow: recent forwards win
        costs.observe(1, 0.096)
    assert costs.table()[0] == pytest.approx(0.096, rel=1e-3)


def test_measured_costs_are_in_target_decode_steps_and_keep_what_is_not_measured() -> None:
    base = (0.073, 0.03, 1.1)
    costs, verify = measured_costs([0.0018], [0.048, 0.052, None, 0.082], base)
    assert costs == pytest.approx((0.0375, (0.082 / 0.048 - 1) / 3, 1.1))
    assert verify[0] == 1.0 and verify[2] is None and verify[3] == pytest.approx(0.082 / 0.048)
    assert measured_costs(None, [0.048], base) == ((0.073, 0.03, 1.1), (1.0,))  # one row count: no slope
    assert measured_costs([0.002], None, base) == (base, ())
    # every round had drafts, so the target never ran one row: it is read off its 3- and 4-row blocks
    costs, verify = measured_costs([0.0018], [None, None, 0.055, 0.057], base)
    assert costs[0] == pytest.approx(0.0018 / 0.051) and verify[0] is None and verify[2] == pytest.approx(0.055 / 0.051)


def test_a_token_tree_is_chosen_only_where_its_rows_pay() -> None:
    acc = Acceptance(1, 1)  # a = 0.5, and a runner-up wins half the rounds whose first draft fails
    amx_bf16 = (0.073, 0.03, 1.1)  # the bundled pair with AMX (speclen docstring)
    k, alts = choose_round(acc, 6, amx_bf16, 1)
    assert k > 0 and alts == 1  # a verify row costs 3 % of a decode step: worth a 25 % chance of a token
    # fp32 without native bf16, measured: 48, 52, 55 ms for 1-3 rows, then a step to 82 ms at 4
    costs, verify = measured_costs([0.0018], [0.048, 0.052, 0.055, 0.082, 0.086, 0.090, 0.105, 0.110])
    k, alts = choose_round(acc, 6, costs, 1, verify)
    assert 1 + k + alts == 3  # a block of 3 rows costs 1.15 decode steps, of 4 rows 1.71: never 4
    assert choose_round(Acceptance(9, 1), 6, costs, 1, verify) == (5, 0)  # a = 0.9: 6 rows pay (1.88 steps)
    assert choose_round(acc, 6, costs, 0, verify) == (2, 0)
    for _ in range(10):  # runner-ups that never win stop being verified, even where rows are cheap
        acc.update_alternatives(1, 0, via_alt=False)
    assert acc.alt_rate < 0.1 and choose_round(acc, 6, amx_bf16, 1)[1] == 0
    before = acc.alt_rate
    acc.update_alternatives(1, 2, via_alt=False)  # the first draft token was accepted: no evidence
    acc.update_alternatives(0, 0, via_alt=False)  # no runner-ups verified: no evidence
    assert acc.alt_rate == before


def test_a_fused_chain_is_verified_only_where_what_it_wins_pays_for_its_rows() -> None:
    acc = Acceptance(1, 1)
    amx_bf16 = (0.073, 0.03, 1.1)
    assert acc.fused_gain == pytest.approx(2.0)  # hopeful at first: every request tries it
    assert fuse_pays(acc, 3, 0, 8, amx_bf16)  # 8 rows at 3 % of a decode step each
    costs, verify = measured_costs([0.0018], [0.048, 0.052, 0.055, 0.082, 0.086, 0.090, 0.105, 0.110,
                                              0.140, 0.150, 0.160, 0.170])
    for _ in range(6):  # chains that never win beyond the draft
        acc.update_fused(0)
    assert acc.fused_gain < 0.3 and not fuse_pays(acc, 3, 0, 8, costs, verify)
    low = acc.fused_gain
    for _ in range(10):  # rounds without one relax toward the prior: the request looks again later
        acc.update_fused(None)
    assert acc.fused_gain > low + 0.5
    for _ in range(6):  # chains that win a lot (code edits) pay even for costly rows
        acc.update_fused(5)
    assert fuse_pays(acc, 3, 0, 8, costs, verify)
    assert fuse_pays(acc, 0, 0, 8, costs, verify)  # a round without a draft: the chain alone
    # under load the chain's rows lengthen a verify batched with 3 other requests' rows: it must win
    # more (here: (4 + gain) / cost(12 rows) > 4 / cost(4 rows), gain > 4.3)
    three, six = Acceptance(fused_won=3.0, fused_rounds=1.0), Acceptance(fused_won=6.0, fused_rounds=1.0)
    assert fuse_pays(three, 0, 0, 8, costs, verify) and not fuse_pays(three, 0, 0, 8, costs, verify, batch=4)
    assert fuse_pays(six, 0, 0, 8, costs, verify, batch=4)
    # the longest chain that pays: under load a request still tries short ones (they cost fewer rows)
    assert choose_fuse(three, 0, 0, 8, costs, verify, batch=4) == 4 and choose_fuse(six, 0, 0, 8, costs, verify, batch=4) == 8
    assert choose_fuse(three, 0, 0, 8, costs, verify) == 8 and choose_fuse(acc, 3, 0, 0, costs, verify) == 0
    assert not fuse_pays(acc, 3, 0, 0, costs, verify)


def test_the_policy_takes_measured_costs_and_token_tree_choices() -> None:
    s = Scheduler("pooled", PolicyConfig(k=6, adaptive_k=True, measure_costs=True, first_alternatives=1))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    greedy, sampled = (Request(i, str(i), [1, 2], SamplingParams(max_new_tokens=500, temperature=t), seed=i)
                       for i, t in ((0, 0.0), (1, 0.8)))
    s.admit(greedy)
    s.admit(sampled)
    assert s.costs == (0.073, 0.03, 1.1) and greedy.alts == 1 and sampled.alts == 1  # (sampled: runner-ups to its draw)
    fp32 = [0.048, 0.052, 0.055, 0.082, 0.086, 0.090, 0.105, 0.110]
    s.observe_costs(2, "target", fp32)
    s.observe_costs(1, "draft", [0.0018, 0.0025])
    s.observe_costs(99, "target", [1.0])  # not a worker (any more): ignored
    assert s.costs[0] == pytest.approx(0.0375) and s.verify_costs[3] == pytest.approx(0.082 / 0.048)
    _round(s, greedy, 1)
    assert (greedy.k, greedy.alts) == choose_round(greedy.acceptance, 6, s.costs, 1, s.verify_costs)
    assert 1 + greedy.k + greedy.alts == 3 and greedy.ks == [2, greedy.k]
    s.register(3, "target", 4)
    s.observe_costs(3, "target", [0.030, 0.031, 0.032, 0.033])  # a faster one, and a slower one: the median
    s.observe_costs(4, "target", [0.060])
    s.register(4, "target", 4)
    s.observe_costs(4, "target", [0.060])
    assert s.verify_costs[0] == 1.0 and s.costs[0] == pytest.approx(0.0018 / 0.048)
    s.unregister(1)  # its measurement goes with it
    assert s.costs[0] == 0.073
    fixed = Scheduler("pooled", PolicyConfig(k=6, adaptive_k=True, first_alternatives=1, measure_costs=False))
    fixed.register(2, "target", 4)
    fixed.observe_costs(2, "target", fp32)
    assert (fixed.costs, fixed.verify_costs) == ((0.073, 0.03, 1.1), ())  # measure_costs off: configured costs hold
    plain = Scheduler("pooled", PolicyConfig(k=3, first_alternatives=2))  # no adaptive k: the tree every greedy round
    plain.register(1, "draft", 4)
    r = Request(5, "5", [1, 2], SamplingParams(max_new_tokens=50), seed=0)
    plain.admit(r)
    assert (r.k, r.alts) == (3, 2)
    with pytest.raises(ValueError, match="first_alternatives"):
        Scheduler("pooled", PolicyConfig(k=3, first_alternatives=9))


def test_a_cold_outlier_in_the_measured_costs_does_not_rule_drafting_out() -> None:
    """A deployment's first draft step on a CPU, right after its thread count changed, took 90 ms
    where steps of more rows took 6 ms: no forward is dearer than one of more rows."""
    costs, verify = measured_costs([0.090, None, None, None, None, None, 0.0058], [0.025, 0.060, 0.030, 0.031])
    assert costs[0] == pytest.approx(0.0058 / 0.025)  # the draft step: at most its 7-row forward
    assert verify[1] == pytest.approx(0.030 / 0.025) and verify[3] == pytest.approx(0.031 / 0.025)
    assert verify[0] == 1.0


def test_a_request_planned_without_drafts_drafts_now_and_then() -> None:
    """Measured costs that rule drafting out are refreshed only by drafts: a request whose plan is
    no draft drafts one token every ``RECHECK_EVERY`` rounds, and plans afresh from what that shows."""
    s = Scheduler("pooled", PolicyConfig(k=4, adaptive_k=True, measure_costs=True))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    s.observe_costs(2, "target", [0.025, 0.026, 0.027, 0.028, 0.029])
    s.observe_costs(1, "draft", [0.090])  # a draft step of 3.6 decode steps: drafting never pays
    r = Request(0, "0", [1, 2], SamplingParams(max_new_tokens=500), seed=0)
    s.admit(r)
    ks = [r.k]
    while len(ks) < 2 * RECHECK_EVERY:
        _round(s, r, 0 if r.k == 0 else r.k)
        ks.append(r.k)
    assert [i + 1 for i, k in enumerate(ks) if k] == [RECHECK_EVERY, 2 * RECHECK_EVERY] and max(ks) == 1
    s.observe_costs(1, "draft", [0.0025])  # what those drafts measured
    _round(s, r, 1)
    assert r.k > 1
