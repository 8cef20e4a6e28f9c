"""The broker's activity line (what the last interval did, in its log) and its relay to `serve`'s
terminal: silent while idle, each interval's own counts, only whole new lines relayed."""

from __future__ import annotations

from collections import Counter

from nebula_flow.log_relay import ACTIVITY_MARKER, LogRelay
from nebula_flow.roles import WorkerState
from nebula_flow_broker.activity import ActivityLog


def _targets(n: int) -> list[WorkerState]:
    return [WorkerState(i, "target", i, 8) for i in range(n)]


def test_a_line_each_interval_of_that_intervals_work_and_none_while_idle() -> None:
    activity = ActivityLog(10.0, last=100.0, mode="autoregressive")
    counters, errors = Counter(), Counter()
    topics = {"draft": 0, "target": 0}
    assert activity.line(109.0, counters, errors, 0, topics, _targets(2)) is None  # (not due yet)
    assert activity.line(110.0, counters, errors, 0, topics, _targets(2)) is None  # (due, but nothing happened: silent)
    counters.update(tokens_out=500, rounds=200, requests_length=3, requests_stop=1, requests_cancelled=2)
    errors.update(too_long=1)
    line = activity.line(120.0, counters, errors, 4, {"draft": 0, "target": 3}, _targets(2))
    assert line == ("last 10 s: 50.0 tokens/s out, 2.50 tokens/round, requests 4 finished, 2 cancelled; "
                    "4 in the pool, tasks queued: target 3; 2 workers; errors: too_long 1")
    # the next interval counts only its own work; requests waiting in the pool are worth a line
    counters.update(tokens_out=30, rounds=10, requests_failed=1)
    assert activity.line(135.0, counters, errors, 1, topics, _targets(1)) == (
        "last 15 s: 2.0 tokens/s out, 3.00 tokens/round, requests 0 finished, 1 failed; 1 in the pool, tasks "
        "queued: none; 1 worker")
    assert activity.line(150.0, counters, errors, 1, topics, _targets(1)) == (
        "last 15 s: 0.0 tokens/s out, - tokens/round, requests 0 finished; 1 in the pool, tasks queued: none; 1 worker")
    errors.update(unknown_worker=17, too_long=2)  # (errors alone are worth a line: a restarted broker's, say)
    assert activity.line(160.0, counters, errors, 0, topics, _targets(2)) == (
        "last 10 s: 0.0 tokens/s out, - tokens/round, requests 0 finished; 0 in the pool, tasks queued: none; 2 workers; "
        "errors: unknown_worker 17, too_long 2")
    assert ActivityLog(0.0, last=0.0, mode="autoregressive").line(1e9, counters, errors, 5, topics, _targets(1)) is None  # (stats_log_s = 0: off)
    # requests that cannot progress (no worker takes a stage they need) are said to wait
    pooled = ActivityLog(10.0, last=0.0, mode="pooled")
    assert pooled.line(10.0, Counter(), Counter(), 3, topics, [WorkerState(1, "draft", 0, 8)]) == (
        "last 10 s: 0.0 tokens/s out, - tokens/round, requests 0 finished; 3 in the pool, tasks queued: none; 1 worker; "
        "NOT SERVING: no worker takes the verify stage (role target): requests wait until one registers")


def test_the_relay_gives_whole_new_lines_holding_the_marker(tmp_path) -> None:  # noqa: ANN001
    log = tmp_path / "broker.log"
    log.write_text(f"old INFO {ACTIVITY_MARKER}before the relay\n")
    relay = LogRelay(log, ACTIVITY_MARKER)
    assert relay.lines() == []  # (what the file held already is not news)
    with open(log, "a") as f:
        f.write(f"t broker INFO worker 1 joined\nt broker INFO {ACTIVITY_MARKER}last 10 s: one\nt broker INFO {ACTIVITY_MARKER}la")
    assert relay.lines() == ["last 10 s: one"]  # (the unfinished line waits for its end)
    with open(log, "a") as f:
        f.write("st 10 s: two\n")
    assert relay.lines() == ["last 10 s: two"] and relay.lines() == []
    log.write_text(f"{ACTIVITY_MARKER}after a restart\n")  # (a file written anew: read from its start)
    assert relay.lines() == ["after a restart"]
    assert LogRelay(tmp_path / "none.log", ACTIVITY_MARKER).lines() == []
