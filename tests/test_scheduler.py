"""The pure scheduling policy, driven without sockets or clocks."""

from __future__ import annotations

import pytest

from nebula_flow import balance, roles
from nebula_flow.params import SamplingParams
from nebula_flow.policy import PolicyConfig
from nebula_flow.request import DONE, DRAFT, ROUND, VERIFY, Request
from nebula_flow.scheduler import Scheduler, Topic


def req(rid: int, max_new: int = 16) -> Request:
    return Request(rid, str(rid), [1, 2, 3], SamplingParams(max_new_tokens=max_new), seed=rid)


def test_pooled_any_worker_takes_any_task_and_rounds_flow() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    for rid in range(3):
        s.admit(req(rid))
    s.pull(1, 2, True, now=0.0)
    [(wid, batch)] = s.dispatch()
    assert wid == 1 and [r.rid for r in batch] == [0, 1] and all(r.phase == DRAFT for r in batch)
    s.draft_done(batch[0], 1, [5, 6, 7, 8], {})
    assert batch[0].phase == VERIFY and list(s.topics["target"]) == [0]
    s.pull(2, 4, True, now=1.0)
    [(wid, vbatch)] = s.dispatch()
    assert wid == 2 and vbatch == [batch[0]]
    s.verify_done(vbatch[0], 2, accepted=2)
    assert vbatch[0].holders["target"] == (2, 5) and vbatch[0].holders["draft"] == (1, 5)


def test_a_waiting_pull_is_served_when_tasks_arrive_and_idle_workers_come_first() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4))
    s.register(1, "draft", 1)
    s.register(2, "draft", 1)
    s.pull(1, 1, idle=False, now=0.0)  # worker 1 is prefetching behind a running batch
    s.pull(2, 1, idle=True, now=1.0)
    assert s.dispatch() == []
    s.admit(req(0))
    [(wid, _)] = s.dispatch()
    assert wid == 2


def test_a_pull_with_no_credits_withdraws_the_waiting_one() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4))
    s.register(1, "draft", 2)
    s.register(2, "draft", 2)
    s.pull(1, 2, idle=True, now=0.0)
    s.pull(1, 0, idle=True, now=1.0)  # worker 1 is leaving
    s.pull(2, 2, idle=False, now=2.0)
    s.admit(req(0))
    assert [(wid, [r.rid for r in batch]) for wid, batch in s.dispatch()] == [(2, [0])]


def test_token_tree_win_counts_for_the_target_not_the_draft_chain() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4, adaptive_k=True))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    r = req(0)
    s.admit(r)
    s.pull(1, 1, True, now=0.0)
    s.dispatch()
    s.draft_done(r, 1, [5] * r.k, {})
    prior = r.acceptance.accepted
    s.verify_done(r, 2, accepted=1, via_alt=True)  # an alternative to the first draft token won
    assert r.holders["target"] == (2, 4) and r.holders["draft"] == (1, 3)
    assert r.acceptance.accepted == pytest.approx(prior * 0.7)  # the chain itself was rejected at once
    assert r.accepted == 1


def test_rounds_start_without_drafts_while_the_pool_is_bigger_than_the_limit() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4, disable_by_batch_size=2))
    reqs = [req(rid) for rid in range(3)]
    s.admit(reqs[0])
    s.admit(reqs[1])
    assert [r.k for r in reqs[:2]] == [4, 4]
    s.admit(reqs[2])  # a third request: over the limit
    assert reqs[2].k == 0 and reqs[2].phase == VERIFY
    s.finish(0)
    s.start_round(reqs[1])  # two left: speculation again
    assert reqs[1].k == 4 and reqs[1].phase == DRAFT
    seeded = Request(9, "9", [1, 2, 3], SamplingParams(max_new_tokens=16, temperature=1.0, seed=3), seed=3)
    unseeded = Request(10, "10", [1, 2, 3], SamplingParams(max_new_tokens=16, temperature=1.0), seed=3)
    s.admit(seeded)
    s.admit(unseeded)  # over the limit again: a seeded sample still speculates (its k picks its sample)
    assert seeded.k == 4 and unseeded.k == 0
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        Scheduler("pooled", PolicyConfig(k=4, disable_by_batch_size=-1))


