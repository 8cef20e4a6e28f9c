"""The runtime's logits equal HF transformers' for every supported family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from nebula_flow.models.config import ModelConfig, ModelConfigError
from nebula_flow.models.loader import load_model

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
FAMILIES = {
    "llama2": lambda: LlamaConfig(**COMMON),
    "llama3-rope-scaling": lambda: LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-linear-rope": lambda: LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama-mha-bias": lambda: LlamaConfig(**dict(COMMON, num_key_value_heads=4), attention_bias=True),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),
    "qwen3-tied": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
    "qwen3-yarn": lambda: Qwen3Config(**COMMON, head_dim=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}),
    "qwen2.5-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0}),
    # (layer 0 sees everything, layer 1 a window of 6: only the layers from max_window_layers slide)
    "qwen2-window-layers": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "mistral-sliding": lambda: MistralConfig(**COMMON, sliding_window=6),
    "smollm-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):  # noqa: ANN001, ANN201
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(FAMILIES[request.param]()).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(path)


def _ref(hf, ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def test_prefill_matches_hf(pair) -> None:  # noqa: ANN001
    hf, model = pair
    ids = torch.randint(0, 101, (19,), generator=torch.Generator().manual_seed(1))
    got = model([model.new_cache()], [ids.tolist()], [19])[0]
    torch.testing.assert_close(got, _ref(hf, ids), rtol=1e-4, atol=1e-4)


def test_ragged_batch_and_decode_with_cache_match_hf(pair) -> None:  # noqa: ANN001
    hf, model = pair
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 101, (n,), generator=g) for n in (3, 17, 9)]
    caches = [model.new_cache(capacity=4) for _ in seqs]  # small capacity: exercises growth
    # Ragged step: different prefill lengths in one call.
    first = model(caches, [s[:-2].tolist() for s in seqs], [len(s) - 2 for s in seqs])
    # Then a ragged continuation: 1 token (decode) and 2 tokens (verify-like) on the caches.
    second = model(caches, [s[-2:-1].tolist() for s in seqs[:2]] + [seqs[2][-2:].tolist()], [1, 1, 2])
    third = model(caches[:2], [s[-1:].tolist() for s in seqs[:2]], [1, 1])
    for i, s in enumerate(seqs):
        ref = _ref(hf, s)
        got = torch.cat([first[i], second[i], third[i]]) if i < 2 else torch.cat([first[i], second[i]])
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_rollback_then_recompute_is_exact(pair) -> None:  # noqa: ANN001
    hf, model = pair
    ids = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(3))
    other = (ids[8:] + 1) % 101
    cache = model.new_cache()
    model([cache], [ids[:8].tolist() + other.tolist()], [1])  # a rejected suffix
    cache.truncate(8)
    got = model([cache], [ids[8:].tolist()], [4])[0]
    torch.testing.assert_close(got, _ref(hf, ids)[8:], rtol=1e-4, atol=1e-4)


def test_unknown_family_and_missing_dir_are_clear_errors(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ModelConfigError, match="model directory not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelConfigError, match="unsupported model_type 'gpt2'"):
        load_model(tmp_path)
    # a rope kind the runtime does not compute is refused once, by name (not as a malformed config)
    raw = dict(COMMON, model_type="qwen3", num_hidden_layers=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ModelConfigError) as refused:
        ModelConfig.from_dict(raw)
    assert str(refused.value).startswith("unsupported rope_type 'dynamic'") and "malformed" not in str(refused.value)


def test_a_tied_head_is_stored_once_after_a_dtype_change(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="bfloat16", inference=False)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_sliding_layers_follow_transformers() -> None:
    base = dict(COMMON, num_hidden_layers=4, sliding_window=6)
    assert [ModelConfig.from_dict(dict(base, model_type="mistral")).window(i) for i in range(4)] == [6] * 4
    qwen = dict(base, model_type="qwen2", use_sliding_window=True, max_window_layers=2)
    assert [ModelConfig.from_dict(qwen).window(i) for i in range(4)] == [None, None, 6, 6]
    typed = dict(qwen, layer_types=["sliding_attention", "full_attention"] * 2)
    assert [ModelConfig.from_dict(typed).window(i) for i in range(4)] == [6, None, 6, None]
    assert [ModelConfig.from_dict(dict(qwen, use_sliding_window=False)).window(i) for i in range(4)] == [None] * 4


X86_AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\nbugs\t\t: spectre_v1\n"
X86_AMX = "flags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM_V8 = "Features\t: fp asimd evtstrm aes crc32\n"


def test_auto_dtype_is_bf16_only_where_the_hardware_computes_it(monkeypatch) -> None:  # noqa: ANN001
    from nebula_flow.models import loader

    assert [loader.cpu_has_native_bf16(text) for text in (X86_AVX512, X86_AMX, ARM_BF16, ARM_V8, "")] == [
        False, True, True, False, False]
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda native=native: native)
        assert loader.resolve_dtype("auto", "cpu") == want
        assert loader.resolve_dtype(None, "cpu") == torch.float32  # unset: fp32 on every CPU
    assert loader.resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'bf16'; choose one of auto, float32"):
        loader.resolve_dtype("bf16", "cpu")


def test_a_deployment_with_an_unknown_dtype_is_refused_before_any_worker_starts() -> None:
    from nebula_flow.config import ConfigError, DeployConfig

    cfg = DeployConfig()
    cfg.target.model = cfg.draft.model = "/models/x"
    cfg.target.dtype = "auto"
    cfg.validate()
    cfg.draft.dtype = "fp32"
    with pytest.raises(ConfigError, match=r"\[draft\] dtype must be one of auto, float32, bfloat16, float16, got 'fp32'"):
        cfg.validate()


def test_loading_a_model_leaves_torch_compile_unimported(tmp_path) -> None:  # noqa: ANN001
    """A model is built on the meta device and its weights assigned; torch's initialisation and
    arithmetic there would import ``torch._dynamo`` (1.2-1.5 s of every worker's start on a 2-core
    host). Load a YaRN-scaled Qwen3 in a fresh process: not imported, and the model's rotary
    frequencies are those of the same model built on the CPU."""
    import subprocess
    import sys

    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    AutoModelForCausalLM.from_config(Qwen3Config(**COMMON, head_dim=32, rope_scaling=rope)).save_pretrained(tmp_path)
    code = ("import sys, torch; from nebula_flow.models.loader import load_model; "
            "from nebula_flow.models.llama import CausalLM; from nebula_flow.models.config import ModelConfig; "
            f"m = load_model({str(tmp_path)!r}); print('torch._dynamo' in sys.modules); "
            f"print(torch.equal(m.inv_freq, CausalLM(ModelConfig.from_dir({str(tmp_path)!r})).inv_freq))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"], out


def test_profile_ops_counts_the_host_work_of_a_forward(tiny_pair) -> None:  # noqa: ANN001
    import json

    from click.testing import CliRunner

    from nebula_flow.cli import main
    from nebula_flow.models.ops import QWEN3_0_6B, forward_ops, random_model

    res = CliRunner().invoke(main, ["profile", "--ops", "--model", str(tiny_pair / "target")])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output.strip().splitlines()[-1])
    assert set(report["ops"]) == set(report["apart"]["ops"]) == {"decode_1", "decode_8", "decode_16", "verify_8x5", "verify_16x5"}
    # one attention call per layer for the batch: sixteen sequences' host work is about one's
    assert report["ops"]["decode_16"] < 1.2 * report["ops"]["decode_1"] < report["apart"]["ops"]["decode_16"]
    assert report["layers"] == ModelConfig.from_dir(tiny_pair / "target").num_layers
    assert all(n > 0 for n in report["ops"].values()) and all(s > 0 for s in report["seconds"].values())
    # a real shape builds and counts too (two of its layers, to stay quick)
    small = random_model(dict(QWEN3_0_6B, num_hidden_layers=2, vocab_size=1000))
    assert forward_ops(small, 2, 1, context=16, repeats=1)["ops"] > 0
    assert CliRunner().invoke(main, ["profile"]).exit_code == 2  # (--model is required without --ops)


def reference_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as transformers applies it (``apply_rotary_pos_emb``'s formula)."""
    from transformers.models.llama.modeling_llama import rotate_half

    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_gives_transformers_bits(dtype: torch.dtype) -> None:
    """``rotate`` rolls the halves and carries the sign in ``signed_sin`` (one kernel fewer on a
    GPU than negate-and-concatenate): the same bits as transformers' rotation."""
    from nebula_flow.models.llama import rotate, signed_sin

    g = torch.Generator().manual_seed(0)
    x, angles = torch.randn(16, 24, 128, generator=g).to(dtype), torch.randn(16, 1, 64, generator=g)
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    assert torch.equal(rotate(x, cos, signed_sin(sin)), reference_rotation(x, cos, sin))
