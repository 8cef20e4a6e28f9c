"""`nebula-flow bench-broker`: a real broker under zero-cost workers, its CPU per request-round."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main

pytestmark = pytest.mark.slow


def test_bench_broker_measures_rounds_and_broker_cpu(tiny_pair) -> None:  # noqa: ANN001
    res = CliRunner().invoke(main, ["bench-broker", "--modes", "pooled,elastic,autoregressive", "--model",
                                    str(tiny_pair / "target"), "--workers", "2", "--requests", "12", "--concurrency",
                                    "6", "--max-new-tokens", "20", "--k", "3", "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    pooled, elastic, ar = modes["pooled"], modes["elastic"], modes["autoregressive"]
    # every round of zero-cost workers commits the whole draft and a bonus token (the last round: what is left)
    assert pooled["rounds"] == 12 * 5 and pooled["tokens_per_round"] == 4.0
    # (elastic, the bundled default's mode: its workers take either stage, most rounds whole on one)
    assert elastic["rounds"] == 12 * 5 and elastic["tokens_per_round"] == 4.0
    assert ar["rounds"] == 12 * 20 and ar["tokens_per_round"] == 1.0
    assert all(0 < m["broker_cpu_us_per_round"] < 100_000 and m["round_rate"] > 0 for m in modes.values())


def test_bench_broker_measures_each_shard(tiny_pair) -> None:  # noqa: ANN001
    res = CliRunner().invoke(main, ["bench-broker", "--modes", "pooled", "--shards", "1,2", "--model",
                                    str(tiny_pair / "target"), "--workers", "1", "--requests", "12", "--concurrency",
                                    "6", "--max-new-tokens", "20", "--k", "3", "--json"])
    assert res.exit_code == 0, res.output
    shards = json.loads(res.output.strip().splitlines()[-1])["shards"]
    one, two = shards["1"], shards["2"]
    assert one["rounds"] == two["rounds"] == 12 * 5 and two["tokens_per_round"] == 4.0
    # the 12 requests were split by id over both shards, and each shard's CPU is over its own rounds
    assert len(two["shard_rounds"]) == 2 and all(n > 0 for n in two["shard_rounds"]) and sum(two["shard_rounds"]) == 60
    assert all(0 < c < 100_000 for c in two["shard_cpu_us_per_round"])
    bad = CliRunner().invoke(main, ["bench-broker", "--shards", "0"])
    assert bad.exit_code == 2 and "'0' is not comma-separated integers >= 1" in bad.output


def test_bench_broker_through_the_http_api_measures_the_gateway(tiny_pair) -> None:  # noqa: ANN001
    res = CliRunner().invoke(main, ["bench-broker", "--modes", "pooled", "--api", "--model", str(tiny_pair / "target"),
                                    "--workers", "1", "--requests", "12", "--concurrency", "6", "--max-new-tokens",
                                    "20", "--k", "3", "--json"])
    assert res.exit_code == 0, res.output
    pooled = json.loads(res.output.strip().splitlines()[-1])["modes"]["pooled"]
    # the same rounds as through the client library; the gateway (a process of its own) spent CPU on each token
    assert pooled["rounds"] == 12 * 5 and pooled["tokens_per_round"] == 4.0
    assert 0 < pooled["gateway_cpu_us_per_token"] < 100_000


def test_a_process_s_cpu_seconds_count_every_thread_to_the_microsecond() -> None:
    """``process.cpu_seconds``, what bench and bench-broker divide by rounds, read from another
    process: a few milliseconds of work on a thread that has ended show (ticks of 10 ms read 0 for
    such work, flaking a check)."""
    import subprocess
    import sys

    from nebula_flow.process import cpu_seconds

    script = ("import sys, threading, time\n"
              "def spin():\n    end = time.thread_time() + 0.004\n    while time.thread_time() < end: pass\n"
              "t = threading.Thread(target=spin); t.start(); t.join()\n"
              "print(time.process_time(), flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own = float(child.stdout.readline())  # (the child's own clock, every thread, once its spin ended)
        assert own >= 0.004
        assert own <= cpu_seconds(child.pid) < own + 0.05  # (only its wait for stdin since)
    finally:
        child.stdin.close()
        child.wait()
