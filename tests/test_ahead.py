"""Draft-ahead (``nebula_flow/ahead.py``): the pure policy, the pre-draft runner on real models, and
the broker's check of a pre-draft's branches. End to end: ``test_e2e_lossless``, ``test_emulated``,
``test_faults``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nebula_flow import ahead
from nebula_flow.ahead import Branch
from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.policy_log import RecordingScheduler, policy_of, replay
from nebula_flow.protocol import MAX_AHEAD, ProtocolError, TaskResult
from nebula_flow.request import DRAFT, VERIFY, Request
from nebula_flow.scheduler import Scheduler
from nebula_flow.sim.engine import Simulator
from nebula_flow.sim.predraft import UNGUESSED, outcomes
from nebula_flow.sim.scenario import load_scenario
from nebula_flow.speclen import Acceptance
from nebula_flow_broker.results import predrafted
from nebula_flow_broker.tasks import predraft


def req(rid: int, max_new: int = 32) -> Request:
    return Request(rid, str(rid), [1, 2, 3], SamplingParams(max_new_tokens=max_new), seed=rid)


def pooled(ahead: int = 6, cls: type[Scheduler] = Scheduler, **knobs: object) -> Scheduler:
    s = cls("pooled", PolicyConfig(k=4, draft_ahead=ahead, **knobs))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    return s


def drafted(s: Scheduler, r: Request, draft: list[int]) -> None:
    """Round ``r.round``'s draft goes to worker 1 and comes back."""
    s.pull(1, 4, True, now=0.0)
    [(wid, batch)] = s.dispatch()
    assert wid == 1 and batch == [r] and s.workers[1].stage == "draft"
    s.draft_done(r, 1, draft, {})


def predraft_taken(s: Scheduler, r: Request) -> int:
    """The idle draft worker takes ``r``'s pre-draft; returns its attempt."""
    s.pull(1, 4, True, now=1.0)
    [(wid, batch)] = s.dispatch()
    assert wid == 1 and batch == [r] and s.workers[1].stage == "ahead"
    return r.ahead.attempt


def verify_taken(s: Scheduler, r: Request) -> None:
    s.pull(2, 4, True, now=2.0)
    [(wid, batch)] = s.dispatch()
    assert wid == 2 and batch == [r] and r.phase == VERIFY


def verifying(s: Scheduler) -> tuple[Request, int]:
    """Request 0's round 1, drafted [5, 6, 7, 8], verifying while its pre-draft runs; and that
    pre-draft's attempt."""
    r = req(0)
    s.admit(r)
    drafted(s, r, [5, 6, 7, 8])
    attempt = predraft_taken(s, r)
    verify_taken(s, r)
    return r, attempt


def branches(*outcomes: list[int]) -> list[Branch]:
    return [Branch(list(a), [50 + i, 60 + i, 70 + i, 80 + i], worker=1, drafter="draft") for i, a in enumerate(outcomes)]


def test_a_hit_sends_the_next_verify_at_once_with_the_branch_as_its_draft() -> None:
    s = pooled()
    r = req(0)
    s.admit(r)
    drafted(s, r, [5, 6, 7, 8])
    assert list(s.topics["ahead"]) == [0]  # queued for the worker holding the draft KV
    predraft_taken(s, r)
    verify_taken(s, r)
    s.predrafted(r, 1, branches([5, 6, 7, 8, 9], [11], [5, 12]))
    s.end_round(r, 2, [5, 12])  # the target corrected the second token: the third outcome
    assert r.phase == VERIFY and r.round == 2 and r.draft == [52, 62, 72, 82] and 0 in s.topics["target"]
    assert 0 not in s.topics["draft"] and r.holders["draft"] == (1, 3 + 2 + 3)
    assert list(s.topics["ahead"]) == [0] and r.ahead.round == 2  # the next pre-draft, for round 2's verify
    stats = s.ahead_stats
    assert (stats.tasks, stats.branches, stats.hits, stats.late_hits, stats.wasted) == (2, 3, 1, 0, 2)
    assert stats.hits_by_outcome == [0, 0, 1]  # (the third outcome: what draft_ahead must cover)


def test_a_refuted_pre_draft_is_dropped_and_the_round_drafts_as_usual() -> None:
    s = pooled()
    r, _ = verifying(s)
    s.predrafted(r, 1, branches([5, 6, 7, 8, 9], [11]))
    s.end_round(r, 2, [5, 6, 13])  # an outcome no branch assumed
    assert r.phase == DRAFT and 0 in s.topics["draft"] and r.ahead is None and r.draft == []
    assert (s.ahead_stats.hits, s.ahead_stats.wasted) == (0, 2)


