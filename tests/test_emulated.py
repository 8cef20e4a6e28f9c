"""Emulated devices: real processes and transports, forward passes timed by a profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main
from nebula_flow.cli.status_text import status_lines
from nebula_flow.client import Client
from nebula_flow.deploy import Deployment
from nebula_flow.emulated import EmulatedModel, predict_seconds, stand_in_next
from nebula_flow.metrics import render
from tests.conftest import deploy_config

pytestmark = pytest.mark.slow

PROFILE = {"name": "test", "source": "hand-written", "model": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 16,
           "vocab_size": 512, "max_position_embeddings": 1024},
           "latency": {"base_s": 0.002, "per_seq_s": 0.0, "per_token_s": 0.0002, "per_ctx_token_s": 0.0}}


@pytest.fixture
def profiles(tmp_path):  # noqa: ANN001, ANN201
    target, draft = tmp_path / "t.json", tmp_path / "d.json"
    target.write_text(json.dumps(PROFILE))
    draft.write_text(json.dumps(dict(PROFILE, acceptance=0.6, latency={"base_s": 0.0005})))
    return str(draft), str(target)


def stand_in_reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(stand_in_next(seq[-1], seq[-2] if len(seq) > 1 else 0, len(seq), 512))
    return seq[len(prompt):]


def test_latency_model_and_draft_agreement_rate() -> None:
    assert predict_seconds(PROFILE["latency"], 2, 10, 100) == pytest.approx(0.002 + 0.002)
    draft = EmulatedModel(dict(PROFILE, acceptance=0.6, latency={}), "draft")
    target = EmulatedModel(dict(PROFILE, latency={}), "target")
    agree, rank = 0, [0, 0, 0, 0]
    for p in range(2, 2002):
        ctx = [p % 97, p]
        row, want = draft._logit_row(ctx), int(target._logit_row(ctx).argmax())
        ranked = row.topk(4).indices.tolist()
        agree += ranked[0] == want
        rank[ranked.index(want) if want in ranked else 0] += ranked[0] != want
    assert 0.55 < agree / 2000 < 0.65
    # where it disagrees, its second choice is right half the time, its third half the time the
    # second is not, its fourth likewise (draft-ahead's guesses; the profile's runner_up)
    assert 0.4 < rank[1] / (2000 - agree) < 0.6
    assert 0.4 < rank[2] / (2000 - agree - rank[1]) < 0.6
    assert 0.35 < rank[3] / (2000 - agree - rank[1] - rank[2]) < 0.65
    falling = EmulatedModel(dict(PROFILE, acceptance=0.6, runner_up=[0.5, 0.2, 0.0], latency={}), "draft")
    rank = [0, 0, 0, 0]
    for p in range(2, 2002):  # (the same positions disagree: only where the target's token ranks changes)
        ctx = [p % 97, p]
        row, want = falling._logit_row(ctx), int(target._logit_row(ctx).argmax())
        ranked = row.topk(4).indices.tolist()
        rank[ranked.index(want) if want in ranked else 0] += ranked[0] != want
    assert 0.4 < rank[1] / (2000 - agree) < 0.6 and 0.1 < rank[2] / (2000 - agree - rank[1]) < 0.3 and rank[3] == 0


def test_a_profile_s_runner_up_must_be_rates(tmp_path) -> None:  # noqa: ANN001
    from nebula_flow.emulated import ProfileError, load_profile

    for bad in (1.5, [0.5, 0.2, 0.1, 0.1], "half"):
        path = tmp_path / "p.json"
        path.write_text(json.dumps(dict(PROFILE, runner_up=bad)))
        with pytest.raises(ProfileError, match="runner_up must be a rate in"):
            load_profile(path)


def test_an_emulated_cache_grows_to_real_size_rows_keeping_its_tokens() -> None:
    model = EmulatedModel(dict(PROFILE, latency={}), "target")
    cache = model.new_cache(capacity=16)
    model([cache], [list(range(1, 13))], [1])
    assert cache.tokens == list(range(1, 13)) and cache.buf.shape[0] == 16
    model([cache], [list(range(13, 41))], [1])  # (grows past 16 positions, then past 32)
    row = PROFILE["model"]["num_layers"] * 2 * PROFILE["model"]["num_kv_heads"] * PROFILE["model"]["head_dim"] * 2
    assert cache.tokens == list(range(1, 41)) and cache.buf.shape[0] == 64 and cache.row_bytes == row  # fp16 rows
    rows = cache.export(8, 40)  # what a peer pulling positions 8..40 is sent: real-size rows
    assert rows.shape == (32, 4, 2, 2, 16) and rows.is_contiguous() and rows.dtype.itemsize == 2


def test_drafters_of_different_salts_disagree_with_the_target_at_independent_positions() -> None:
    target = EmulatedModel(dict(PROFILE, latency={}), "target")
    a, b, c = (EmulatedModel(dict(PROFILE, acceptance=0.6, latency={}, salt=salt), "draft") for salt in (0, 1, 0))
    wrong = {m: set() for m in "abc"}
    for p in range(2, 2002):
        ctx = [p % 97, p]
        want = int(target._logit_row(ctx).argmax())
        for name, model in zip("abc", (a, b, c)):
            if int(model._logit_row(ctx).argmax()) != want:
                wrong[name].add(p)
    assert wrong["a"] == wrong["c"]  # (one salt: the same positions)
    both = len(wrong["a"] & wrong["b"]) / 2000
    assert 0.35 < len(wrong["b"]) / 2000 < 0.45 and 0.12 < both < 0.2  # (independent: 0.4 * 0.4)


@pytest.mark.parametrize("mode", ["pooled", "colocated", "autoregressive", "elastic", "elastic+bundled",
                                  "pooled+bundled+ahead", "paired+bundled+ahead", "pooled+bundled+ahead+adaptive"])
def test_emulated_deployment_is_lossless_against_the_stand_in(tiny_pair, profiles, mode: str) -> None:  # noqa: ANN001
    """``+bundled``: the bundled profiles (Qwen3 on RTX 4090s: a vocabulary far larger than the tiny
    tokenizer's, whose ids the broker checks every token against). ``+ahead``: draft-ahead, single
    stream, where a verify takes far longer than a pre-draft: most rounds' drafts are pre-drafted.
    ``+adaptive``: with adaptive k, which plans each round with the draft steps pre-drafts hide."""
    mode, adaptive = mode.removesuffix("+adaptive"), mode.endswith("+adaptive")
    mode, ahead = mode.removesuffix("+ahead"), mode.endswith("+ahead")
    mode, bundled = mode.removesuffix("+bundled"), mode.endswith("+bundled")
    cfg = deploy_config(tiny_pair, mode, 2, 2)
    cfg.draft.device = cfg.target.device = "emulated"
    cfg.draft.profile, cfg.target.profile = profiles
    if bundled:
        folder = Path(__file__).resolve().parent.parent / "configs" / "profiles"
        cfg.draft.profile, cfg.target.profile = str(folder / "qwen3-0.6b-rtx4090.json"), str(folder / "qwen3-8b-rtx4090.json")
    cfg.kv_transport = "zmq"
    # (token-tree rows go through the emulated model too)
    cfg.broker.policy = cfg.broker.policy.replace(first_alternatives=2, draft_ahead=16 if ahead else 0,
                                                  adaptive_k=adaptive, k=6 if adaptive else 4)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    with Deployment(cfg) as dep, Client(dep.address) as c:
        outs = [c.generate(token_ids=p, max_new_tokens=30, ignore_eos=True) for p in prompts]
        state = c.status()
        # a sampled request's rounds are pre-drafted too (the HTTP API's default: temperature 1)
        sampled = c.generate(token_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=3)
        sampled_hits = c.status()["draft_ahead"]["hits"] - state["draft_ahead"]["hits"]
    counters = state["draft_ahead"]
    for p, out in zip(prompts, outs):
        assert out.token_ids == stand_in_reference(p, 30)
    ahead_lines = [line for line in status_lines(state) if line.startswith("draft-ahead: ")]
    assert len(ahead_lines) == ahead  # (`status` says how draft-ahead does, where it is on)
    if ahead:
        assert counters["hits"] >= 0.2 * sum(o.rounds for o in outs) and counters["wasted"] > 0
        assert sampled_hits >= 0.2 * sampled.rounds, (sampled_hits, sampled.rounds)
        assert ahead_lines[0].startswith(f"draft-ahead: {counters['hits']} rounds took a pre-drafted draft (")
        assert sum(counters["hits_by_outcome"]) == counters["hits"] and len(counters["hits_by_outcome"]) <= 16
        metrics = render(state)  # (what /metrics serves from this status)
        assert all(f'nebula_draft_ahead_hits_by_outcome_total{{outcome="{i}"}} {float(n)}' in metrics
                   for i, n in enumerate(counters["hits_by_outcome"]))
    if mode != "autoregressive":
        assert 1.5 < sum(len(o.token_ids) for o in outs) / sum(o.rounds for o in outs) < 4.5
    if adaptive:  # (k moved round by round, and rounds still took pre-drafted drafts)
        assert len({k for o in outs for k in o.stats["k_per_round"]}) > 1


def test_bench_json_on_emulated_devices(tiny_pair, profiles, tmp_path) -> None:  # noqa: ANN001
    cfg = tmp_path / "emu.toml"
    cfg.write_text(f'mode = "pooled"\nkv_transport = "zmq"\n[draft]\nmodel = "{tiny_pair / "draft"}"\ndevice = "emulated"\n'
                   f'profile = "{profiles[0]}"\nworkers = 2\n[target]\nmodel = "{tiny_pair / "target"}"\n'
                   f'device = "emulated"\nprofile = "{profiles[1]}"\nworkers = 2\n')
    res = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes",
                                    "pooled,paired,colocated,autoregressive,pooled@draft_ahead=16",
                                    "--requests", "4", "--concurrency", "4", "--max-new-tokens", "16",
                                    "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    assert set(modes) == {"pooled", "paired", "colocated", "autoregressive", "pooled@draft_ahead=16"}
    ahead = modes["pooled@draft_ahead=16"]["repeats"][0]["draft_ahead"]  # (this run's counters, hits by outcome too)
    assert ahead["tasks"] > 0 and sum(ahead["hits_by_outcome"]) == ahead["hits"]
    for m in modes.values():
        assert m["round_rate"] > 0 and m["tokens_per_s"] > 0 and 0 < m["utilization"] <= 1.0
        # the deployment's own processes' CPU per request-round (read from /proc; ticks of 10 ms)
        assert m["cpu_per_round_s"]["workers"] > 0 and m["cpu_per_round_s"]["broker"] >= 0
    # no draft: one token a round, up to decode_steps (4) for a request left alone (nebula_flow/steps.py)
    assert 1.0 <= modes["autoregressive"]["tokens_per_round"] <= 4.0


def test_bench_table_columns_stay_apart_for_any_baseline_name() -> None:
    from nebula_flow.bench import table

    run = {"ttft_s": {"p50": 0.05}, "latency_s": {"p50": 1.0, "p90": 1.1}, "tokens_per_s": 30.0, "round_rate": 30.0,
           "tokens_per_round": 1.0, "utilization": 0.5, "kv_bytes": 0}
    header, base, pooled = table({"autoregressive": run, "pooled": dict(run, tokens_per_s=45.0)}).splitlines()
    assert "KV MB  rounds/s vs autoregressive  tokens/s vs autoregressive" in header
    assert len(header) == len(base) == len(pooled)  # ratios sit under their headings
    assert pooled.split()[-2:] == ["1.00x", "1.50x"]


def test_bench_chat_workload_sends_requests_in_the_chat_format(tiny_pair) -> None:  # noqa: ANN001
    import asyncio

    from nebula_flow.bench import DEFAULT_CHAT_PROMPTS, BenchWorkload, _closed_loop
    from nebula_flow.tokenizer import TextCodec
    from tests.conftest import hf_greedy

    wl = BenchWorkload(DEFAULT_CHAT_PROMPTS[:2], max_new_tokens=6, chat=True)
    with Deployment(deploy_config(tiny_pair, "colocated")) as dep:
        outs = asyncio.run(_closed_loop(dep.address, wl))  # one user: answers come in prompt order
    codec = TextCodec(tiny_pair / "target")
    for prompt, out in zip(wl.prompts, outs):
        ref = hf_greedy(tiny_pair / "target", codec.encode(prompt, chat=True), 6)
        assert out.token_ids[:len(ref)] == ref
