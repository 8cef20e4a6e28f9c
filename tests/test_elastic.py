"""Elastic roles: the pure stage choice, the scheduler serving workers that take either stage,
and what the simulator predicts for them."""

from __future__ import annotations

import pytest

from nebula_flow import elastic
from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.request import DRAFT, VERIFY, Request
from nebula_flow.scheduler import Scheduler


def req(rid: int) -> Request:
    return Request(rid, str(rid), [1, 2, 3], SamplingParams(max_new_tokens=16), seed=rid)


# -- batch costs -------------------------------------------------------------------------------
def test_batch_costs_are_kept_by_power_of_two_rows_and_interpolated() -> None:
    costs = elastic.BatchCosts()
    for rows, seconds in ((1, 0.010), (3, 0.012), (8, 0.020), (8, 0.030)):
        costs.observe(rows, seconds)
    table = costs.table()  # buckets 1, 2, 4, 8 rows: 2 rows holds the 3-row forward, 4 none
    assert table[:3] == [0.010, 0.012, None] and table[3] == pytest.approx(0.020 + 0.2 * 0.010)
    assert elastic.estimate(table, 1) == 0.010 and elastic.estimate(table, 0) == 0.010
    assert elastic.estimate(table, 5) == pytest.approx(0.012 + (0.022 - 0.012) * 3 / 6)
    assert elastic.estimate(table, 16) == pytest.approx(0.022 * 2)  # past the largest: its time per row
    assert elastic.estimate(None, 4) is None and elastic.estimate([None], 4) is None


def test_a_draft_batch_costs_a_forward_per_position_over_the_tasks_still_drafting() -> None:
    table = [1.0, 2.0, 4.0, 8.0]  # seconds = rows (1, 2, 4, 8)
    # two tasks: 3 and 1 new rows first, then one row each while they draft (k 2 and 3)
    assert elastic.draft_seconds(table, [(3, 2), (1, 3)]) == pytest.approx(4.0 + 2.0 + 1.0)
    assert elastic.draft_seconds(table, []) == 0.0 and elastic.draft_seconds(None, [(1, 1)]) is None


# -- the choice --------------------------------------------------------------------------------
FLAT_DRAFT = [0.001] * 8  # a small model: about the same time for 1..128 rows
LINEAR_TARGET = [0.010 * (1 << i) for i in range(8)]  # a big model: time grows with rows


def test_a_full_draft_batch_goes_first_then_a_full_verify_batch() -> None:
    full_drafts, few_drafts = [(1, 4)] * 16, [(1, 4)] * 3
    full_verifies, few_verifies = [5] * 8, [5] * 2
    rooms = (16, 8)
    assert elastic.choose_stage(full_drafts, full_verifies, rooms, FLAT_DRAFT, LINEAR_TARGET) == "draft"
    assert elastic.choose_stage(few_drafts, full_verifies, rooms, FLAT_DRAFT, LINEAR_TARGET) == "target"
    assert elastic.choose_stage([], few_verifies, rooms, None, None) == "target"
    assert elastic.choose_stage(few_drafts, [], rooms, None, None) == "draft"
    assert elastic.choose_stage([], [], rooms, None, None) is None


def test_with_neither_batch_full_the_stage_that_does_more_tasks_per_second_runs() -> None:
    rooms = (64, 16)
    # 3 drafts: 4 forwards of 1 ms = 4 ms (0.75 tasks/ms); 2 verifies of 5 rows: ~0.1 s (0.02 tasks/ms)
    assert elastic.choose_stage([(1, 4)] * 3, [5] * 2, rooms, FLAT_DRAFT, LINEAR_TARGET) == "draft"
    # a slow draft model beside a fast target: verification first
    assert elastic.choose_stage([(1, 4)] * 3, [5] * 2, rooms, [0.5] * 8, [0.001] * 8) == "target"
    # nothing measured yet: the longer queue, verification on a tie
    assert elastic.choose_stage([(1, 4)] * 3, [5] * 2, rooms, None, None) == "draft"
    assert elastic.choose_stage([(1, 4)] * 2, [5] * 2, rooms, None, None) == "target"