def test_a_pre_draft_back_after_its_verify_hits_while_the_next_draft_still_waits() -> None:
    s = pooled()
    r, attempt = verifying(s)
    s.end_round(r, 2, [11])  # the pre-draft is still running: round 2 queues its draft
    assert r.phase == DRAFT and 0 in s.topics["draft"]
    assert s.workers[1].ahead == {0: attempt}
    s.predrafted(r, 1, branches([5, 6, 7, 8, 9], [11]))
    assert r.phase == VERIFY and 0 not in s.topics["draft"] and r.draft == [51, 61, 71, 81]
    assert (s.ahead_stats.hits, s.ahead_stats.late_hits) == (1, 1)


def test_a_pre_draft_too_late_for_its_round_is_wasted_and_a_queued_one_cancelled() -> None:
    s = pooled()
    r, attempt = verifying(s)
    s.end_round(r, 2, [11])
    drafted(s, r, [20, 21, 22, 23])  # round 2's draft went out before the pre-draft came back
    assert ahead.accepts(s, 1, 0, attempt) is None  # its result, when it comes, is stale
    assert r.draft == [20, 21, 22, 23] and r.ahead.attempt == attempt + 1
    # round 2's pre-draft is queued, but its verify ends before a draft worker takes it: cancelled
    verify_taken(s, r)
    s.end_round(r, 2, [20, 30])
    # (both cancelled: the one still running when round 2 drafted, and this one)
    assert r.ahead is None and 0 not in s.topics["ahead"] and s.ahead_stats.cancelled == 2


def test_a_request_s_rounds_count_how_often_their_draft_was_pre_drafted_and_plan_with_it() -> None:
    """Adaptive k under draft-ahead: a round whose draft was pre-drafted waited for none of its draft
    steps, so a request counts its hits (a late one too) and misses, decayed like its acceptance,
    and plans its rounds with a draft step weighing only as often as it missed. A seeded sampled
    request plans without it: whether a pre-draft hits depends on timing, and its k decides the
    sample it draws."""
    s = pooled()
    r, _ = verifying(s)
    assert r.acceptance.ahead_rate == 0.0  # (none hidden until its rounds show it)
    s.predrafted(r, 1, branches([5, 6, 7, 8, 9]))
    s.end_round(r, 2, [5, 6, 7, 8, 9])  # a hit
    hit_once = r.acceptance.ahead_rate
    assert hit_once == pytest.approx(1 / 1.7)
    predraft_taken(s, r)
    verify_taken(s, r)
    s.end_round(r, 2, [50, 3])  # round 2's pre-draft still runs: whether it hits is told when it returns
    assert r.acceptance.ahead_rate == hit_once
    s.predrafted(r, 1, branches([40]))
    assert r.phase == DRAFT and r.acceptance.ahead_rate == pytest.approx(0.7 / 2.19)  # (a miss)
    costs = (0.9, 0.03, 1.1)
    assert ahead.planned_costs(s, r, r.acceptance, costs) == pytest.approx((0.9 * (1 - 0.7 / 2.19), 0.03, 1.1))
    seeded = Request(9, "9", [1, 2, 3], SamplingParams(max_new_tokens=8, temperature=1.0, seed=5), seed=5)
    seeded.acceptance.update_ahead(True)
    assert ahead.planned_costs(s, seeded, seeded.acceptance, costs) == costs
    assert ahead.planned_costs(pooled(ahead=0), r, r.acceptance, costs) == costs  # (draft-ahead off)


def test_adaptive_k_drafts_longer_where_rounds_were_pre_drafted() -> None:
    """The policy's own plan: where a draft step is dear, a request that rounds hit drafts longer
    than one whose rounds missed (its draft steps are off the critical path)."""
    s = pooled(ahead=6, adaptive_k=True, measure_costs=False, spec_costs=(0.9, 0.03, 1.1))
    ks = {}
    for rid, hits in ((0, False), (1, True)):
        r = req(rid)
        r.acceptance = Acceptance(accepted=9.0, rejected=1.0)
        for _ in range(4):
            r.acceptance.update_ahead(hits)
        s.admit(r)
        ks[hits] = r.k
    assert ks == {False: 1, True: 4}


