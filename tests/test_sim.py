"""The simulator: the live policy on a virtual clock, its cost models, scenarios and CLI."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from nebula_flow import policy_log
from nebula_flow.cli import main
from nebula_flow.client import AsyncClient
from nebula_flow.config import ConfigError
from nebula_flow.deploy import Deployment
from nebula_flow.policy import PolicyConfig, knob_names
from nebula_flow.scheduler import Scheduler
from nebula_flow.sim.acceptance import AcceptanceModel
from nebula_flow.sim.costs import Link, ProfileCost, RooflineCost
from nebula_flow.sim.engine import Simulator, simulate
from nebula_flow.sim.hardware import HARDWARE, MODELS, resolve_model
from nebula_flow.sim.planner import sweep
from nebula_flow.sim.scenario import Drafter, HostCosts, Pool, Scenario, Workload, load_scenario
from nebula_flow.speclen import DEFAULT_COSTS
from nebula_flow_broker.server import Broker, BrokerOptions
from tests.conftest import deploy_config

REPO = Path(__file__).resolve().parent.parent
PAPER = REPO / "configs" / "sim" / "paper-2d2t.toml"


def flat_profile(base_s: float, per_seq_s: float = 0.0) -> ProfileCost:
    return ProfileCost({"name": "flat", "model": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "vocab_size": 100},
                        "latency": {"base_s": base_s, "per_seq_s": per_seq_s}})


def small_scenario(**kw) -> Scenario:  # noqa: ANN003
    """A small scenario; policy knobs among ``kw`` go to its policy (costs fixed unless asked)."""
    knobs = {"measure_costs": False, **{n: kw.pop(n) for n in knob_names() if n in kw}}
    base = dict(name="small", draft=Pool(2, 16, flat_profile(0.001)), target=Pool(2, 8, flat_profile(0.01)),
                acceptance=AcceptanceModel(rates=[0.7]), link=Link(10e9, 10e-6),
                workload=Workload(requests=48, output_tokens=24, prompt_tokens=(8, 24)), policy=PolicyConfig(**knobs))
    base.update(kw)
    return Scenario(**base)


# -- cost models ----------------------------------------------------------------------------
def test_roofline_model_sizes_and_a_memory_bound_decode() -> None:
    assert MODELS["qwen3-8b"].params == pytest.approx(8.19e9, rel=0.01)
    assert MODELS["qwen3-0.6b"].params == pytest.approx(0.596e9, rel=0.01)
    assert MODELS["qwen3-8b"].kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    hw = HARDWARE["rtx4090"]
    cost = RooflineCost(MODELS["qwen3-8b"], hw)
    one = cost.forward_s(1, 1, 128)
    weights = MODELS["qwen3-8b"].weight_bytes / (hw.mem_bw * hw.mbu)
    assert one == pytest.approx(weights + hw.fixed_s + hw.per_layer_s * 36, rel=0.02)  # memory-bound
    # A big prefill is compute-bound: ~2 FLOP per parameter per token.
    big = cost.forward_s(8, 8 * 2048, 8 * 2048)
    assert big > 2 * 8e9 * 8 * 2048 / (hw.flops * hw.mfu)
    assert RooflineCost(MODELS["qwen3-8b"], HARDWARE["h100"]).forward_s(1, 1, 128) < one


def test_model_spec_from_a_checkpoint_config(tiny_pair) -> None:  # noqa: ANN001
    spec = resolve_model(str(tiny_pair / "target"))
    cfg = json.loads((tiny_pair / "target" / "config.json").read_text())
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (cfg["num_hidden_layers"], cfg["hidden_size"],
                                                                    cfg["vocab_size"])
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model")


def test_profile_grid_is_interpolated_and_extended_by_the_fit() -> None:
    grid = [{"batch": b, "tokens": t, "context": c, "seconds": 0.01 * b + 0.001 * t + 1e-5 * c + (0.002 if b == 4 else 0)}
            for b in (1, 4) for t in (1, 5) for c in (100, 300)]
    prof = {"name": "g", "model": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "vocab_size": 100},
            "latency": {"base_s": 0.0, "per_seq_s": 0.01, "per_token_s": 0.001, "per_ctx_token_s": 1e-5}, "grid": grid}
    cost = ProfileCost(prof)
    # A grid point is reproduced exactly (batch 4, 5 new tokens each, 300 cached positions each).
    assert cost.forward_s(4, 20, 4 * 305) == pytest.approx(0.04 + 0.005 + 0.003 + 0.002)
    # Halfway between two batch sizes: halfway between the measured times.
    mid = cost.forward_s(2, 2, 2 * 101)
    lo, hi = cost.forward_s(1, 1, 101), cost.forward_s(3, 3, 3 * 101)
    assert lo < mid < hi
    # Beyond the grid the fitted slope continues it.
    assert cost.forward_s(8, 8, 8 * 101) > cost.forward_s(4, 4, 4 * 101)


def test_acceptance_draws_follow_the_rates_and_are_reproducible() -> None:
    acc = AcceptanceModel(rates=[0.8, 0.5])
    draws = [acc.accepted(rid, 1, 4) for rid in range(4000)]
    assert draws == [acc.accepted(rid, 1, 4) for rid in range(4000)]
    mean_tokens = sum(d + 1 for d in draws) / len(draws)
    assert mean_tokens == pytest.approx(acc.expected_tokens_per_round(4), rel=0.03)
    assert acc.expected_tokens_per_round(4) == pytest.approx(1 + 0.8 + 0.4 + 0.2 + 0.1)
    hist = AcceptanceModel(histogram={1: 1, 3: 3})
    assert {hist.accepted(r, 0, 4) for r in range(200)} == {0, 2}
    assert {hist.accepted(r, 0, 1) for r in range(200)} == {0, 1}  # never more than k


def test_requests_differ_in_acceptance_around_the_configured_mean() -> None:
    """``concentration``: each request draws its own rate (a Beta around the configured one), so
    requests' acceptance spreads far beyond what rounds of one shared rate give; the mean stays."""
    alike, apart = AcceptanceModel(rates=[0.6, 0.6]), AcceptanceModel(rates=[0.6, 0.6], concentration=2.0)
    firsts = [apart.request_rates(rid)[0] for rid in range(3000)]
    assert sum(firsts) / len(firsts) == pytest.approx(0.6, abs=0.02)
    assert statistics.pstdev(firsts) == pytest.approx((0.6 * 0.4 / 3) ** 0.5, rel=0.1)  # Beta(1.2, 0.8)
    assert all(r[1] == pytest.approx(r[0]) for r in map(apart.request_rates, range(50)))  # deeper rates scaled alike
    assert firsts[:50] == [AcceptanceModel(rates=[0.6, 0.6], concentration=2.0).request_rates(rid)[0] for rid in range(50)]

    def per_request(acc: AcceptanceModel) -> list[float]:  # each request's rounds that accepted their first draft
        return [sum(acc.accepted(rid, r, 4) > 0 for r in range(40)) / 40 for rid in range(300)]

    spread_alike, spread_apart = statistics.pstdev(per_request(alike)), statistics.pstdev(per_request(apart))
    assert spread_apart > 3 * spread_alike
    assert statistics.mean(per_request(apart)) == pytest.approx(0.6, abs=0.04)  # (the first position's mean)
    for bad in ({"rate": 0.6, "concentration": -1}, {"rate": 1.0, "concentration": 2},
                {"histogram": {"1": 1}, "concentration": 2}):
        with pytest.raises(ValueError, match="concentration"):
            AcceptanceModel.from_config(bad, 0)
    # the live policy plans each request from its own acceptance: k differs between requests
    sc = small_scenario(adaptive_k=True, acceptance=AcceptanceModel(rates=[0.6], concentration=1.0),
                        workload=Workload(requests=48, output_tokens=64, prompt_tokens=(8, 8)))
    res = simulate(sc, "pooled")
    assert res["requests"] == 48 and res["tokens"] == 48 * 64


