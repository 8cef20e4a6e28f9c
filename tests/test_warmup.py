"""A GPU worker's warm-up round (``workers/warmup.py``), run here on the CPU: it must leave no
trace in what the worker then serves."""

from __future__ import annotations

import numpy as np

from nebula_flow.models.loader import load_model
from nebula_flow.params import SamplingParams
from nebula_flow_workers.runner import ModelRunner, Task
from nebula_flow_workers.warmup import warm_round, warm_up


def _tasks() -> list[Task]:
    kinds = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.9, seed=3)]
    return [Task(rid, "draft", 1, 1, np.arange(2, 30 + rid), 4, kinds[rid % 2], rid) for rid in range(3)]


def test_a_warm_up_round_leaves_no_kv_and_no_timings_and_changes_no_draft(tiny_pair) -> None:  # noqa: ANN001
    """After a warm-up round (a greedy and a sampled request drafted and verified) the runner holds
    no KV and no forward times, and its drafts and verifies of real requests equal a fresh
    runner's, greedy and sampled."""
    warmed, fresh = (ModelRunner(load_model(tiny_pair / "target")) for _ in range(2))
    warm_round(warmed)
    assert not warmed.store.caches and warmed.model.kv_arena.leased_rows == 0
    assert warmed.forwards == 0 and warmed.busy_s == 0 and warmed.step_costs.table() == fresh.step_costs.table()
    drafts = [r.draft(_tasks()) for r in (warmed, fresh)]
    assert [d.tokens for d in drafts[0]] == [d.tokens for d in drafts[1]]
    verifies = [r.verify([Task(t.rid, "verify", 1, 1, t.tokens, len(d.tokens), t.params, t.seed, draft=d.tokens,
                               q_idx=d.q_idx, q_prob=d.q_prob) for t, d in zip(_tasks(), drafts[1])]) for r in (warmed, fresh)]
    assert verifies[0] == verifies[1]


def test_only_a_model_on_a_gpu_runs_warm_up_requests(tiny_pair) -> None:  # noqa: ANN001
    """On the CPU (and for an n-gram drafter, which has no model) the worker's warm-up runs no
    forward; a target's grammar engine still builds its tokenizer, on a thread of its own, so the
    first structured request finds it built."""
    runner = ModelRunner(load_model(tiny_pair / "target"), model_dir=str(tiny_pair / "target"))
    built = []
    runner.guides.prepare = lambda: built.append(type(runner.guides).prepare(runner.guides))
    warm_up(runner, 8, "target")
    warm_up(None, 8, "draft")
    assert runner.forwards == 0 and not runner.store.caches
    built[0].join(timeout=60)
    assert runner.guides._tokenizer is not None


def test_a_flash_attention_kernel_that_fails_or_disagrees_is_turned_off_before_serving(tiny_pair, monkeypatch, caplog) -> None:  # noqa: ANN001
    """``check_flash`` (a GPU worker's first warm-up step) runs a ragged batch through the
    FlashAttention plan and through SDPA: a kernel that keeps FlashAttention's contract (here its
    reference, run on this CPU) stays on; one whose output is wrong, or that raises, is turned off
    with a warning, and the model then serves through SDPA. No KV is left behind."""
    from nebula_flow.models import flash
    from nebula_flow.models.warmup import check_flash
    from tests.test_kv_arena import reference_varlen

    model = load_model(tiny_pair / "target")
    model.flash_attention = True
    monkeypatch.setattr(flash, "kernel", reference_varlen)
    assert check_flash(model, "target") and model.flash_attention
    assert model.kv_arena.leased_rows == 0

    def wrong(q, *args, **kwargs) -> tuple:  # noqa: ANN001, ANN002, ANN003
        return (reference_varlen(q, *args, **kwargs)[0].flip(0),)

    def failing(*args, **kwargs) -> tuple:  # noqa: ANN002, ANN003
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    for broken, said in ((wrong, "differ from SDPA's"), (failing, "Ampere")):
        model.flash_attention = True
        monkeypatch.setattr(flash, "kernel", broken)
        caplog.clear()
        assert not check_flash(model, "target") and model.flash_attention is False
        assert "FlashAttention off" in caplog.text and said in caplog.text
        assert model.kv_arena.leased_rows == 0
    cache = model.new_cache()
    assert model([cache], [[1, 2, 3]], [1])[0].shape[0] == 1  # (served through SDPA: the broken kernel is not called)