@pytest.mark.parametrize("mode, role", [("colocated", "colocated"), ("elastic", "any"), ("paired", None)])
def test_requests_are_bound_by_the_work_they_bring_not_by_count(mode: str, role: str | None) -> None:
    s = Scheduler(mode, PolicyConfig(k=2))
    workers = [(1, "draft"), (2, "draft"), (3, "target"), (4, "target")] if role is None else [(1, role), (2, role)]
    for wid, r in workers:
        s.register(wid, r, 8)
    long = Request(0, "0", list(range(10, 4010)), SamplingParams(max_new_tokens=16), seed=0)
    s.admit(long)  # 16 tokens to come and a 4,000-token prompt: 1,016 tokens' work at PROMPT_WEIGHT 0.25
    assert roles.outstanding(long) == 16 + roles.PROMPT_WEIGHT * 4000
    for rid in range(1, 5):  # 16 + 0.75 each: all four together weigh less than the long one
        s.admit(req(rid))
    assert [s.requests[rid].slot for rid in range(5)] == [0, 1, 1, 1, 1]
    # a prompt whose KV a worker holds is work done: then the output to come is all a request weighs
    long.holders["draft"], long.holders["target"] = (1, 1000), (3, 2000)  # (a chunked prefill half way)
    assert roles.outstanding(long) == 16 + roles.PROMPT_WEIGHT * 2000
    long.holders["target"] = (3, 4000)
    assert roles.outstanding(long) == 16
    s.admit(req(5))
    assert s.requests[5].slot == 0


def test_a_backlog_is_bound_when_a_worker_registers_and_a_new_worker_gets_the_next_requests() -> None:
    s = Scheduler("colocated", PolicyConfig(k=2))
    for rid in range(10):
        s.admit(req(rid))
    assert all(r.slot is None for r in s.requests.values())  # (no worker yet: nothing to bind to)
    s.register(1, "colocated", 8)
    assert all(r.slot == 0 for r in s.requests.values())
    s.register(2, "colocated", 8)  # (the counted work is counted again: a slot came)
    for rid in range(10, 40):
        s.admit(req(rid))
    slots = [s.requests[rid].slot for rid in range(10, 40)]
    assert slots[:10] == [1] * 10 and slots[10:] == [0, 1] * 10


def test_of_several_idle_workers_the_one_idle_the_shortest_takes_the_task() -> None:
    # (warm caches; on a CPU host it still holds the cores idle workers lend, nebula_flow/cores.py)
    s = Scheduler("autoregressive", PolicyConfig(k=0))
    for wid in (1, 2):
        s.register(wid, "target", 4)
    s.pull(1, 4, True, now=0.0)  # idle since the start
    s.pull(2, 4, True, now=5.0)  # just finished a request
    s.admit(req(0))
    assert [wid for wid, _ in s.dispatch()] == [2]
    s.pull(1, 4, False, now=6.0)  # busy workers' (prefetching) PULLs come after idle ones, by arrival
    s.pull(2, 4, True, now=7.0)
    s.admit(req(1))
    assert [wid for wid, _ in s.dispatch()] == [2]


def test_paired_binds_requests_to_pairs() -> None:
    s = Scheduler("paired", PolicyConfig(k=2))
    for wid, role in [(1, "draft"), (2, "draft"), (3, "target"), (4, "target")]:
        s.register(wid, role, 8)
    for rid in range(4):
        s.admit(req(rid))
    assert sorted(r.slot for r in s.requests.values()) == [0, 0, 1, 1]
    s.pull(1, 8, True, 0.0)
    [(wid, batch)] = s.dispatch()
    assert all(r.slot == s.workers[1].slot for r in batch) and len(batch) == 2
    for r in batch:
        s.draft_done(r, 1, [9, 9], {})
    s.pull(4, 8, True, 1.0)  # target of the other pair: must not take pair 0's verifies
    assert s.dispatch() == []
    s.pull(3, 8, True, 2.0)
    [(wid, vbatch)] = s.dispatch()
    assert wid == 3 and len(vbatch) == 2


def test_colocated_runs_whole_rounds_and_autoregressive_has_no_draft() -> None:
    s = Scheduler("colocated", PolicyConfig(k=3))
    s.register(1, "colocated", 4)
    s.admit(req(0))
    assert s.requests[0].phase == ROUND and s.requests[0].k == 3
    a = Scheduler("autoregressive", PolicyConfig(k=3))
    a.register(1, "target", 4)
    a.admit(req(0))
    assert a.requests[0].phase == VERIFY and a.requests[0].k == 0
    with pytest.raises(ValueError, match="no 'draft' workers"):
        a.register(2, "draft", 4)


def test_k_shrinks_near_max_new_tokens() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4))
    r = req(0, max_new=3)
    s.admit(r)
    assert r.k == 2  # the verify's correction/bonus token is the third
    r.output = [1, 2]
    s.finish(0)
    r2 = req(1, max_new=1)
    s.admit(r2)
    assert r2.k == 0 and r2.phase == VERIFY