def test_the_draft_s_guesses_of_the_target_s_token_follow_their_rates() -> None:
    """Draft-ahead's bets in the simulator: after a rejection the draft's r-th other guess is right
    with ``alternative_rate`` where those before it were not; after the whole draft its own next
    token is right as a draft token there is, then its next guesses likewise (as the emulated draft)."""
    acc = AcceptanceModel(rates=[0.7], alternative_rate=0.4)
    after_rejection = Counter(acc.guessed(rid, 3, 1, 4) for rid in range(20_000))
    left = 20_000
    for rank in (1, 2, 3):
        assert after_rejection[rank] / left == pytest.approx(0.4, abs=0.02)
        left -= after_rejection[rank]
    assert set(after_rejection) == {0, 1, 2, 3} and after_rejection[0] == left
    after_all = Counter(acc.guessed(rid, 3, 4, 4) for rid in range(20_000))
    assert after_all[1] / 20_000 == pytest.approx(0.7, abs=0.02) and set(after_all) == {0, 1, 2, 3, 4}
    assert after_all[2] / (20_000 - after_all[1]) == pytest.approx(0.4, abs=0.03)
    assert [acc.guessed(rid, 3, 1, 4) for rid in range(50)] == [acc.guessed(rid, 3, 1, 4) for rid in range(50)]
    # rank by rank, as a real pair's fall (the bundled pair's on code: 0.28, 0.19, 0.09)
    acc = AcceptanceModel.from_config({"rate": 0.7, "alternative_rate": 0.4, "guess_rates": [0.3, 0.2, 0.1]}, 0)
    ranks, left = Counter(acc.guessed(rid, 3, 1, 4) for rid in range(20_000)), 20_000
    for rank, rate in ((1, 0.3), (2, 0.2), (3, 0.1)):
        assert ranks[rank] / left == pytest.approx(rate, abs=0.02)
        left -= ranks[rank]
    assert acc.alternative_rate == 0.4  # (runner-ups keep theirs)
    assert AcceptanceModel.from_config({"rate": 0.7, "guess_rates": [0.3]}, 0).guess_rates == [0.3, 0.3, 0.3]
    for bad in ([0.3, 0.2, 0.1, 0.05], [1.5], [], "high"):
        with pytest.raises(ValueError, match="guess_rates must be a rate in"):
            AcceptanceModel.from_config({"rate": 0.7, "guess_rates": bad}, 0)


