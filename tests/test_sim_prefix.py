"""The simulator where prompts share their start: token ids from blocks, the workers' prefix caches,
placement by prefix and prefix pulls on the simulated clock (``nebula_flow/sim/prefix_cache.py``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from nebula_flow import policy_log
from nebula_flow.cli import main
from nebula_flow.config import ConfigError
from nebula_flow.policy import PolicyConfig
from nebula_flow.prefixes import BLOCK
from nebula_flow.sim.acceptance import AcceptanceModel
from nebula_flow.sim.costs import Link, RooflineCost
from nebula_flow.sim.engine import Simulator, simulate
from nebula_flow.sim.hardware import resolve_hardware, resolve_model
from nebula_flow.sim.prefix_cache import SimPrefixCache, prompt_of
from nebula_flow.sim.scenario import Pool, Scenario, Workload, load_scenario
from nebula_flow.traces import HASH_BLOCK
from nebula_flow_broker.server import Broker, BrokerOptions
from tests.test_sim import REPO

SHARED = REPO / "configs" / "sim" / "paper-2d2t-shared.toml"


def gpu_scenario(workload: Workload, **kw) -> Scenario:  # noqa: ANN003
    """Qwen3-0.6B -> 8B on RTX 4090 rooflines (a prefill's cost grows with its tokens), 2 + 2 devices."""
    hw = resolve_hardware("rtx4090")
    pool = lambda model, batch: Pool(2, batch, RooflineCost(resolve_model(model), hw), hw.name)  # noqa: E731
    return Scenario(name="shared", draft=pool("qwen3-0.6b", 32), target=pool("qwen3-8b", 16),
                    acceptance=AcceptanceModel(rates=[0.75]), link=Link(25e9, 10e-6), workload=workload,
                    policy=PolicyConfig(k=4), **kw)


def test_prompts_that_name_the_same_blocks_share_exactly_their_start() -> None:
    a, b = prompt_of(1, 1000, (7, 8), 700), prompt_of(2, 900, (7, 8), 700)
    assert len(a) == 1000 and len(b) == 900 and a[:700] == b[:700] and a[700] != b[700]
    assert not set(a[700:]) & set(b[700:]) and not set(a[700:]) & set(a[:700])  # (its own tokens: its own)
    assert a[:HASH_BLOCK] == prompt_of(3, HASH_BLOCK, (7,), HASH_BLOCK)  # (a block's tokens: its id's alone)
    assert prompt_of(4, 600, (7, 9), 600)[HASH_BLOCK:] != a[HASH_BLOCK:600]


def test_a_simulated_prefix_cache_finds_whole_blocks_and_keeps_the_latest_finished() -> None:
    doc = prompt_of(1, 200, (1,), 100)
    cache = SimPrefixCache(keep=2)
    assert cache.held(doc) == 0
    cache.hold(1, doc, 150)
    other = prompt_of(2, 300, (1,), 100)
    assert cache.held(other) == (100 // BLOCK) * BLOCK  # (the shared 100 tokens, in whole blocks)
    assert cache.held(doc + [5]) == (150 // BLOCK) * BLOCK  # (what request 1 holds: more of its own)
    for rid in (1, 2, 3):  # (finished, kept: the oldest goes past keep)
        cache.hold(rid, prompt_of(rid, 200, (rid + 10,), 200) if rid > 1 else doc, 150)
        cache.finish(rid)
    assert cache.held(other) == 0 and cache.held(prompt_of(9, 200, (13,), 200)) == 144
    assert set(cache.finished) == {2, 3} and not cache.live
    cache.hold(4, prompt_of(4, 200, (20,), 200), 150)  # (running: a pull's start copies only a finished one's)
    assert cache.held(prompt_of(9, 200, (20,), 200)) == 144 and cache.held(prompt_of(9, 200, (20,), 200), True) == 0
    assert cache.held(prompt_of(9, 200, (13,), 200), True) == 144


def test_kv_that_follows_a_pooled_request_travels_from_where_the_new_workers_prefix_cache_ends() -> None:
    """Pooled requests move between workers every few rounds; on a long shared document each move's
    pull starts where a finished request's KV on the new worker ends, as a live store's does."""
    sc = gpu_scenario(Workload(requests=192, output_tokens=32, prompt_tokens=(32, 64), concurrency=48,
                               shared_prefix=1536, documents=1))
    res = simulate(sc, "pooled")
    document = 1536 * max(sc.draft.cost.kv_bytes_per_token, sc.target.cost.kv_bytes_per_token)
    assert res["kv_pulls"] > 20 and res["kv_pull_saved_positions"] > 20 * 1536
    assert res["kv_bytes"] / res["kv_pulls"] < 0.5 * document  # (each pull moved the document: ~0.95x)
    assert simulate(replace(sc, prefix_cache=False), "pooled")["kv_pull_saved_positions"] == 0


def test_a_shared_document_is_computed_once_a_worker_and_the_cache_off_computes_it_for_each() -> None:
    wl = Workload(requests=96, output_tokens=32, prompt_tokens=(32, 64), concurrency=24, shared_prefix=1536, documents=2)
    sc = gpu_scenario(wl)
    for mode in ("colocated", "pooled", "elastic"):
        on, off = simulate(sc, mode), simulate(replace(sc, prefix_cache=False), mode)
        assert on["requests"] == off["requests"] == 96, mode
        assert on["prompt_cached"] > 0.8 and off["prompt_cached"] is None, (mode, on["prompt_cached"])
        assert on["ttft_s"]["p50"] < 0.5 * off["ttft_s"]["p50"], mode
        assert on["tokens_per_s"] > 1.3 * off["tokens_per_s"], mode
    blank = simulate(replace(sc, workload=replace(wl, shared_prefix=0)), "colocated")
    assert blank["prompt_cached"] is None and blank["prefix_cached_positions"] == 0  # (blanks: nothing shared)


def test_a_colocated_request_bound_away_from_its_document_pulls_it_where_pulls_are_on() -> None:
    sc = gpu_scenario(Workload(requests=96, output_tokens=32, prompt_tokens=(32, 64), concurrency=24,
                               shared_prefix=1536, documents=2))
    on = simulate(sc, "colocated")
    off = simulate(replace(sc, policy=sc.policy.replace(prefix_pulls=False)), "colocated")
    assert on["prefix_pulled_positions"] > 0 and off["prefix_pulled_positions"] == 0
    assert on["prompt_cached"] > off["prompt_cached"]


def test_a_mooncake_traces_hash_ids_share_their_blocks_in_the_simulator(tmp_path) -> None:  # noqa: ANN001
    """Requests far apart in time, each naming blocks 0 and 1 and one of its own: every one after the
    first finds the two shared blocks (1,024 tokens) in the one worker's prefix cache."""
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 5000 * i, "input_length": 1400, "output_length": 8,
                                           "hash_ids": [0, 1, 100 + i]}) for i in range(5)))
    sc = gpu_scenario(Workload(trace=str(trace)))
    res = simulate(replace(sc, target=replace(sc.target, workers=1)), "colocated", 1, 1)
    assert res["requests"] == 5 and res["prefix_cached_positions"] == 2 * 4 * 2 * HASH_BLOCK  # (both models' KV)
    assert res["prompt_cached"] == pytest.approx(4 * 2 * HASH_BLOCK / (5 * 1400))