def test_pre_drafts_only_take_draft_capacity_that_would_idle() -> None:
    s = pooled()
    a, b = req(0), req(1)
    s.admit(a)
    drafted(s, a, [5, 6, 7, 8])
    s.admit(b)  # a draft is queued: the draft worker takes it, not the pre-draft
    s.pull(1, 4, True, now=1.0)
    [(wid, batch)] = s.dispatch()
    assert batch == [b] and s.workers[1].stage == "draft" and list(s.topics["ahead"]) == [0]


def test_pre_drafts_are_made_only_while_the_pool_is_light() -> None:
    s = pooled()  # one target worker
    rs = [req(i) for i in range(ahead.LIGHT_PER_TARGET + 1)]
    for r in rs:
        s.admit(r)
    for r in rs:
        r.draft = [5, 6, 7, 8]
        ahead.queue(s, r, 1)
    assert len(s.topics["ahead"]) == 0 and s.ahead_stats.skipped == len(rs)
    s.register(3, "target", 4)  # more verifiers: the same pool is light for them
    ahead.queue(s, rs[0], 1)
    assert list(s.topics["ahead"]) == [0]


def test_pre_drafts_go_to_idle_draft_workers_in_batches_of_a_draft_batch_s_rows() -> None:
    s = pooled(ahead=2)  # capacity 4: two pre-drafts of two outcomes each per batch
    s.register(3, "target", 4)
    s.register(4, "draft", 4)  # (two requests or fewer per draft worker: pre-drafts cover every outcome asked)
    rs = [req(i) for i in range(3)]
    for r in rs:
        s.admit(r)
    s.pull(1, 4, True, now=0.0)
    [(_, batch)] = s.dispatch()
    for r in batch:
        s.draft_done(r, 1, [5, 6, 7, 8], {})
    s.pull(1, 4, False, now=1.0)  # busy (prefetching behind a batch): not idle while it waits
    assert s.dispatch() == []
    s.pull(1, 4, True, now=2.0)
    [(_, batch)] = s.dispatch()
    assert [r.rid for r in batch] == [0, 1] and s.workers[1].stage == "ahead"


def test_pre_drafts_cover_fewer_outcomes_as_each_draft_worker_s_share_of_the_pool_grows() -> None:
    """A pre-draft batch runs to its end, and a draft that comes meanwhile waits: past two requests
    per draft worker, a pre-draft covers that share of ``draft_ahead``'s outcomes (the most likely),
    and the task carries its count."""
    s = pooled(ahead=16)  # one draft worker
    s.register(3, "target", 4)  # (the pool stays light up to 8 requests)
    rs = [req(i) for i in range(8)]
    covered = {}
    for n in (1, 2, 4, 8):
        for r in rs[:n]:
            if r.rid not in s.requests:
                s.admit(r)
        rs[0].draft = [5, 6, 7, 8]
        ahead.queue(s, rs[0], 1)
        covered[n] = rs[0].ahead.outcomes
    assert covered == {1: 16, 2: 16, 4: 8, 8: 4}
    spec = predraft(s, rs[0], lambda held: None, ([], 0, 0))
    assert spec.ahead == 4 and spec.kind == "ahead"


@pytest.mark.parametrize("change", ["k", "alts", "drafter"])
def test_a_branch_is_only_used_where_the_round_would_draft_the_same(change: str) -> None:
    s = pooled(first_alternatives=2 if change == "alts" else 0)
    r, _ = verifying(s)
    made = branches([11])
    if change == "k":
        r.ahead.k = 3  # (drafted fewer tokens than round 2 asks for)
    elif change == "alts":
        r.ahead.alts = 1
    else:
        made[0].drafter = "other"
    s.predrafted(r, 1, made)
    s.end_round(r, 2, [11])
    assert r.phase == DRAFT and s.ahead_stats.hits == 0


def test_a_dead_drafter_s_pre_drafts_are_dropped_but_its_branches_still_serve() -> None:
    s = pooled(ahead=2)  # (two pre-drafts in one batch of capacity 4)
    s.register(3, "draft", 4)
    a, b = req(0), req(1)
    for r in (a, b):
        s.admit(r)
    s.pull(1, 4, True, now=0.0)
    [(_, batch)] = s.dispatch()
    for r in batch:
        s.draft_done(r, 1, [5, 6, 7, 8], {})
    s.pull(1, 4, True, now=1.0)
    [(_, pre)] = s.dispatch()
    assert [r.rid for r in pre] == [0, 1]
    s.predrafted(a, 1, branches([11]))  # a's came back; b's is still running when worker 1 dies
    s.unregister(1)
    assert b.ahead is None and a.ahead.branches is not None
    s.pull(2, 4, True, now=2.0)
    s.dispatch()
    s.end_round(a, 2, [11])
    assert a.phase == VERIFY and a.draft == [50, 60, 70, 80] and "draft" not in a.holders
    s.end_round(b, 2, [11])
    assert b.phase == DRAFT and 1 in s.topics["draft"]


