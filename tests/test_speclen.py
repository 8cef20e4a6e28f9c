"""Adaptive speculation length: the pure estimate and choice, and the policy using them."""

from __future__ import annotations

import pytest

from nebula_flow.params import SamplingParams
from nebula_flow.request import DRAFT, VERIFY, Request
from nebula_flow.scheduler import Scheduler
from nebula_flow.speclen import Acceptance, choose_k, expected_tokens


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
    s = Scheduler("pooled", k=6, adaptive_k=True)
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
    assert Scheduler("pooled", k=6).knobs()["adaptive_k"] is False


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="spec_costs"):
        Scheduler("pooled", k=4, adaptive_k=True, spec_costs=[0.1, 0.1])
    with pytest.raises(ValueError, match="spec_costs"):
        Scheduler("pooled", k=4, adaptive_k=True, spec_costs=[0.1, 0.1, 0.0])
