"""Where a round's time goes: the broker's ``round_times`` and ``bench --breakdown``."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main
from nebula_flow.protocol import Result, Timing, decode, encode
from nebula_flow.round_times import PARTS, RoundTimes, breakdown
from tests.test_emulated import PROFILE, profiles  # noqa: F401 - the fixture


def test_a_round_is_split_into_its_parts_and_the_first_is_summed_apart() -> None:
    rt = RoundTimes()
    rt.admitted(7, 0.0)
    rt.sent(7, 1.0)  # waited 1 s for a worker
    work = Timing(span_s=1.5, decode_s=0.1, queue_s=0.05, kv_s=0.05, verify_s=1.0, python_s=0.2, handoff_s=0.1)
    rt.returned(7, 3.0, work)  # 2 s after it was sent: 0.5 s on the wire
    rt.ended(7, 3.5, tokens=1)  # 0.5 s handling it
    before = {"round_times": rt.state()}
    first = before["round_times"]["first"]
    assert first["rounds"] == 1 and first["tokens"] == 1
    secs = first["seconds"]
    assert secs["queue"] == 1.0 and secs["hop"] == pytest.approx(0.5) and secs["broker"] == pytest.approx(0.5)
    assert secs["verify_forward"] == 1.0 and secs["worker_python"] == 0.2 and secs["worker_decode"] == 0.1
    assert secs["total"] == 3.5 and secs["other"] == pytest.approx(0.0, abs=1e-9)
    assert sum(secs[p] for p in PARTS) == pytest.approx(secs["total"])
    # the next round starts where the first ended; a draft result's handling is broker time too
    rt.sent(7, 3.6)
    rt.returned(7, 3.9, Timing(span_s=0.2, draft_s=0.2))
    rt.handled(7, 4.0)
    rt.sent(7, 4.0)
    rt.returned(7, 4.5, None)  # (a worker that says nothing: all of it counts as the hop)
    rt.ended(7, 4.6, tokens=3)
    after = {"round_times": rt.state()}
    b = breakdown(before, after)
    assert b["rounds"] == 1 and b["per_round_s"]["total"] == pytest.approx(1.1)
    assert b["per_round_s"]["draft_forward"] == pytest.approx(0.2)
    assert b["per_round_s"]["hop"] == pytest.approx(0.1 + 0.5)
    assert b["per_round_s"]["queue"] == pytest.approx(0.1)
    assert b["per_token_s"] == pytest.approx(1.1 / 3)
    assert sum(b["share"].values()) == pytest.approx(1.0)
    rt.closed(7)
    rt.sent(7, 5.0)  # (a request gone: its late marks are ignored)
    assert rt.state() == after["round_times"]


def test_timing_travels_and_negative_parts_are_refused() -> None:
    msg = Result([], 0.5, timing=Timing(span_s=0.01, verify_s=0.008))
    assert decode(encode(msg)).timing == msg.timing
    bad = Result([], timing=Timing(span_s=-1.0))
    with pytest.raises(Exception, match="timing parts"):
        decode(encode(bad))


@pytest.mark.slow
def test_bench_breakdown_on_emulated_devices_accounts_for_the_forwards(tiny_pair, profiles, tmp_path) -> None:  # noqa: ANN001, F811
    """Emulated forwards take the time their profile says, so the breakdown must find it: the
    target's verify of k+1 rows 2 ms + 0.2 ms a row, the draft's steps 0.5 ms each."""
    cfg = tmp_path / "emu.toml"
    cfg.write_text(f'mode = "pooled"\nkv_transport = "zmq"\n[policy]\nk = 4\nadaptive_k = false\n'
                   f'[draft]\nmodel = "{tiny_pair / "draft"}"\ndevice = "emulated"\nprofile = "{profiles[0]}"\n'
                   f'threads = 1\n[target]\nmodel = "{tiny_pair / "target"}"\ndevice = "emulated"\n'
                   f'profile = "{profiles[1]}"\nthreads = 1\n')
    res = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "pooled,autoregressive",
                                    "--requests", "2", "--max-new-tokens", "32", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    for name, m in modes.items():
        b = m["breakdown"]
        per = b["per_round_s"]
        assert b["rounds"] > 10, name
        assert all(per[p] >= 0 for p in PARTS), per
        assert sum(per[p] for p in PARTS) == pytest.approx(per["total"], rel=1e-6)
        assert per["verify_forward"] >= 0.002, per  # (at least the profile's base time)
        assert per["hop"] > 0 and per["broker"] > 0 and per["worker_python"] > 0
        assert m["first_breakdown"]["rounds"] == 2  # one first round per request, summed apart
    pooled, ar = modes["pooled"]["breakdown"]["per_round_s"], modes["autoregressive"]["breakdown"]["per_round_s"]
    assert pooled["draft_forward"] >= 4 * 0.0005  # k = 4 draft steps a round
    assert pooled["verify_forward"] >= 0.002 + 5 * 0.0002
    assert ar["draft_forward"] == 0
    # batches that wait behind the one computing (8 at once, 2 a batch): the worker's queue, not "other". (A
    # target forward of 20 ms: a batch prefetched while another computes waits for most of it, whatever the
    # hop that brought it took; behind the 2.4 ms forward above, a loaded machine's hops took half of it.)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(dict(PROFILE, latency=dict(PROFILE["latency"], base_s=0.02))))
    busy = tmp_path / "busy.toml"
    busy.write_text(cfg.read_text().replace('threads = 1\n[target]', 'threads = 1\n[target]\nmax_batch = 2')
                    .replace(f'profile = "{profiles[1]}"', f'profile = "{slow}"'))
    res = CliRunner().invoke(main, ["bench", "--config", str(busy), "--modes", "autoregressive", "--requests", "8",
                                    "--concurrency", "8", "--max-new-tokens", "16", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    per = json.loads(res.output.strip().splitlines()[-1])["modes"]["autoregressive"]["breakdown"]["per_round_s"]
    assert per["worker_queue"] > 0.5 * per["verify_forward"], per  # (two batches take turns)
    assert per["other"] < 0.05 * per["total"], per
    text = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "autoregressive", "--requests", "1",
                                     "--max-new-tokens", "8", "--repeats", "1", "--breakdown"])
    assert text.exit_code == 0, text.output
    assert "ms per round" in text.output and "verify_forward" in text.output and "overhead" in text.output
