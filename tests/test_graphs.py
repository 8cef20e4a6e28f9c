"""Steps through fixed inputs (``models/graphs.py``): on a CPU the recorder runs the step
eagerly, so what is checked here is everything but the CUDA graph itself: which steps qualify, the
fixed plan's slots and masks (padded keys, windows), the shapes' bookkeeping and the check that
turns graphs off. ``tests/test_gpu.py`` replays real graphs where a GPU is lent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nebula_flow.models import flash as flash_mod
from nebula_flow.models import graphs
from nebula_flow.models.config import ModelConfig
from nebula_flow.models.graphs import FixedStep, StepGraphs, batch_bucket, key_bucket, width_bucket
from nebula_flow.models.llama import CausalLM
from nebula_flow.params import SamplingParams
from nebula_flow.tiny import init_target, tiny_config
from nebula_flow_workers.runner import ModelRunner, Task
from tests.test_kv_arena import reference_varlen


def _model(window: int | None = None) -> CausalLM:
    cfg = dict(tiny_config(64, 2, 0), max_position_embeddings=1024)
    if window:  # (Mistral-style: every layer slides)
        cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window)
    model = CausalLM(ModelConfig.from_dict(cfg))
    init_target(model, torch.Generator().manual_seed(3))
    return model.eval()


def eager_recorder(step: FixedStep, pool: object) -> object:
    """Stands in for ``graphs.record`` on a CPU: a "replay" runs the step over its fixed inputs."""
    def replay() -> None:
        step.out = step.run()

    step.replay = replay
    return pool


def test_key_buckets_are_powers_of_two_from_the_smallest() -> None:
    assert [key_bucket(n) for n in (1, 256, 257, 600, 1024, 1025)] == [256, 256, 512, 1024, 1024, 2048]


def test_batches_and_widths_round_up_to_few_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 8, 8, 16, 16, 24, 40]
    assert [width_bucket(n) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]


@pytest.mark.parametrize("flash", [False, True], ids=["masked", "flash-plan"])
@pytest.mark.parametrize("window", [None, 5])
def test_steps_through_fixed_inputs_give_the_eager_logits(window: int | None, flash: bool, monkeypatch) -> None:  # noqa: ANN001
    """Decode steps at ragged lengths (keys padded to the bucket and masked), tokens fed as ids or
    from the device, a verify block and a token tree, with and without a sliding window: the same
    logits as the eager forward, and the caches then hold the same. Batches and widths are
    rounded up to the graphs' buckets, the extra sequences pads over a scratch range. As on CUDA in
    bf16 (``flash``: FlashAttention's contract run on this CPU), chains step through the fixed
    FlashAttention plan and token trees through the masked one."""
    plain, graphed = _model(window), _model(window)
    if flash:
        monkeypatch.setattr(flash_mod, "kernel", reference_varlen)
        plain.flash_attention = graphed.flash_attention = True
    graphed.step_graphs = StepGraphs(graphed, recorder=eager_recorder)
    prompts = [list(range(1, n)) for n in (9, 3, 14)]
    caches = {m: [m.new_cache() for _ in prompts] for m in (plain, graphed)}
    for m in (plain, graphed):
        m(caches[m], prompts, [1] * 3)
    steps = [([[5], [6], [7]], None, None), (torch.tensor([8, 9, 10]), None, None), ([[11], [12], [13]], None, None),
             ([[1, 2, 3], [4, 5, 6], [7, 8, 9]], None, None),
             ([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[-1, 0, 0], None, [-1, -1, 1]], None),
             # ragged, padded to the widest: a round's first draft step (logits of each last row),
             # verify blocks of mixed k, a tree beside a shorter chain, a sequence wanting no logits
             ([[3, 4], [5], [6, 7, 8]], None, [1, 1, 1]), ([[1, 2, 3, 4], [5, 6], [7]], None, None),
             ([[1, 2], [3], [4]], None, [2, 0, 1]), ([[1, 2, 3], [4, 5]], [[-1, -1, 0], None], None)]
    for step, parents, rows in steps:
        if len(step) == 2:  # (the third sequence sits this one out)
            caches = {m: c[:2] for m, c in caches.items()}
        rows = rows or ([len(s) for s in step] if isinstance(step, list) else [1] * len(step))
        want = plain(caches[plain], step, rows, parents)
        got = graphed(caches[graphed], step, rows, parents)
        assert [len(g) for g in got] == rows
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert graphed.step_graphs.replays == 1 + len(steps)  # (the prompts' prefill too: no wider than MAX_WIDTH)
    # (three sequences run in graphs of four, a pad sequence beside them; widths round up to a power of two)
    assert sorted(graphed.step_graphs.steps) == ([(0, 2, 4, 256, False), (0, 4, 1, 256, True), (0, 4, 2, 256, True),
                                                  (0, 4, 4, 256, False), (0, 4, 4, 256, True), (0, 4, 16, 256, True)]
                                                 if flash else
                                                 [(0, 2, 4, 256, False), (0, 4, 1, 256, False), (0, 4, 2, 256, False),
                                                  (0, 4, 4, 256, False), (0, 4, 16, 256, False)])
    for a, b in zip(caches[graphed], caches[plain]):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.buf[:a.length], b.buf[:b.length], rtol=1e-5, atol=1e-5)


def test_steps_up_to_the_widest_graph_take_one_and_wider_or_invariant_ones_run_eagerly() -> None:
    """A prefill wider than ``MAX_WIDTH`` and a batch-invariant model's steps run eagerly; ragged
    steps up to it take a graph, so every step of a draft does (its first feeds each prompt,
    padded to the longest), and its drafts are the eager ones; a step that pads reserves room
    for the pad rows in every cache."""
    model = _model()
    model.step_graphs = StepGraphs(model, recorder=eager_recorder)
    caches = [model.new_cache(), model.new_cache(capacity=4)]
    wide = list(range(1, graphs.MAX_WIDTH + 2))
    model(caches, [wide, wide[:15]], [len(wide), 15])
    assert model.step_graphs.replays == 0
    assert caches[1].buf.shape[0] == 16  # (a lease's least)
    model(caches, [[6, 7], [8]], [2, 1])
    assert model.step_graphs.replays == 1 and caches[1].buf.shape[0] >= 15 + 2
    tasks = [Task(rid, "draft", 1, 1, np.arange(1, 6 + rid), 4, SamplingParams(max_new_tokens=8), rid) for rid in range(3)]
    drafts = ModelRunner(model).draft(tasks)
    assert model.step_graphs.replays == 1 + 4
    assert [d.tokens for d in drafts] == [d.tokens for d in ModelRunner(_model()).draft(tasks)]
    model.batch_invariant = True
    assert model.step_graphs.step(caches, [1, 1], [1, 1], [[1], [2]], None) is None


def test_a_graph_that_does_not_match_turns_graphs_off(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # noqa: ANN001
    """A recorded step whose replay differs from the eager step, or that fails to record: graphs
    go off for the model with a warning, and the step (and every later one) runs eagerly."""
    def wrong(step: FixedStep, pool: object) -> object:
        def replay() -> None:
            step.out = step.run() + 1

        step.replay = replay
        return pool

    def broken(step: FixedStep, pool: object) -> object:
        raise RuntimeError("operation not permitted when stream is capturing")

    for recorder in (wrong, broken):
        plain, model = _model(), _model()
        model.step_graphs = StepGraphs(model, recorder=recorder)
        caches = {m: [m.new_cache() for _ in range(2)] for m in (plain, model)}
        for m in (plain, model):
            m(caches[m], [[1, 2, 3], [4, 5]], [1, 1])
        with caplog.at_level("WARNING", logger="nebula_flow.models"):
            got = model(caches[model], [[6], [7]], [1, 1])
        assert not model.step_graphs.enabled and "CUDA graphs off" in caplog.text
        for a, b in zip(got, plain(caches[plain], [[6], [7]], [1, 1])):
            torch.testing.assert_close(a, b)
        caplog.clear()


def test_a_flash_attention_graph_that_fails_turns_flash_attention_off_and_keeps_graphs(monkeypatch, caplog) -> None:  # noqa: ANN001
    """A step through FlashAttention (as on CUDA in bf16; its contract run on this CPU) whose graph
    fails to record: FlashAttention goes off for the model with a warning, graphs stay on, and that
    step and the later ones are recorded with the masked plan, with the eager logits."""
    monkeypatch.setattr(flash_mod, "kernel", reference_varlen)

    def no_flash(step: FixedStep, pool: object) -> object:
        if step.plan.flash:
            raise RuntimeError("operation not permitted when stream is capturing")
        return eager_recorder(step, pool)

    plain, model = _model(), _model()
    plain.flash_attention = model.flash_attention = True
    model.step_graphs = sg = StepGraphs(model, recorder=no_flash)
    caches = {m: [m.new_cache() for _ in range(2)] for m in (plain, model)}
    for m in (plain, model):
        m(caches[m], [[1, 2, 3], [4, 5]], [1, 1])
    with caplog.at_level("WARNING", logger="nebula_flow.models"):
        for step in ([[6], [7]], [[8], [9]]):
            for a, b in zip(model(caches[model], step, [1, 1]), plain(caches[plain], step, [1, 1])):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert "FlashAttention off" in caplog.text and model.flash_attention is False
    assert sg.enabled and list(sg.steps) == [(0, 2, 1, 256, False)] and sg.replays == 2


def test_no_more_than_the_cap_of_shapes_is_kept_and_a_shape_seen_again_takes_the_oldest_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the cap is reached, a new shape runs eagerly the first time; seen again, it is
    recorded in place of the shape used longest ago (which then waits its turn the same way)."""
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 1)
    model = _model()
    model.step_graphs = StepGraphs(model, recorder=eager_recorder)
    sg = model.step_graphs
    one, two = [model.new_cache()], [model.new_cache() for _ in range(2)]
    model(one, [[1] * 20], [1])  # (prefills wider than a graph: eager)
    model(two, [[1] * 20, [2] * 20], [1, 1])
    model(one, [[3]], [1])  # (one sequence: recorded)
    model(two, [[4], [5]], [1, 1])  # (a second shape while full: eager)
    assert list(sg.steps) == [(0, 1, 1, 256, False)] and sg.replays == 1
    model(two, [[6], [7]], [1, 1])  # (seen again: it takes the first one's place)
    assert list(sg.steps) == [(0, 2, 1, 256, False)] and sg.replays == 2
    model(one, [[8]], [1])  # (the first shape, now new again: eager once)
    assert sg.status() == {"enabled": True, "graphs": 1, "replays": 2, "eager": 4, "recorded": 2, "evicted": 1}
    assert model.runtime_status()["cuda_graphs"] == sg.status()  # (what a worker's status shows, per model)