def test_finishing_a_request_drops_its_pre_draft() -> None:
    s = pooled()
    r = req(0)
    s.admit(r)
    drafted(s, r, [5, 6, 7, 8])
    s.finish(0)
    assert 0 not in s.topics["ahead"]


def test_draft_ahead_is_off_by_default_and_outside_pooled_and_paired() -> None:
    s = pooled(ahead=0)
    r = req(0)
    s.admit(r)
    drafted(s, r, [5, 6, 7, 8])
    assert not s.topics["ahead"] and r.ahead is None
    c = Scheduler("colocated", PolicyConfig(k=4, draft_ahead=6))
    c.register(1, "colocated", 4)
    c.admit(req(1))
    assert not c.topics["ahead"]


def test_a_policy_log_with_pre_drafts_replays_identically() -> None:
    s = pooled(cls=RecordingScheduler)
    rs = [req(i, 12) for i in range(3)]
    for r in rs:
        s.admit(r)
    outcomes = iter([[11], [5, 6, 7, 8, 9], [5, 12], [13], [5, 6, 7, 8, 9], [14]] * 20)
    for now in range(200):
        s.pull(1, 4, True, now=float(now))
        s.pull(2, 4, True, now=float(now))
        for wid, batch in s.dispatch():
            for r in batch:
                stage = s.workers[wid].stage
                if stage == "draft":
                    s.draft_done(r, wid, [5, 6, 7, 8][:r.k], {})
                elif stage == "ahead":
                    s.predrafted(r, wid, branches([11], [5, 6, 7, 8, 9], [5, 12]))
                else:
                    s.end_round(r, wid, next(outcomes)[: r.k + 1] or [1])
        if not s.requests:
            break
    assert not s.requests and s.ahead_stats.hits > 0 and s.ahead_stats.wasted > 0
    report = replay(s.records, Scheduler("pooled", s.policy))
    assert report.identical, report.mismatches[:3]


def test_the_broker_refuses_branches_that_assume_no_outcome_of_the_draft() -> None:
    s = pooled()
    r = req(0)
    s.admit(r)
    drafted(s, r, [5, 6, 7, 8])
    st = r.ahead

    def item(assumes: list[int], draft: list[int]) -> TaskResult:
        return TaskResult(0, "ahead", st.round, st.attempt, draft=draft, assumes=assumes)

    ok = predrafted(st, [item([5, 11], [1, 2]), item([5, 6, 7, 8, 9], [3])], 1, "draft", False, 512)
    assert [b.assumes for b in ok] == [[5, 11], [5, 6, 7, 8, 9]] and ok[0].worker == 1
    assert predrafted(st, [item([], [])], 1, "draft", False) == []  # (it pre-drafted nothing)
    for bad in (item([6, 11], [1]), item([5, 6, 7, 8, 9, 10], [1]), item([11], [1, 2, 3, 4, 5]),
                item([11], [600])):
        with pytest.raises(ProtocolError):
            predrafted(st, [bad], 1, "draft", False, 512)
    with pytest.raises(ProtocolError):  # the same outcome twice
        predrafted(st, [item([11], [1]), item([11], [2])], 1, "draft", False)
    failed = TaskResult(0, "ahead", st.round, st.attempt, error="malformed: a sampled draft needs its proposal q")
    with pytest.raises(ProtocolError, match="proposal q") as exc:  # (counted by its code, not taken for nothing made)
        predrafted(st, [failed], 1, "draft", True)
    assert exc.value.code == "predraft_failed"