def test_dead_worker_tasks_are_requeued_and_late_results_are_stale() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4))
    s.register(1, "draft", 4)
    s.register(2, "draft", 4)
    s.admit(req(0))
    s.pull(1, 4, True, 0.0)
    [(_, [r])] = s.dispatch()
    first_attempt = r.attempt
    assert s.unregister(1) == [0]
    s.pull(2, 4, True, 1.0)
    [(wid, [again])] = s.dispatch()
    assert wid == 2 and again.attempt == first_attempt + 1
    assert s.accepts_result(1, 0, first_attempt, DRAFT) is None  # the dead worker's late result
    assert s.accepts_result(2, 0, first_attempt, DRAFT) is None  # an old attempt
    assert s.accepts_result(2, 0, again.attempt, DRAFT) is again


def test_finish_removes_a_request_from_its_topic() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4))
    s.admit(req(0))
    s.admit(req(1))
    done = s.finish(0)
    assert done.phase == DONE and list(s.topics["draft"]) == [1]
    assert s.finish(0) is None


def test_locality_gives_holders_their_tasks_first_but_never_holds_tasks_back() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4, locality=True))
    s.register(1, "draft", 8)
    s.register(2, "draft", 8)
    reqs = [req(rid) for rid in range(4)]
    reqs[0].holders["draft"] = reqs[1].holders["draft"] = (2, 3)  # worker 2 holds 0 and 1
    for r in reqs:  # (holders are set before a task is queued: they change only while it runs)
        s.admit(r)
    s.pull(1, 8, idle=True, now=0.0)  # worker 1 pulls first and is idle...
    s.pull(2, 8, idle=False, now=1.0)
    got = dict(s.dispatch())
    assert [r.rid for r in got[2]] == [0, 1]  # ...yet worker 2 gets the tasks whose KV it holds
    assert [r.rid for r in got[1]] == [2, 3]
    # A holder that is not waiting does not keep its tasks: anyone with room takes them.
    s.finish(0)
    reqs[1].phase = "draft"
    s.topics["draft"].append(1)
    s.pull(1, 8, idle=True, now=2.0)
    assert [r.rid for r in dict(s.dispatch())[1]] == [1]


def test_forced_migration_avoids_the_previous_worker_when_another_exists() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4, migrate=True))
    s.register(1, "draft", 8)
    r = req(0)
    s.admit(r)
    r.holders["draft"] = (1, 3)
    s.pull(1, 8, True, 0.0)
    assert dict(s.dispatch())[1] == [r]  # the only draft worker: migration cannot be forced
    s.topics["draft"].append(0)
    s.register(2, "draft", 8)
    s.pull(1, 8, True, 1.0)
    assert s.dispatch() == []
    s.pull(2, 8, True, 2.0)
    assert dict(s.dispatch())[2] == [r]


def test_a_busy_worker_does_not_take_tasks_another_live_worker_holds() -> None:
    s = Scheduler("pooled", PolicyConfig(k=4, locality=True))
    s.register(1, "draft", 8)
    s.register(2, "draft", 8)
    held, fresh = req(0), req(1)
    s.admit(held)
    s.admit(fresh)
    held.holders["draft"] = (2, 3)  # worker 2 holds it but is not waiting (its batch is full)
    s.pull(1, 8, idle=False, now=0.0)  # worker 1 is busy, prefetching
    assert [r.rid for r in dict(s.dispatch())[1]] == [1]
    s.pull(1, 8, idle=True, now=1.0)  # once idle, it takes the held task rather than wait
    assert [r.rid for r in dict(s.dispatch())[1]] == [0]


def test_a_busy_worker_gets_no_small_batch_beside_a_bigger_running_one() -> None:
    """Splitting a worker's requests into a big and a small group that alternate costs a whole
    forward per group; the small group waits and merges with the big one when it returns."""
    s = Scheduler("colocated", PolicyConfig(k=4))
    s.register(1, "colocated", 8)
    reqs = [req(rid) for rid in range(6)]
    for r in reqs[:4]:
        s.admit(r)
    s.pull(1, 8, idle=True, now=0.0)
    [(_, running)] = s.dispatch()
    assert len(running) == 4
    for r in reqs[4:]:
        s.admit(r)
    s.pull(1, 8, idle=False, now=1.0)  # prefetching behind the running batch of 4
    assert s.dispatch() == []  # 2 ready beside 4 running: wait
    for r in running:  # the running batch comes back; the worker goes idle and asks again
        s.verify_done(r, 1, accepted=0)
        s.start_round(r)
    s.pull(1, 8, idle=True, now=2.0)
    [(_, merged)] = s.dispatch()
    assert sorted(r.rid for r in merged) == list(range(6))
    # A batch larger than the running one (or a full one) is still prefetched.
    for r in reqs[:4]:
        s.admit(req(10 + r.rid))
    s.pull(1, 4, idle=False, now=3.0)
    assert [len(b) for _, b in s.dispatch()] == [4]
    assert Scheduler("colocated", PolicyConfig(k=4, merge_batches=False)).policy.merge_batches is False