def test_a_model_with_another_seed_keeps_everything_else() -> None:
    """``simulate --seed`` rebuilt the acceptance model from its rates and token-tree keys alone,
    dropping the requests' spread (``concentration``)."""
    acc = AcceptanceModel(rates=[0.6, 0.5], concentration=4.0, alternative_rate=0.3, guess_rates=[0.3, 0.2])
    other = acc.with_seed(9)
    assert (other.seed, other.concentration, other.guess_rates, other.rates) == (9, 4.0, [0.3, 0.2, 0.2], [0.6, 0.5])
    assert acc.seed == 0 and [other.request_rates(r) for r in range(20)] != [acc.request_rates(r) for r in range(20)]


def test_token_tree_draws_follow_their_rates_and_are_reproducible() -> None:
    acc = AcceptanceModel(rates=[0.5], alternative_rate=0.4, fused_match=0.5, fused_win=0.6, fused_gain=3.0)
    draws = [acc.tree_round(rid, 1, 4, 1, 12) for rid in range(8000)]
    assert draws == [acc.tree_round(rid, 1, 4, 1, 12) for rid in range(8000)]
    assert [d[2] for d in draws] == [acc.accepted(rid, 1, 4) for rid in range(8000)]  # the draft's own: as before
    found = [d for d in draws if d[3] is not None]
    won = [d for d in found if d[3] > 0]
    assert len(found) / len(draws) == pytest.approx(0.5, abs=0.03)
    assert len(won) / len(found) == pytest.approx(0.6, abs=0.03)
    assert sum(d[3] for d in won) / len(won) == pytest.approx(3.0, rel=0.06)  # (a chain of 12 leaves room)
    assert all(a == c + f and not via for a, via, c, f in won)
    contested = [d for d in draws if d[2] == 0 and not (d[3] or 0)]  # first draft token rejected, no chain won
    assert sum(d[1] for d in contested) / len(contested) == pytest.approx(0.4, abs=0.04)
    assert all(a == 1 for a, via, _, _ in draws if via)
    plain = AcceptanceModel(rates=[0.5])  # no trees asked for or none modelled: the draft's draw alone
    assert [plain.tree_round(r, 1, 4, 1, 12)[:3] for r in range(500)] == [(plain.accepted(r, 1, 4), False,
                                                                          plain.accepted(r, 1, 4)) for r in range(500)]
    assert all(acc.tree_round(r, 1, 4, 0, 0)[1:] == (False, acc.accepted(r, 1, 4), None) for r in range(500))
    # a chain no longer than what the draft already won leaves nothing to win
    assert all(f == 0 for _, _, c, f in (acc.tree_round(r, 1, 4, 0, 2) for r in range(500)) if f is not None and c >= 2)
    with pytest.raises(ValueError, match="fused_gain"):
        AcceptanceModel(rates=[0.5], fused_gain=0.5)


def test_token_tree_parameters_from_a_live_brokers_status(tmp_path) -> None:  # noqa: ANN001
    status = {"proposed_by_position": [100, 60], "accepted_by_position": [60, 30],
              "counters": {"alternatives_contested": 40, "alternatives_accepted": 10, "fused_asked": 100,
                           "fused_chains": 25, "fused_rounds_won": 20, "fused_tokens_accepted": 90}}
    path = tmp_path / "status.json"
    path.write_text(json.dumps(status))
    acc = AcceptanceModel.from_status(path)
    assert acc.rates == pytest.approx([0.6, 0.5 / 0.6]) and acc.tree() == {"alternative_rate": 0.25, "fused_match": 0.25,
                                                                            "fused_win": 0.8, "fused_gain": 4.5}
    mixed = AcceptanceModel.from_config({"status": str(path), "fused_win": 0.1}, 0)  # the scenario's own entries win
    assert mixed.rates == acc.rates and mixed.fused_win == 0.1 and mixed.fused_gain == 4.5
    with pytest.raises(ValueError, match="unknown keys"):
        AcceptanceModel.from_config({"rate": 0.7, "alt_rate": 0.2}, 0)