def test_a_worker_records_its_shapes_at_start_and_its_steps_then_replay_them() -> None:
    """``capture`` records every batch bucket up to the worker's batch at every width over short
    contexts, leaving the arena as it found it (the ranges it recorded over given back);
    then a draft, a ragged verify block and a batch of five records nothing new, and their
    logits are the eager ones."""
    plain, model = _model(), _model()
    model.step_graphs = sg = StepGraphs(model, recorder=eager_recorder)
    model.make_kv_arena()
    assert sg.capture(6) == 4 * len(graphs.WIDTHS) and sorted(sg.steps) == sorted(
        (0, size, width, 256, False) for size in (1, 2, 4, 8) for width in graphs.WIDTHS)
    assert sg.status() == {"enabled": True, "graphs": 20, "replays": 0, "eager": 0, "recorded": 20, "evicted": 0}
    assert model.kv_arena.leased_rows == 0
    caches = {m: [m.new_cache() for _ in range(5)] for m in (plain, model)}
    for tokens, rows in (([[1, 2, 3]] * 5, [1] * 5), ([[4], [5, 6], [7, 8, 9], [1], [2]], [1, 2, 3, 1, 1])):
        for a, b in zip(model(caches[model], tokens, rows), plain(caches[plain], tokens, rows)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sg.recorded == 20 and sg.replays == 2
    assert sg.scratch is not None and sg.scratch.lease.chunk == 0  # (the pad sequences' range, leased once)
    model.make_kv_arena(1 << 22)  # (a worker's KV store makes its own: graphs of the old one must not serve it)
    caches = {m: [m.new_cache() for _ in range(3)] for m in (plain, model)}
    for tokens, rows in (([[1, 2, 3]] * 3, [1] * 3), ([[4], [5], [6]], [1] * 3)):
        for a, b in zip(model(caches[model], tokens, rows), plain(caches[plain], tokens, rows)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sorted(sg.steps) == [(0, 4, 1, 256, False), (0, 4, 4, 256, False)] and sg.scratch.arena is model.kv_arena


def test_a_pool_runs_eagerly_where_its_config_says_so(tmp_path) -> None:  # noqa: ANN001
    """``cuda_graphs = false`` in a pool (vLLM's ``enforce_eager``) reaches that pool's workers
    and no other's; a worker started by hand takes ``--enforce-eager``."""
    from click.testing import CliRunner

    from nebula_flow.cli import main
    from nebula_flow.config import load_config
    from nebula_flow.deploy import Deployment

    path = tmp_path / "d.toml"
    path.write_text('mode = "pooled"\n[draft]\nmodel = "/m/d"\n[target]\nmodel = "/m/t"\ncuda_graphs = false\n')
    cfg = load_config(path)
    dep = Deployment(cfg, log_dir=tmp_path / "logs")
    assert dep.worker_options("target", cfg.target, "cuda:0", "t", 1).cuda_graphs is False
    assert dep.worker_options("draft", cfg.draft, "cuda:0", "d", 1).cuda_graphs is True
    assert "--enforce-eager" in CliRunner().invoke(main, ["worker", "--help"]).output