def _held_by_worker_1(queued: int, running: int, role: str = "target") -> Scheduler:
    """Pooled, two workers of ``role`` (1 and 2); worker 1 runs ``running`` requests and holds the KV
    of ``queued`` more, whose tasks wait on its topic; worker 2 holds nothing (one just restarted)."""
    s = Scheduler("pooled", PolicyConfig(k=4))
    for wid in (1, 2):
        s.register(wid, role, 8)
        s.observe_costs(wid, role, [0.01] * 8, by_batch=True)
    phase, key = (DRAFT, "draft") if role == "draft" else (VERIFY, "target")
    for rid in range(queued + running):
        r = req(rid)
        r.phase, r.draft, r.holders[key] = phase, [] if role == "draft" else [5], (1, 3)
        s.requests[rid] = r
        if rid < queued:
            s.enqueue(r)
        else:
            s.workers[1].inflight.add(rid)
    return s


@pytest.mark.parametrize("role", ["target", "draft"])
def test_an_idle_worker_takes_the_tasks_a_busy_holder_may_not_take_yet(role: str) -> None:
    """Worker 1 runs 6 and holds 3 more, too few to take beside its running batch (merging): they
    wait for it. Worker 2 sits idle; before, it got none of them (worker 1's picks were withheld,
    yet counted as taken), for as long as worker 1 held every request (a restarted worker ran nothing
    until new requests came). It now takes them while moving their KV pays, as an elastic worker
    takes others' rounds (``balance.Steals``)."""
    def pulls(s: Scheduler) -> dict[int, list[int]]:
        s.pull(2, 8, True, now=1.0)
        s.pull(1, 8, False, now=2.0)  # (worker 1 prefetching behind its running batch)
        return {wid: [r.rid for r in batch] for wid, batch in s.dispatch()}

    assert pulls(_held_by_worker_1(3, 6, role)) == {2: [0]}  # an unmeasured link: one, which measures it
    s = _held_by_worker_1(3, 6, role)
    balance.observe_pulls(s, 2, 1e-5, 100)  # a fast link: all three
    assert pulls(s) == {2: [0, 1, 2]} and s.workers[2].inflight == {0, 1, 2}
    s = _held_by_worker_1(3, 6, role)
    balance.observe_pulls(s, 2, 1.0, 10)  # a slow one: they wait for their holder, as before
    assert pulls(s) == {}
    s.pull(1, 8, True, now=3.0)  # (its batch came back: it takes them)
    assert [r.rid for r in dict(s.dispatch())[1]] == [0, 1, 2]
    s = _held_by_worker_1(3, 2, role)  # a batch larger than the running one: the holder takes it
    balance.observe_pulls(s, 2, 1e-5, 100)
    assert pulls(s) == {1: [0, 1, 2]}


def test_topic_keeps_queue_order_across_holders_and_requeues() -> None:
    t = Topic()
    for rid, holder in ((1, 7), (2, None), (3, 7), (4, 8)):
        t.append(rid, holder)
    t.appendleft(0, 8)
    assert list(t) == [0, 1, 2, 3, 4]
    assert list(t.held_by([7])) == [1, 3] and list(t.held_by([None, 8])) == [0, 2, 4]
    t.forget_holder(8)  # worker 8 left: its tasks are held by no one, still in queue order
    assert list(t.held_by([None])) == [0, 2, 4] and 8 not in t.holders()
    t.remove(3)
    assert list(t) == [0, 1, 2, 4] and 3 not in t and len(t) == 4 and list(t.held_by([7])) == [1]


def test_unserved_names_the_stage_no_registered_worker_takes() -> None:
    from nebula_flow.roles import unserved

    assert unserved("pooled", [("draft", 0), ("target", 1)]) is None
    assert unserved("pooled", [("draft", 0)]) == ("no worker takes the verify stage (role target): requests wait "
                                                 "until one registers")
    assert unserved("pooled", [("target", 0)]).startswith("no worker takes the draft stage (role draft)")
    assert unserved("autoregressive", [("target", 0)]) is None and unserved("colocated", [("colocated", 3)]) is None
    assert unserved("colocated", []).startswith("no worker takes the round stage (role colocated)")
    assert unserved("elastic", [("any", 0)]) is None and unserved("elastic", [("draft", 0), ("target", 1)]) is None
    assert unserved("elastic", [("draft", 0)]).startswith("no worker takes the verify stage (role any or target)")
    assert unserved("paired", [("draft", 0), ("target", 0)]) is None
    assert unserved("paired", [("draft", 0), ("target", 1)]).startswith("no draft and target worker of one slot")