def test_simulated_placement_by_prefix_replays_into_the_brokers_policy_identically() -> None:
    sc = gpu_scenario(Workload(requests=48, output_tokens=16, prompt_tokens=(16, 32), concurrency=16,
                               shared_prefix=512, documents=3))
    for mode in ("elastic", "colocated", "pooled"):
        sim = Simulator(sc, mode, policy=policy_log.RecordingScheduler)
        sim.run()
        assert any(r[0] == "admit" and r[6] for r in sim.policy.records), mode  # (placement found prefixes)
        report = policy_log.replay(sim.policy.records, Broker(BrokerOptions(mode=mode, policy=sc.policy)).scheduler)
        assert report.decisions > 20 and report.identical, (mode, report.mismatches[:3])


def test_simulate_turns_the_prefix_cache_off_for_a_mode_and_refuses_bad_settings(tmp_path) -> None:  # noqa: ANN001
    scenario = tmp_path / "s.toml"
    scenario.write_text(SHARED.read_text().replace("requests = 512", "requests = 48").replace("concurrency = 64",
                                                                                             "concurrency = 16"))
    result = CliRunner().invoke(main, ["simulate", str(scenario), "--modes",
                                       "colocated@prefix_cache=false,colocated", "--json"])
    assert result.exit_code == 0, result.output
    modes = json.loads(result.output.strip().splitlines()[-1])["modes"]
    assert modes["colocated@prefix_cache=false"]["prompt_cached"] is None and modes["colocated"]["prompt_cached"] > 0.5
    bad = CliRunner().invoke(main, ["simulate", str(scenario), "--modes", "colocated@prefix_cache=maybe"])
    assert bad.exit_code != 0 and "prefix_cache must be true or false" in bad.output
    for text, message in (("documents = 8", "documents = 0"), ("prefix_cache = true", 'prefix_cache = "yes"')):
        scenario.write_text(SHARED.read_text().replace(text, message))
        with pytest.raises(ConfigError, match="documents >= 1" if "documents" in message else "prefix_cache must be"):
            load_scenario(scenario)
