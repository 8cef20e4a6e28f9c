"""Elastic roles: the pure stage choice, the scheduler serving workers that take either stage,
and what the simulator predicts for them."""

from __future__ import annotations

import pytest

from nebula_flow import balance, elastic
from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.request import DRAFT, ROUND, VERIFY, Request
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
FLAT_DRAFT = [0.001] * 8  # a small model on a GPU: about the same time for 1..128 rows
LINEAR_DRAFT = [0.001 * (1 << i) for i in range(8)]  # a CPU: time grows with the rows


def test_below_saturation_whole_rounds_and_queued_verifications_first() -> None:
    rooms = (64, 16)
    assert elastic.choose_stage([(1, 4)] * 3, 0, 0, rooms, FLAT_DRAFT) == "round"
    assert elastic.choose_stage([(1, 4)] * 3, 2, 0, rooms, FLAT_DRAFT) == "target"  # (they finish rounds)
    assert elastic.choose_stage([], 0, 2, rooms, FLAT_DRAFT) == "round"  # a request's last, draft-less round
    assert elastic.choose_stage([], 0, 0, rooms, FLAT_DRAFT) is None


def test_a_full_draft_batch_splits_the_stages_where_merging_drafts_pays() -> None:
    full = [(1, 4)] * 64
    assert elastic.choose_stage(full, 16, 0, (64, 16), FLAT_DRAFT) == "draft"
    assert elastic.choose_stage(full, 0, 0, (64, 16), None) == "draft"  # (unmeasured: the common case)
    # a draft model whose forward grows with its rows gains nothing from merging: whole rounds stay
    assert elastic.choose_stage(full, 0, 0, (64, 16), LINEAR_DRAFT) == "round"
    assert elastic.choose_stage(full, 1, 0, (64, 16), LINEAR_DRAFT) == "target"
    # no larger draft batch than a round's: nothing to merge
    assert elastic.choose_stage(full[:16], 0, 0, (16, 16), FLAT_DRAFT) == "round"
    assert elastic.merging_pays(FLAT_DRAFT, full, 16) and not elastic.merging_pays(LINEAR_DRAFT, full, 16)
    # the policy's elastic_split: split once that many drafts are queued, whatever the costs
    assert elastic.choose_stage(full[:2], 0, 0, (64, 16), LINEAR_DRAFT, split_at=2) == "draft"
    assert elastic.choose_stage(full[:2], 0, 0, (64, 16), LINEAR_DRAFT, split_at=3) == "round"


# -- the scheduler -----------------------------------------------------------------------------
def test_an_elastic_worker_runs_rounds_and_splits_the_stages_for_a_full_draft_batch() -> None:
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.register(1, "any", 2, draft_capacity=4)
    for rid in range(5):
        s.admit(req(rid))
    s.pull(1, 4, True, now=0.0)
    [(wid, batch)] = s.dispatch()  # a full draft batch (4 > the round batch of 2): the stages split
    assert wid == 1 and len(batch) == 4 and all(r.phase == DRAFT for r in batch) and s.workers[1].stage == "draft"
    for r in batch:
        s.draft_done(r, 1, [5, 6, 7, 8], {})
    s.pull(1, 4, True, now=1.0)
    [(_, vbatch)] = s.dispatch()  # queued verifications next, a verify batch of 2
    assert len(vbatch) == 2 and all(r.phase == VERIFY for r in vbatch) and s.workers[1].stage == "target"
    for r in vbatch:
        s.end_round(r, 1, [5, 6, 9])
    s.pull(1, 4, True, now=2.0)
    [(_, vbatch)] = s.dispatch()
    assert len(vbatch) == 2 and s.workers[1].stage == "target"
    for r in vbatch:
        s.end_round(r, 1, [5, 9])
    s.finish(3)
    s.finish(4)  # (cancelled: three drafts are left, too few for a draft batch)
    s.pull(1, 4, True, now=3.0)
    [(_, rounds)] = s.dispatch()  # no verification queued: whole rounds, a round batch of 2
    assert len(rounds) == 2 and all(r.phase == ROUND for r in rounds) and s.workers[1].stage == "round"
    r = rounds[0]
    base = len(r.prompt) + len(r.output)
    s.end_round(r, 1, [5, 6, 7, 9])  # a round's KV of both models is this worker's
    assert r.holders["target"] == (1, base + 3) and r.holders["draft"] == (1, base + 3)
    assert "colocated" not in r.holders and r.phase == DRAFT