# -- the engine -----------------------------------------------------------------------------
def test_a_saturated_target_pool_runs_at_the_cost_models_rate() -> None:
    """Autoregressive, 1 worker, 10 ms per forward whatever the batch, 64 requests at once:
    full batches of 8 back to back, so 8 rounds per 10 ms (plus the message round trips). (One
    token a round: the last request, alone in the pool, would decode several; test_decode_steps.py.)"""
    sc = small_scenario(draft=Pool(1, 8, flat_profile(0.01)), target=Pool(1, 8, flat_profile(0.01)),
                        workload=Workload(requests=64, output_tokens=16, prompt_tokens=(4, 4)),
                        host=HostCosts(message_latency_us=0.0), decode_steps=1)
    res = simulate(sc, "autoregressive", 1, 0 + 1)
    # worker_plan gives autoregressive M + N target workers: 2 workers of 8 here.
    assert res["rounds"] == 64 * 16 and res["tokens_per_round"] == 1.0
    assert res["round_rate"] == pytest.approx(2 * 8 / 0.01, rel=0.02)
    assert all(w["mean_batch"] == 8 for w in res["workers"])


def test_tokens_per_round_follow_the_acceptance_model() -> None:
    sc = small_scenario(workload=Workload(requests=64, output_tokens=200, prompt_tokens=(8, 8)))
    res = simulate(sc, "pooled")
    # Rounds near the end ask for fewer drafts (k is capped by what remains), so slightly fewer.
    assert res["tokens_per_round"] == pytest.approx(sc.acceptance.expected_tokens_per_round(4), rel=0.05)
    assert res["requests"] == 64 and res["tokens"] == 64 * 200


def test_same_seed_same_result_other_seed_other_result() -> None:
    a, b = simulate(small_scenario(), "pooled"), simulate(small_scenario(), "pooled")
    assert a == b
    c = simulate(small_scenario(seed=1, acceptance=AcceptanceModel(rates=[0.7], seed=1)), "pooled")
    assert c["round_rate"] != a["round_rate"]


def test_token_trees_cost_their_rows_and_win_what_the_model_says() -> None:
    """Runner-ups and fused chains: the simulated target scores their rows (here each new row
    costs 1 ms beside a 10 ms forward) and rounds commit what the acceptance model gives them."""
    row_cost = ProfileCost({"name": "rows", "model": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
                                                      "vocab_size": 100},
                            "latency": {"base_s": 0.01, "per_seq_s": 0.0, "per_token_s": 0.001}})
    wl = Workload(requests=8, output_tokens=120, prompt_tokens=(8, 8), concurrency=1)

    def run(rates: list[float], **tree) -> dict:  # noqa: ANN003
        knobs = {k: tree.pop(k) for k in ("first_alternatives", "fuse_ngram") if k in tree}
        return simulate(small_scenario(target=Pool(1, 8, row_cost), workload=wl, draft=Pool(1, 8, flat_profile(0.001)),
                                       acceptance=AcceptanceModel(rates=rates, **tree), **knobs), "pooled")

    plain = run([0.7])
    alts = run([0.7], first_alternatives=1, alternative_rate=0.5)
    # a runner-up wins half the rounds whose first draft token was rejected (30 %): +0.15 tokens
    assert alts["tokens_per_round"] - plain["tokens_per_round"] == pytest.approx(0.15, abs=0.04)
    idle_alts = run([0.7], first_alternatives=1)  # runner-ups that never win: one more row a round, for nothing
    assert idle_alts["tokens_per_round"] == plain["tokens_per_round"] and idle_alts["round_rate"] < plain["round_rate"]
    chains = run([0.7], fuse_ngram=8, fused_match=1.0, fused_win=0.5, fused_gain=3.0)
    assert chains["tokens_per_round"] > plain["tokens_per_round"] + 0.5
    lost = run([0.7], fuse_ngram=8, fused_match=1.0)  # chains found every round, never winning: 8 rows for nothing
    assert lost["tokens_per_round"] == plain["tokens_per_round"]
    assert lost["round_rate"] < 0.8 * plain["round_rate"]
    assert run([0.7], fuse_ngram=8)["round_rate"] == plain["round_rate"]  # no chain found: no rows


def test_several_drafters_are_routed_by_the_live_policy_and_drafted_from_their_own_acceptance() -> None:
    """[draft] agrees 30 % of the time, a second drafter "good" 90 %, at the same cost: routing
    (adaptive k, the live policy) gives most rounds to "good", and tokens per round follow it."""
    wl = Workload(requests=16, output_tokens=96, prompt_tokens=(8, 8), concurrency=4)
    alone = small_scenario(workload=wl, adaptive_k=True, acceptance=AcceptanceModel(rates=[0.3]))
    both = small_scenario(workload=wl, adaptive_k=True, acceptance=AcceptanceModel(rates=[0.3]),
                          drafters=[Drafter("good", Pool(1, 16, flat_profile(0.001)), AcceptanceModel(rates=[0.9]))])
    a, b = simulate(alone, "pooled"), simulate(both, "pooled")
    assert set(a["rounds_by_drafter"]) == {"draft"}
    assert b["rounds_by_drafter"]["good"] > 4 * b["rounds_by_drafter"].get("draft", 0) > 0  # (it explores)
    assert b["tokens_per_round"] > a["tokens_per_round"] + 1.0
    assert simulate(both, "paired")["rounds_by_drafter"].keys() == {"draft"}  # (baselines: [draft] alone)
    log = Simulator(both, "pooled", policy=policy_log.RecordingScheduler)
    log.run()
    assert {r[5] for r in log.policy.records if r[0] == "register" and r[2] == "draft"} == {"draft", "good"}