def test_pre_drafted_branches_are_the_drafts_fresh_rounds_make(tiny_pair) -> None:  # noqa: ANN001
    """On the real tiny pair: each outcome the runner pre-drafts is exactly the draft a fresh round
    on those tokens makes (greedy and seeded sampling), and the outcomes cover the verify's often:
    more often with the draft's third and fourth guesses (16 outcomes at k = 4) than with k + 2."""
    from nebula_flow.models.loader import load_model
    from nebula_flow_workers.runner import ModelRunner, Task

    draft, target = (ModelRunner(load_model(str(tiny_pair / m))) for m in ("draft", "target"))
    hits = {6: 0, 16: 0}
    for params in (SamplingParams(max_new_tokens=64), SamplingParams(max_new_tokens=64, temperature=0.8)):
        tokens = np.array([5, 40, 7, 300, 12, 17], dtype=np.int64)
        for rnd in range(12):
            d = draft.draft([Task(1, "draft", rnd, 1, tokens, 4, params, 7)])[0]
            committed = target.verify([Task(1, "verify", rnd, 1, tokens, 4, params, 7, draft=d.tokens,
                                            q_idx=d.q_idx, q_prob=d.q_prob)])[0]
            made = draft.predraft([Task(1, "ahead", rnd, 1, tokens, 4, params, 7, draft=d.tokens, ahead=16)])[0]
            assert len(made) == 16 and made[0][0][:4] == d.tokens and len({tuple(a) for a, _ in made}) == 16
            # (the first k + 2 are those a pre-draft of 6 makes, in the same order)
            six = draft.predraft([Task(1, "ahead", rnd, 1, tokens, 4, params, 7, draft=d.tokens, ahead=6)])[0]
            assert [a for a, _ in six] == [a for a, _ in made[:6]]
            assert [len(a) - 1 for a, _ in made] == [j for j, _ in ahead.outcome_plan(4, 16)]
            for assumed, branch in made:  # (a request of its own: nothing cached, computed from scratch)
                fresh = draft.draft([Task(2, "draft", rnd, 1, np.concatenate([tokens, assumed]), 4, params, 7)])[0]
                draft.store.free([2])
                # (q: to fp32's shape-dependent rounding, ~1e-6, as between any two placements; see
                # models/invariant.py: bf16 runs batch-invariant)
                assert branch.tokens == fresh.tokens and (branch.q_prob is None or all(
                    np.array_equal(a, b) for a, b in zip(branch.q_idx, fresh.q_idx)) and all(
                    np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(branch.q_prob, fresh.q_prob)))
            for n in hits:
                hits[n] += any(assumed == committed for assumed, _ in made[:n])
            tokens = np.concatenate([tokens, committed])
    # (the tiny pair: its draft's next choices catch the target's corrections now and then)
    assert hits[6] >= 4 and hits[16] > hits[6]


# -- the simulator ------------------------------------------------------------------------
EMULATED_SIM = Path(__file__).resolve().parent.parent / "configs" / "sim" / "emulated-2d2t.toml"


def emulated_sim(draft_ahead: int, concurrency: int, policy: type[Scheduler] = Scheduler) -> Simulator:
    """The live emulated deployment's scenario (2 draft + 2 target workers, RTX 4090 profiles),
    pooled, with ``draft_ahead`` and a closed loop of ``concurrency`` requests."""
    sc = load_scenario(EMULATED_SIM)
    return Simulator(replace(sc, policy=sc.policy.replace(draft_ahead=draft_ahead),
                             workload=replace(sc.workload, concurrency=concurrency)), "pooled", policy=policy)


def test_simulated_outcomes_are_the_live_runners_in_its_order() -> None:
    """The outcomes a simulated pre-draft bets on, most likely first, as ``ModelRunner.predraft``
    orders them: the whole draft and its guess, each shorter accept and its guess of the
    correction, the whole draft and its second guess, then the next guesses likewise."""
    g, s = 1, 2  # (a placeholder outcome's last token: the rank of the draft's guess it bets on)
    assert outcomes(2, 4) == [[0, 0, g], [g], [0, g], [0, 0, s]]
    assert outcomes(2, 11) == [[0, 0, g], [g], [0, g], [0, 0, s], [s], [0, s], [0, 0, 3], [3], [0, 3], [0, 0, 4]]
    assert outcomes(3, 2) == [[0, 0, 0, g], [g]]
    assert len(outcomes(4, MAX_AHEAD)) == 16 and UNGUESSED not in {o[-1] for o in outcomes(4, 16)}