def test_a_round_going_back_to_a_topic_is_the_task_it_was() -> None:
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.register(1, "any", 4)
    last = Request(9, "9", [1, 2, 3], SamplingParams(max_new_tokens=1), seed=9)  # one token: a draft-less round
    s.admit(req(0))
    s.admit(last)
    assert last.phase == VERIFY and list(s.topics["target"]) == [9]
    s.pull(1, 4, True, now=0.0)
    [(_, batch)] = s.dispatch()  # the draft-less verify joins the round batch
    assert [r.rid for r in batch] == [0, 9] and all(r.phase == ROUND for r in batch)
    assert sorted(s.unregister(1)) == [0, 9]
    assert list(s.topics["draft"]) == [0] and list(s.topics["target"]) == [9]
    assert batch[0].phase == DRAFT and last.phase == VERIFY


def test_a_draft_less_round_is_not_left_behind_the_drafts_queued_beside_it() -> None:
    """A request's last round (or one adaptive k leaves without a draft) waits in the target topic;
    taken only after the draft topic's rounds, it waited as long as they kept coming (here: for ever),
    a request's last token behind every other request's rounds. It goes first, as more urgent ones do."""
    s = Scheduler("elastic", PolicyConfig(k=4, priority_scheduling=True))
    s.register(1, "any", 2)
    reqs = [req(rid) for rid in range(3)] + [Request(9, "9", [1, 2, 3], SamplingParams(max_new_tokens=2), seed=9)]
    for r in reqs:
        s.admit(r)
    for now in range(4):  # batches of two rounds, each committing one token
        s.pull(1, 2, True, now=float(now))
        [(_, batch)] = s.dispatch()
        if reqs[3].phase == VERIFY:  # its last round was queued, draft-less, behind three drafts
            assert reqs[3] in batch
        for r in batch:
            s.end_round(r, 1, [5])
    assert reqs[3].finish_reason == "length"
    s.admit(Request(5, "5", [1, 2, 3], SamplingParams(max_new_tokens=16, priority=-1), seed=5))
    s.admit(Request(8, "8", [1, 2, 3], SamplingParams(max_new_tokens=1), seed=8))
    s.pull(1, 1, True, now=9.0)
    assert [r.rid for _, b in s.dispatch() for r in b] == [5]  # (a more urgent round with a draft: first still)


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
    got = dict(s.dispatch())  # the verifies go to the waiting target-only worker
    assert list(got) == [2] and len(got[2]) == 2
    s.pull(3, 4, True, now=0.2)
    assert s.dispatch() == []  # (nothing left for the elastic one)
    # a worker of role any is refused outside elastic mode
    with pytest.raises(ValueError, match="no 'any' workers"):
        Scheduler("pooled").register(1, "any", 4)


def test_requests_get_balanced_homes_and_their_rounds_stay_there() -> None:
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.register(1, "any", 8)
    s.register(2, "any", 8)
    for rid in range(4):
        s.admit(req(rid))  # each a home, as colocated binds: the least loaded
    assert [s.requests[rid].slot for rid in range(4)] == [0, 1, 0, 1]
    s.pull(1, 8, True, now=0.0)
    [(_, first)] = s.dispatch()  # an idle worker runs its own; the others' are theirs
    assert [r.rid for r in first] == [0, 2] and all(r.phase == ROUND for r in first)
    for r in first:
        s.end_round(r, 1, [5, 6])
    s.pull(2, 8, True, now=1.0)
    [(_, second)] = s.dispatch()
    assert [r.rid for r in second] == [1, 3]
    s.pull(1, 8, True, now=2.0)
    [(_, again)] = s.dispatch()
    assert [r.rid for r in again] == [0, 2]


def _homed_at_worker_1(n: int) -> Scheduler:
    """``n`` requests that ran a round on worker 1 (their home, their KV) and a second elastic
    worker that joined after, each with a measured verify batch of 0.01 s."""
    s = Scheduler("elastic", PolicyConfig(k=4))
    s.register(1, "any", 8)
    for rid in range(n):
        s.admit(req(rid))
    s.pull(1, 8, True, now=0.0)
    [(_, batch)] = s.dispatch()
    for r in batch:
        s.end_round(r, 1, [5, 6])  # 5 positions of each model's KV held by worker 1
    s.register(2, "any", 8)
    for wid in (1, 2):
        s.observe_costs(wid, "target", [0.01] * 8, by_batch=True)
    return s


def test_an_idle_elastic_worker_takes_anothers_rounds_only_while_moving_their_kv_pays() -> None:
    # unmeasured link: one round, which measures it
    s = _homed_at_worker_1(4)
    s.pull(2, 8, True, now=1.0)
    [(wid, [probe])] = s.dispatch()
    assert wid == 2 and probe.phase == ROUND and probe.slot == s.workers[2].slot  # its new home
    # a slow link: 10 KV positions (both models' 5) would take 0.1 s, longer than a verify batch
    s = _homed_at_worker_1(4)
    balance.observe_pulls(s, 2, 1.0, 100)
    s.pull(2, 8, True, now=1.0)
    assert s.dispatch() == []
    # a fast one: up to its share of the pool (4 requests over 2 workers)
    s = _homed_at_worker_1(4)
    balance.observe_pulls(s, 2, 1e-5, 100)
    s.pull(2, 8, True, now=1.0)
    [(_, moved)] = s.dispatch()
    assert [r.rid for r in moved] == [0, 1]
    # never while its own results are still to come (its PULL overtook them)
    s.end_round(moved[0], 2, [5, 6])
    s.pull(2, 8, True, now=2.0)
    [(_, mine)] = s.dispatch()
    assert [r.rid for r in mine] == [0]  # its own again, none of worker 1's: one of its results is still out