# -- the scheduler -----------------------------------------------------------------------------
def test_an_elastic_worker_takes_either_stage_and_draft_batches_may_be_larger() -> None:
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.register(1, "any", 2, draft_capacity=8)
    for rid in range(5):
        s.admit(req(rid))
    s.pull(1, 8, True, now=0.0)
    [(wid, batch)] = s.dispatch()  # only drafts are due: a draft batch, up to the draft capacity
    assert wid == 1 and len(batch) == 5 and all(r.phase == DRAFT for r in batch)
    assert s.workers[1].stage == "draft"
    for r in batch:
        s.draft_done(r, 1, [5, 6, 7, 8], {})
    s.pull(1, 8, True, now=1.0)
    [(_, vbatch)] = s.dispatch()  # now verifies, up to its (verify) capacity
    assert len(vbatch) == 2 and all(r.phase == VERIFY for r in vbatch) and s.workers[1].stage == "target"
    for r in vbatch:
        s.end_round(r, 1, [5, 6, 9])
    assert all(r.holders["target"][0] == 1 and r.holders["draft"][0] == 1 for r in vbatch)


def test_elastic_workers_mix_with_draft_only_and_target_only_ones() -> None:
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    s.register(3, "any", 4)
    with pytest.raises(ValueError, match="no 'colocated' workers"):
        s.register(4, "colocated", 4)
    for rid in range(2):
        s.admit(req(rid))
    s.pull(2, 4, True, now=0.0)
    assert s.dispatch() == []  # a target-only worker never takes a draft
    s.pull(1, 4, True, now=0.1)
    [(wid, batch)] = s.dispatch()
    assert wid == 1 and len(batch) == 2
    for r in batch:
        s.draft_done(r, 1, [5, 6], {})
    s.pull(3, 4, True, now=0.2)
    got = dict(s.dispatch())  # the verifies go to the waiting target-only worker (it asked first)
    assert list(got) == [2] and len(got[2]) == 2
    # a worker of role any is refused outside elastic mode
    with pytest.raises(ValueError, match="no 'any' workers"):
        Scheduler("pooled").register(1, "any", 4)


def test_a_dead_elastic_workers_tasks_go_back_to_their_topics() -> None:
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.register(1, "any", 4)
    s.register(2, "any", 4)
    s.admit(req(0))
    s.pull(1, 4, True, now=0.0)
    [(_, [r])] = s.dispatch()
    assert s.unregister(1) == [0] and list(s.topics["draft"]) == [0]
    s.pull(2, 4, True, now=1.0)
    [(wid, [again])] = s.dispatch()
    assert wid == 2 and again is r and r.attempt == 2


def test_measured_batch_costs_are_each_workers_own_and_leave_with_it() -> None:
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.register(1, "any", 4)
    s.register(2, "any", 4)
    s.observe_costs(1, "draft", [0.001, 0.001], by_batch=True)
    s.observe_costs(2, "draft", [0.003, 0.003], by_batch=True)
    assert s.batch_costs[(1, "draft")] == [0.001, 0.001]
    s.unregister(1)
    assert (1, "draft") not in s.batch_costs and (2, "draft") in s.batch_costs


# -- the simulator -----------------------------------------------------------------------------
def test_elastic_beats_every_fixed_arrangement_of_the_papers_deployment_at_saturation() -> None:
    """4x RTX 4090, Qwen3-0.6B -> 8B, 512 requests at once: every device verifies while drafts are
    merged into batches of 64. (The figures and the other loads: docs/benchmarks.md.)"""
    from pathlib import Path

    from nebula_flow.sim.engine import plan
    from nebula_flow.sim.scenario import load_scenario

    sc = load_scenario(Path(__file__).resolve().parent.parent / "configs" / "sim" / "paper-2d2t.toml")
    rows = plan(sc, 4)
    assert rows[0]["mode"] == "elastic"
    best_fixed = rows[1]
    assert rows[0]["tokens_per_s"] > 1.05 * best_fixed["tokens_per_s"]
    assert rows[0]["latency_p99_s"] <= best_fixed["latency_p99_s"]