def test_the_drafters_scenario_gives_the_weak_cheap_drafter_few_rounds() -> None:
    """configs/sim/paper-2d2t-drafters.toml: a prompt-lookup drafter (35 %, nearly free) beside
    Qwen3-0.6B (75 %), token trees on. Every request finds the same acceptance there, so the
    weak drafter should get little beyond its looks (22 % of rounds before ``routing.shrunk``)."""
    res = simulate(load_scenario(REPO / "configs" / "sim" / "paper-2d2t-drafters.toml"), "pooled")
    by = res["rounds_by_drafter"]
    assert set(by) == {"draft", "ngram"} and by["ngram"] < 0.15 * sum(by.values()), by
    assert res["tokens_per_round"] > 3.05  # (a chain alone at k = 4: 3.05; the trees win more)


def test_simulated_workers_report_forward_times_for_measured_costs() -> None:
    """As live workers do: the policy weighs the cost models' forward times (a draft step of
    1 ms against a 10 ms decode step), not ``spec_costs``, with measure_costs."""
    sim = Simulator(small_scenario(measure_costs=True, adaptive_k=True), "pooled")
    sim.run()
    assert sim.policy.costs[0] == pytest.approx(0.1) and sim.policy.verify_costs[0] == 1.0
    fixed = Simulator(small_scenario(adaptive_k=True), "pooled")
    fixed.run()
    assert fixed.policy.costs == tuple(DEFAULT_COSTS)


def test_forced_migration_moves_kv_and_a_free_link_costs_nothing() -> None:
    moved = simulate(small_scenario(migrate=True, locality=False), "pooled")
    kept = simulate(small_scenario(), "pooled")
    assert moved["kv_pulls"] > 0 and moved["kv_bytes"] > kept["kv_bytes"]
    assert moved["kv_bytes"] % 32 == 0  # whole positions: 2 layers x 1 head x 8 dims x k|v x fp16
    slow = simulate(small_scenario(migrate=True, locality=False, link=Link(1e6, 1e-3)), "pooled")
    free = simulate(small_scenario(migrate=True, locality=False, link=Link.free()), "pooled")
    assert slow["kv_stall_fraction"] > 0 and free["kv_stall_fraction"] == 0.0
    assert slow["round_rate"] < free["round_rate"]
    # A link slower than twice computing the positions is not used: workers recompute, as live
    # workers do with the links they measured (kv/link_fit.py); nothing waits on it.
    crawl = simulate(small_scenario(migrate=True, locality=False, link=Link(1e4, 0.05)), "pooled")
    assert crawl["kv_pulls"] == 0 and crawl["kv_stall_fraction"] == 0.0
    assert crawl["kv_recomputed_positions"] > slow["kv_recomputed_positions"]
    assert crawl["requests"] == 48 and crawl["round_rate"] > slow["round_rate"]


def test_every_mode_finishes_every_request() -> None:
    for mode in ("pooled", "paired", "colocated", "autoregressive"):
        res = simulate(small_scenario(), mode)
        assert res["requests"] == 48 and res["tokens"] == 48 * 24, mode


def test_open_loop_arrivals_and_latency_percentiles() -> None:
    sc = small_scenario(workload=Workload(requests=40, output_tokens=16, prompt_tokens=(8, 8), poisson_rate=50.0))
    res = simulate(sc, "pooled")
    assert res["requests"] == 40
    assert 0 < res["ttft_s"]["p50"] <= res["latency_s"]["p50"] <= res["latency_s"]["p99"]
    assert res["wall_s"] > 40 / 50.0 * 0.5  # arrivals spread over ~0.8 s


def test_scaling_sweep_with_free_kv_stays_near_proportional() -> None:
    sc = small_scenario(link=Link.free(), workload=Workload(requests=64, output_tokens=64, prompt_tokens=(8, 8)))
    rows = sweep(sc, "pooled", [1, 2, 4, 8])
    assert [(r["draft_workers"], r["target_workers"]) for r in rows] == [(1, 1), (2, 2), (4, 4), (8, 8)]
    assert rows[-1]["requests"] == 64 * 4  # the load grows with the pools
    assert all(r["proportional"] >= 0.9 for r in rows)


# -- one policy: the simulator's and the broker's decisions are identical --------------------
def test_simulated_events_replayed_into_the_brokers_policy_give_identical_decisions() -> None:
    sc = small_scenario()
    sim = Simulator(sc, "pooled", policy=policy_log.RecordingScheduler)
    sim.run()
    records = sim.policy.records
    broker = Broker(BrokerOptions(mode="pooled", policy=sc.policy))
    report = policy_log.replay(records, broker.scheduler)
    assert report.decisions > 20 and report.identical, report.mismatches[:3]
    # The check can fail: a policy with a different knob decides differently on the same events.
    other = policy_log.replay(records, Scheduler("pooled", sc.policy.replace(locality=not sc.policy.locality)))
    assert not other.identical