def test_the_simulator_models_draft_ahead_where_it_pays_and_the_policy_turns_it_off_under_load() -> None:
    """The live policy's draft-ahead on the simulator's clock: a single stream gains from the
    rounds whose draft was pre-drafted (most of them), while the same rounds commit the same
    tokens; at saturation the policy makes no pre-drafts and throughput is that without."""
    off, on = (emulated_sim(d, 1).run() for d in (0, 6))
    assert (on["rounds"], on["tokens"]) == (off["rounds"], off["tokens"])  # (a hit is the draft a round makes)
    assert on["draft_ahead"]["hits"] > 0.4 * on["rounds"] and on["ahead_hit_rate"] > 0.4
    assert on["tokens_per_s"] > 1.1 * off["tokens_per_s"] and on["latency_s"]["p50"] < off["latency_s"]["p50"]
    off, on = (emulated_sim(d, 48).run() for d in (0, 6))
    made, skipped = on["draft_ahead"]["tasks"], on["draft_ahead"]["skipped"]
    assert skipped > 20 * made  # (a few while the first and last requests run alone)
    assert on["tokens_per_s"] >= 0.97 * off["tokens_per_s"]


def test_a_simulated_draft_ahead_run_replays_identically_from_its_policy_log() -> None:
    sim = emulated_sim(6, 2, RecordingScheduler)
    sim.run()
    records = sim.policy.records
    assert any(r[0] == "predrafted" for r in records), {r[0] for r in records}
    report = replay(records, policy_of(records))
    assert report.decisions > 100 and report.identical, report.mismatches[:3]


def test_simulate_sets_a_knob_per_mode_and_the_concurrency_from_the_command_line() -> None:
    """`simulate SCENARIO --modes pooled@draft_ahead=0,pooled@draft_ahead=6 --concurrency 1`: each
    label runs with its knob (the same as the library run above), and a bad knob or concurrency is
    refused by name."""
    import json

    from click.testing import CliRunner

    from nebula_flow.cli import main

    labels = ["pooled@draft_ahead=0", "pooled@draft_ahead=6"]
    result = CliRunner().invoke(main, ["simulate", str(EMULATED_SIM), "--modes", ",".join(labels),
                                       "--concurrency", "1", "--json"])
    assert result.exit_code == 0, result.output
    modes = json.loads(result.output.strip().splitlines()[-1])["modes"]
    assert list(modes) == labels
    off, on = (modes[label] for label in labels)
    assert off["tokens_per_s"] == emulated_sim(0, 1).run()["tokens_per_s"]
    assert on["draft_ahead"]["hits"] > 0 and on["tokens_per_s"] > 1.1 * off["tokens_per_s"]
    bad = CliRunner().invoke(main, ["simulate", str(EMULATED_SIM), "--modes", "pooled@no_such_knob=1"])
    assert bad.exit_code != 0 and "no_such_knob" in bad.output
    bad = CliRunner().invoke(main, ["simulate", str(EMULATED_SIM), "--concurrency", "0"])
    assert bad.exit_code != 0 and "--concurrency" in bad.output


def test_status_says_how_draft_ahead_and_fused_drafters_do_where_they_are_on() -> None:
    from nebula_flow.cli.status_text import status_lines
    from nebula_flow.fusion import FusionStats

    state = {"mode": "pooled", "uptime_s": 3, "pool": 0, "topics": {}, "roles": ["target"], "workers": [],
             "counters": {"rounds": 40}, "errors": {}, "draft_ahead": ahead.AheadStats().to_dict(),
             "fusion": FusionStats().to_dict()}
    assert not any(line.startswith(("draft-ahead", "fused")) for line in status_lines(state))  # (off: no lines)
    state["draft_ahead"] = dict(state["draft_ahead"], tasks=36, branches=560, hits=30, late_hits=2, wasted=500,
                                cancelled=1, skipped=4)
    state["fusion"] = dict(state["fusion"], tasks=12, requeued=1, dropped=2, rounds=9, tokens_won=7,
                           won_by={"small": 3, "big": 4})
    lines = status_lines(state)
    assert ("draft-ahead: 30 rounds took a pre-drafted draft (75% of rounds; 2 after their verify came back), "
            "36 pre-drafts of 560 outcomes, 500 outcomes unused, 1 pre-drafts cancelled, 4 not made (the pool "
            "too loaded)") in lines
    state["draft_ahead"]["hits_by_outcome"] = [20, 4, 0, 6]
    assert status_lines(state)[-3].endswith("too loaded); hits by outcome, most likely first: [20, 4, 0, 6]")
    assert ("fused drafters: 9 rounds fused, 7 tokens won beyond the first draft, 12 second drafts (1 re-queued, "
            "2 dropped); rounds won by: big 4, small 3") in lines
