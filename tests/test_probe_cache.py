"""Kernel probes remembered across starts (``nebula_flow/models/probe_cache.py``): a model loaded in
batch-invariant bf16 a second time takes the first load's row plans from the cache folder instead
of probing, and gets the same logits; an fp32 one the packed kernel's timings; anything that may
pick another kernel probes again."""

from __future__ import annotations

import json

import pytest
import torch

from nebula_flow.models import invariant, probe_cache
from nebula_flow.models.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setenv("NEBULA_FLOW_CACHE", str(tmp_path))
    monkeypatch.delenv("NEBULA_FLOW_PROBE_CACHE", raising=False)
    return tmp_path / "kernel_probes.json"


def counted(monkeypatch) -> list[tuple]:  # noqa: ANN001
    """The shapes ``invariant.row_plan`` probes from now on (it still probes)."""
    calls, probe = [], invariant.row_plan
    monkeypatch.setattr(invariant, "row_plan", lambda w, product=None: calls.append(tuple(w.shape)) or probe(w, product))
    return calls


def test_a_second_load_takes_its_row_plans_from_the_cache_and_computes_the_same_logits(tiny_pair, cache, monkeypatch) -> None:  # noqa: ANN001
    calls = counted(monkeypatch)
    first = load_model(tiny_pair / "target", dtype="bfloat16", batch_invariant=True)
    probed = len(calls)
    assert probed > 0 and cache.is_file() and len(json.loads(cache.read_text())) == probed
    second = load_model(tiny_pair / "target", dtype="bfloat16", batch_invariant=True)
    assert len(calls) == probed  # (none probed again)
    assert second.invariance == first.invariance
    tokens = list(range(5, 40))
    logits = [m([m.new_cache(64)], [tokens], [len(tokens)])[0] for m in (first, second)]
    assert torch.equal(logits[0], logits[1])


def test_a_second_fp32_load_takes_the_packed_kernels_timings_from_the_cache(tiny_pair, cache, monkeypatch) -> None:  # noqa: ANN001
    """fp32 layers run on the packed kernel from the rows where load-time timing found it faster
    (``packed.first_faster_rows``); the timings are kept, and the rule applied to them at each load."""
    from nebula_flow.models import packed

    timed, measure = [], packed.ratios
    monkeypatch.setattr(packed, "ratios", lambda w, p: timed.append(tuple(w.shape)) or measure(w, p))
    first = load_model(tiny_pair / "target", dtype="float32")
    shapes = len(timed)
    assert shapes > 0 and len(json.loads(cache.read_text())) == shapes
    second = load_model(tiny_pair / "target", dtype="float32")
    assert len(timed) == shapes  # (none timed again)
    assert second.packed_from_rows == first.packed_from_rows and second.packed_layers == first.packed_layers
    kept = json.loads(cache.read_text())
    monkeypatch.setattr(packed, "FASTER", 0.0)  # another rule: the same timings, another choice (none faster)
    assert load_model(tiny_pair / "target", dtype="float32").packed_layers == 0 and len(timed) == shapes
    assert json.loads(cache.read_text()) == kept


def test_what_may_pick_another_kernel_probes_again(cache, monkeypatch) -> None:  # noqa: ANN001
    runs = []

    def probe() -> dict:
        runs.append(1)
        return {"chunk": 8, "exact": 8, "multiple": 1}

    inputs = {"shape": [64, 32], "dtype": "torch.bfloat16"}
    assert probe_cache.remember("row_plan", inputs, CPU, probe) == probe_cache.remember("row_plan", inputs, CPU, probe)
    assert len(runs) == 1
    probe_cache.remember("row_plan", {**inputs, "shape": [64, 64]}, CPU, probe)  # another shape
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # another thread count
        probe_cache.remember("row_plan", inputs, CPU, probe)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN held to another instruction set
    probe_cache.remember("row_plan", inputs, CPU, probe)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(probe_cache, "VERSION", probe_cache.VERSION + 1)  # the probes' logic changed
    probe_cache.remember("row_plan", inputs, CPU, probe)
    assert len(runs) == 5 and len(json.loads(cache.read_text())) == 5
    monkeypatch.setenv("NEBULA_FLOW_PROBE_CACHE", "0")  # off: every probe runs
    probe_cache.remember("row_plan", {**inputs, "shape": [64, 64]}, CPU, probe)
    assert len(runs) == 6


def test_a_torn_or_unwritable_cache_costs_only_a_probe(cache, monkeypatch, caplog) -> None:  # noqa: ANN001
    cache.write_text("{not json")
    assert probe_cache.remember("row_plan", {"shape": [1]}, CPU, lambda: {"chunk": 8}) == {"chunk": 8}
    assert len(json.loads(cache.read_text())) == 1  # (replaced whole)
    blocked = cache.parent / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("NEBULA_FLOW_CACHE", str(blocked / "cache"))  # (a folder that cannot be made, even by root)
    assert probe_cache.remember("row_plan", {"shape": [2]}, CPU, lambda: {"chunk": 16}) == {"chunk": 16}
    assert "kernel probes not kept" in caplog.text and sorted(p.name for p in cache.parent.iterdir()) == [
        "a-file", "kernel_probes.json"]  # (no temporary file left behind)