@pytest.mark.slow
def test_live_broker_events_replayed_into_the_simulators_policy_give_identical_decisions(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    cfg = deploy_config(tiny_pair, "pooled", 2, 2, max_batch=4)
    log_path = tmp_path / "policy.jsonl"
    cfg.broker.policy_log = str(log_path)
    # (a second wave starts where the first's KV stays: the placement's prefixes.py; in the first, requests
    # wait for the one computing their shared start, ``wait_for_prefix``)
    shared = list(range(100, 180))

    async def load(address: str) -> None:
        async with AsyncClient(address) as c:
            for _ in range(2):
                await asyncio.gather(*(c.generate(token_ids=shared + [5 + i, 6, 7], max_new_tokens=12, ignore_eos=True)
                                       for i in range(10)))

    with Deployment(cfg) as dep:
        asyncio.run(load(dep.address))
    records = policy_log.load(log_path)
    assert records[0] == ["policy", "pooled", {"k": 4, "locality": True, "migrate": False, "prefix_affinity": True,
                                               "prefix_pulls": True, "prefix_pull_cost": 1.0, "wait_for_prefix": 0.5,
                                               "priority_scheduling": False,
                                               "merge_batches": True, "adaptive_k": False, "spec_costs": list(DEFAULT_COSTS),
                                               "measure_costs": True, "first_alternatives": 0,
                                               "fuse_ngram": 0, "disable_by_batch_size": 0, "elastic_split": 0,
                                               "draft_ahead": 0, "fuse_drafters": 0, "decode_steps": 4, "max_forward_tokens": 0,
                                               "max_burst_tokens": 0}]
    # the workers' forward times are events too (the policy weighs them with adaptive k)
    assert {r[2] for r in records if r[0] == "step_costs"} == {"draft", "target"}
    assert sum(bool(r[6]) for r in records if r[0] == "admit") >= 10  # (the second wave's: where their prefix was)
    assert any(r[8] is not None for r in records if r[0] == "admit")  # (the first wave's: they waited)
    sc = small_scenario(k=4, locality=True, measure_costs=True)
    report = policy_log.replay(records, Simulator(sc, "pooled").policy)
    assert report.decisions >= 10 and report.identical, report.mismatches[:3]
    result = CliRunner().invoke(main, ["simulate", "--check-policy-log", str(log_path)])
    assert result.exit_code == 0 and "all identical" in result.output


# -- scenarios and the command line ---------------------------------------------------------
def test_the_paper_scenario_loads() -> None:
    sc = load_scenario(PAPER)
    assert (sc.draft.workers, sc.target.workers, sc.draft.max_batch, sc.target.max_batch, sc.policy.k) == (2, 2, 64, 16, 4)
    assert sc.workload.requests == 512 and sc.workload.output_tokens == 128 and sc.workload.prompt_tokens == (96, 144)
    assert sc.draft.cost.name == "qwen3-0.6b@rtx4090" and sc.target.cost.name == "qwen3-8b@rtx4090"


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "sim").glob("*.toml")), ids=lambda p: p.stem)
def test_every_bundled_scenario_loads(path: Path) -> None:
    """(One that takes its pools from a deployment: the deployment's policy knobs too.)"""
    if path.stem == "paper-2d2t-trace" and not (REPO.parent / "shared" / "traces").is_dir():
        with pytest.raises(ConfigError, match="trace .* not found"):
            load_scenario(path)
        pytest.skip("the shared traces folder is not beside this checkout")
    sc = load_scenario(path)
    assert sc.draft.workers >= 1 and sc.target.workers >= 1 and sc.modes
    if path.stem == "emulated-2d2t":
        assert sc.policy.k == 4 and "elastic" in sc.modes
    if path.stem == "paper-2d2t-trace":  # the Azure code trace beside the repository: its first 512 requests
        assert len(sc.workload.arrivals(0)) == 512