def test_idle_elastic_workers_spread_a_pool_that_one_of_them_holds() -> None:
    """Both idle: the one idle the shortest is served first, but takes its own rounds only up to its
    share of the pool before the other's turn; what the other does not take (its KV moves priced as
    above) goes back to the holder. Before, the holder took back all of its own every time, and a
    worker that joined later (one restarted after a death) sat idle beside it until new requests came."""
    def both_pull(s: Scheduler) -> dict[int, list[int]]:
        s.pull(2, 8, True, now=1.0)  # (the new worker waits since it joined)
        s.pull(1, 8, True, now=2.0)  # (worker 1 idle the shortest: its turn first)
        return {wid: [r.rid for r in batch] for wid, batch in s.dispatch()}

    assert both_pull(_homed_at_worker_1(6)) == {1: [0, 1, 2, 4, 5], 2: [3]}  # unmeasured link: one, which measures it
    s = _homed_at_worker_1(6)
    balance.observe_pulls(s, 2, 1e-5, 100)  # a fast link: half each
    assert both_pull(s) == {1: [0, 1, 2], 2: [3, 4, 5]}
    assert all(s.requests[rid].slot == s.workers[2].slot for rid in (3, 4, 5))  # (their new home)
    s = _homed_at_worker_1(6)
    balance.observe_pulls(s, 2, 1.0, 100)  # a slow one: all stay with their holder, none waits
    assert both_pull(s) == {1: [0, 1, 2, 3, 4, 5]}
    s = _homed_at_worker_1(6)  # one idle worker: nothing to spread
    s.pull(1, 8, True, now=2.0)
    assert [(wid, len(batch)) for wid, batch in s.dispatch()] == [(1, 6)]


def test_a_workers_pull_counters_price_its_link_and_bad_ones_are_ignored() -> None:
    s = _homed_at_worker_1(1)
    for seconds, positions in (("1", 10), (1.0, "10"), (1.0, 0), (1.0, -3), (None, 10), (1.0, True)):
        balance.observe_pulls(s, 2, seconds, positions)
    assert s.pull_rates == {}
    balance.observe_pulls(s, 2, 0.5, 100)
    balance.observe_pulls(s, 9, 0.5, 100)  # (no such worker)
    assert s.pull_rates == {2: 0.005}
    s.unregister(2)
    assert s.pull_rates == {} and 2 not in s.homes.values()


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
def test_elastic_keeps_its_requests_home_where_kv_moves_slowly() -> None:
    """The emulated deployment (KV over loopback at ~1 GB/s) at 192 concurrent requests: elastic
    workers keep balanced homes, so none idles while others hold the work (before: one sat idle for
    most of the run, and merged drafts moved 2.5 GB of KV), and they move almost no KV."""
    from dataclasses import replace
    from pathlib import Path

    from nebula_flow.sim.engine import simulate
    from nebula_flow.sim.scenario import load_scenario

    sc = load_scenario(Path(__file__).resolve().parent.parent / "configs" / "sim" / "emulated-2d2t.toml")
    sc = replace(sc, workload=replace(sc.workload, requests=192, concurrency=192))
    el, co = simulate(sc, "elastic"), simulate(sc, "colocated")
    assert el["round_rate"] >= co["round_rate"] and el["kv_bytes"] < 100e6
    assert min(el["utilization_by_role"].values()) > 0.85


def test_elastic_beats_every_fixed_arrangement_of_the_papers_deployment_at_saturation() -> None:
    """4x RTX 4090, Qwen3-0.6B -> 8B, 512 requests at once: every device verifies while drafts are
    merged into batches of 64. (The figures and the other loads: docs/benchmarks.md.)"""
    from pathlib import Path

    from nebula_flow.sim.planner import plan
    from nebula_flow.sim.scenario import load_scenario

    sc = load_scenario(Path(__file__).resolve().parent.parent / "configs" / "sim" / "paper-2d2t.toml")
    rows = plan(sc, 4)
    assert rows[0]["mode"] == "elastic"
    best_fixed = rows[1]
    assert rows[0]["tokens_per_s"] > 1.05 * best_fixed["tokens_per_s"]
    assert rows[0]["latency_p99_s"] <= best_fixed["latency_p99_s"]