def test_a_scenarios_policy_knobs_reach_the_simulated_policy(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "s.toml"
    path.write_text(PAPER.read_text().replace("[policy]", "[policy]\nadaptive_k = true\ndisable_by_batch_size = 2\n"
                                              "spec_costs = [0.05, 0.01, 1.2]\nfirst_alternatives = 1\nfuse_ngram = 4", 1))
    sc = load_scenario(path)
    knobs = Simulator(sc, "pooled").policy.policy
    assert (knobs.adaptive_k, knobs.disable_by_batch_size, knobs.spec_costs) == (True, 2, (0.05, 0.01, 1.2))
    assert (knobs.first_alternatives, knobs.fuse_ngram) == (1, 4)  # (token trees are modelled)


def test_a_scenario_with_several_drafters_loads_and_bad_drafters_get_clear_errors(tmp_path) -> None:  # noqa: ANN001
    base = PAPER.read_text()
    path = tmp_path / "d.toml"
    path.write_text(base + '\n[[drafters]]\nname = "ngram"\nmodel = "qwen3-0.6b"\nhardware = "rtx4090"\n'
                    'workers = 1\nacceptance = { rate = 0.2, fused_match = 0.5 }\n')
    sc = load_scenario(path)
    [d] = sc.drafters
    assert (d.name, d.pool.workers, d.acceptance.rates, d.acceptance.fused_match) == ("ngram", 1, [0.2], 0.5)
    path.write_text(base + '\n[[drafters]]\nname = "fast"\nmodel = "qwen3-0.6b"\nhardware = "rtx4090"\n')
    assert load_scenario(path).drafters[0].acceptance.rates == [0.75]  # (default: [acceptance]'s)
    for extra, message in (('name = "draft"', "name must be"), ('name = "a b"', "name must be"),
                           ('name = "x"\nbogus = 1', "unknown keys"), ('name = "x"', "give a cost model"),
                           ('name = "x"\nprofile = "p"\nacceptance = { rat = 1 }', "acceptance")):
        path.write_text(base + "\n[[drafters]]\n" + extra + "\n")
        with pytest.raises(ConfigError, match=message):
            load_scenario(path)
    path.write_text("drafters = [1]\n" + base)
    with pytest.raises(ConfigError, match=r"\[\[drafters\]\] tables"):
        load_scenario(path)


def test_bad_scenarios_get_clear_errors(tmp_path) -> None:  # noqa: ANN001
    cases = {
        "bogus = 1\n[draft]\nprofile='x'\n[target]\nprofile='x'\n": "unknown keys",
        "[draft]\nmodel='gpt-9'\nhardware='rtx4090'\n[target]\nmodel='qwen3-8b'\nhardware='rtx4090'\n": "unknown model",
        "[draft]\nmodel='qwen3-0.6b'\nhardware='tpu'\n[target]\nmodel='qwen3-8b'\nhardware='rtx4090'\n": "unknown hardware",
        "[draft]\nworkers=1\n[target]\nmodel='qwen3-8b'\nhardware='rtx4090'\n": "give a cost model",
        "modes=['fast']\n[draft]\nmodel='qwen3-0.6b'\nhardware='h100'\n[target]\nmodel='qwen3-8b'\nhardware='h100'\n": "unknown modes",
        "[target]\nmodel='qwen3-8b'\nhardware='h100'\n": "[draft] is required",
    }
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"s{i}.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_scenario(path)
    result = CliRunner().invoke(main, ["simulate", str(tmp_path / "s1.toml")])
    assert result.exit_code != 0 and "unknown model" in result.output


def test_simulate_cli_json_sweep_and_plots(tmp_path) -> None:  # noqa: ANN001
    scenario = tmp_path / "s.toml"
    scenario.write_text(PAPER.read_text().replace("requests = 512", "requests = 64")
                        .replace("output_tokens = 128", "output_tokens = 32"))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["simulate", str(scenario), "--modes", "pooled,paired", "--sweep",
                                       "--sweep-workers", "1,2", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert set(data["modes"]) == {"pooled", "paired"} and data["modes"]["pooled"]["round_rate"] > 0
    assert [r["draft_workers"] for r in data["sweep"]] == [1, 2] and data["sweep"][1]["round_rate"] > 0
    assert data["ratios"]["pooled"] == 1.0
    assert (out / "modes.png").stat().st_size > 0 and (out / "scaling.png").stat().st_size > 0
    again = CliRunner().invoke(main, ["simulate", str(scenario), "--modes", "pooled,paired", "--json"])
    assert json.loads(again.output.strip().splitlines()[-1])["modes"] == data["modes"]  # deterministic


def test_grid_sweep_covers_every_pool_pair_and_more_targets_help_a_target_bound_load() -> None:
    sc = small_scenario(link=Link.free(), workload=Workload(requests=32, output_tokens=16, prompt_tokens=(8, 8)))
    rows = sweep(sc, "pooled", [1, 2], targets=[1, 2])
    assert [(r["draft_workers"], r["target_workers"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    rate = {(r["draft_workers"], r["target_workers"]): r["round_rate"] for r in rows}
    assert rate[(1, 2)] > 1.3 * rate[(1, 1)]  # 10 ms verifies against 1 ms drafts: targets bound
    result = CliRunner().invoke(main, ["simulate", str(PAPER), "--sweep", "--sweep-workers", "1,x"])
    assert result.exit_code != 0 and "comma-separated" in result.output


def test_trace_arrivals_drive_the_simulation(tmp_path) -> None:  # noqa: ANN001
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_s": 0.5 * i, "prompt_len": 20 + i, "max_new_tokens": 8 + i})
                               for i in range(6)))
    sc = small_scenario(workload=Workload(trace=str(trace), time_scale=2.0))
    res = simulate(sc, "pooled")
    assert res["requests"] == 6 and res["tokens"] == sum(8 + i for i in range(6))
    assert res["wall_s"] >= 5 * 0.5 / 2.0  # the last request arrives at 1.25 s (time scale 2)


def test_plan_tries_every_way_to_use_the_devices_best_first() -> None:
    from nebula_flow.sim.planner import plan

    rows = plan(small_scenario(link=Link.free()), 4)
    shapes = {(r["mode"], r["draft_workers"], r["target_workers"]) for r in rows}
    assert shapes == {("pooled", 1, 3), ("pooled", 2, 2), ("pooled", 3, 1), ("paired", 2, 2),
                      ("colocated", 2, 2), ("autoregressive", 2, 2), ("elastic", 1, 3), ("elastic", 2, 2),
                      ("elastic", 3, 1)}
    assert sum(r["shape"] == "4 workers" for r in rows if r["mode"] == "elastic") == 1  # all elastic, and beside drafts
    rates = [r["tokens_per_s"] for r in rows]
    assert rates == sorted(rates, reverse=True)
    # 1 ms drafts and 10 ms verifies: the pool that gives most devices to the target wins among pooled.
    pooled = {r["draft_workers"]: r["tokens_per_s"] for r in rows if r["mode"] == "pooled"}
    assert pooled[1] > pooled[2] > pooled[3]
    with pytest.raises(ValueError):
        plan(small_scenario(), 1)
    # two kinds of device: the scenario's own 2 + 2, every mode on them
    hetero = small_scenario(link=Link.free(), draft=Pool(2, 16, RooflineCost(MODELS["qwen3-0.6b"], HARDWARE["l4"]), "l4"),
                            target=Pool(2, 8, RooflineCost(MODELS["qwen3-8b"], HARDWARE["a100"]), "a100"))
    shapes = [(r["mode"], r["shape"]) for r in plan(hetero, 4)]
    assert sorted(shapes) == sorted([("pooled", "2 draft + 2 target"), ("paired", "2 draft + 2 target"),
                                     ("colocated", "4 workers"), ("autoregressive", "4 workers"),
                                     ("elastic", "4 workers"), ("elastic", "2 draft + 2 elastic")])
    with pytest.raises(ValueError, match="plan 4, not 6"):
        plan(hetero, 6)
    # each worker's models cost what they cost on its device: the first two are the draft pool's
    devices = {w.wid: {m: c.hw.name for m, c in w.costs.items()} for w in Simulator(hetero, "colocated").workers.values()}
    assert devices == {1: {"draft": "l4", "target": "l4"}, 2: {"draft": "l4", "target": "l4"},
                       3: {"draft": "a100", "target": "a100"}, 4: {"draft": "a100", "target": "a100"}}


def test_a_trace_scenario_is_planned_at_each_load(tmp_path) -> None:  # noqa: ANN001
    """`simulate TRACE-SCENARIO --gpus N --loads ...`: the trace time-scaled to each load's mean rate
    (its bursts kept), all at once at saturation. (It raised once the simulator's arrivals carried
    shared prompt starts, and nothing ran it.)"""
    from nebula_flow.sim.loads import ALL_AT_ONCE, at_rate

    trace = tmp_path / "trace.csv"  # (Azure's columns: 12 requests over 5.5 s, a burst of 4 at 2 s)
    stamps = ["00.000", "00.500", "01.000", "02.000", "02.010", "02.020", "02.030", "03.000", "04.000", "04.500",
              "05.000", "05.500"]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:17:{s}0000,{40 + 8 * i},{6 + i % 3}\n" for i, s in enumerate(stamps)))
    scenario = tmp_path / "s.toml"
    scenario.write_text((REPO / "configs" / "sim" / "paper-2d2t-trace.toml").read_text()
                        .replace("../shared/traces/AzureLLMInferenceTrace_code.csv", str(trace)))
    sc = load_scenario(scenario)
    native = 11 / 5.5  # requests/s: the trace's own mean rate
    scaled = at_rate(sc, 2 * native)
    assert scaled.time_scale == pytest.approx(2.0) and at_rate(sc, None).time_scale == ALL_AT_ONCE
    times = [a.at for a in scaled.arrivals(sc.seed)]
    assert times[-1] - times[0] == pytest.approx(5.5 / 2) and times[4] - times[3] == pytest.approx(0.005)
    result = CliRunner().invoke(main, ["simulate", str(scenario), "--gpus", "2", "--loads", "light,saturation",
                                       "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output.strip().splitlines()[-1])["plan_by_load"]
    assert set(plan["loads"]) == {"light", "saturation"}
    assert plan["loads"]["light"]["rate_rps"] == pytest.approx(0.3 * plan["capacity_rps"])
    for load in plan["loads"].values():
        assert {r["mode"] for r in load["rows"]} >= {"elastic", "colocated", "autoregressive"}
        assert all(r["requests"] == 12 and r["tokens_per_s"] > 0 for r in load["rows"])
