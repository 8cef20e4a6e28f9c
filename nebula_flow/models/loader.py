"""Load a local HuggingFace checkpoint directory into the runtime's ``CausalLM``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from nebula_flow.models import flash
from nebula_flow.models.config import ModelConfig, ModelConfigError
from nebula_flow.models.graphs import StepGraphs
from nebula_flow.models.llama import CausalLM, rope_inv_freq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


DTYPE_CHOICES = ("auto", *DTYPES)


def default_dtype(device: str) -> torch.dtype:
    """Without a dtype: fp32 on CPU (exact, the same on every CPU); bf16 on CUDA."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware: AMX-BF16 or AVX512-BF16 on x86, BF16 on Arm
    (read from ``/proc/cpuinfo``; elsewhere, no). Without it oneDNN runs bf16 through fp32 with
    conversions on every call, several times slower than plain fp32 (docs/benchmarks.md)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # (x86, Arm; every core lists the same)
            return not {"amx_bf16", "avx512_bf16", "bf16"}.isdisjoint(value.split())
    return False


def auto_dtype(device: str) -> torch.dtype:
    """``dtype = "auto"``: the faster of bf16 and fp32 on this device. bf16 on CUDA (fp16 on GPUs
    without bf16) and on CPUs that compute bf16 natively (``cpu_has_native_bf16``), else fp32."""
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    if name in (None, ""):
        return default_dtype(device)
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    raise ModelConfigError(f"no *.safetensors weights in {path}")


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        state.update(load_file(str(f)))
    return state


def load_model(path: str | Path, device: str = "cpu", dtype: str | torch.dtype | None = None,
               batch_invariant: bool | None = None, inference: bool = True, cuda_graphs: bool = True) -> CausalLM:
    """Build the model described by ``path/config.json`` and load its safetensors weights.

    ``batch_invariant`` (see ``models.invariant``): None = on for bf16/fp16 on a CPU, where
    it costs little and keeps speculative output bit-equal to plain decoding; off otherwise.
    ``inference``: fused projections (``CausalLM.fuse_projections``) and weights packed for the
    CPU kernel (``CausalLM.pack_weights``); off for a model to train or whose state dict is read
    by HF names. On CUDA, decode steps and verify blocks replay CUDA graphs (``models.graphs``) unless
    ``cuda_graphs`` is False, the model is batch-invariant or the environment sets ``NEBULA_FLOW_CUDA_GRAPHS=0``."""
    path = Path(path)
    if not path.is_dir():
        raise ModelConfigError(f"model directory not found: {path}")
    cfg = ModelConfig.from_dir(path)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = {k: v for k, v in load_state_dict(path).items() if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings and "model.embed_tokens.weight" not in state:
            raise ModelConfigError(f"{path}: checkpoint has no lm_head.weight")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    tied = state["lm_head.weight"] is state.get("model.embed_tokens.weight") or (
        cfg.tie_word_embeddings and not cfg.draft_head_size)
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ModelConfigError(
            f"{path}: weights do not match a {cfg.model_type} model "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    state = {k: v.to(device=device, dtype=torch_dtype) if v.is_floating_point() else v.to(device)
             for k, v in state.items()}
    if tied:  # one tensor for both, as transformers ties them (converting each made two copies)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True)
    # The rotary buffer was built on the meta device; rebuild it for real.
    model.inv_freq = rope_inv_freq(cfg).to(device)
    flash.skip_cudnn_attention(torch.device(device))
    if inference:
        model.fuse_projections()
        model.pack_weights()
    if batch_invariant is None:
        batch_invariant = torch_dtype != torch.float32 and torch.device(device).type == "cpu"
    if batch_invariant:
        model.make_batch_invariant()
    elif cuda_graphs and torch.device(device).type == "cuda" and os.environ.get("NEBULA_FLOW_CUDA_GRAPHS", "1") != "0":
        model.step_graphs = StepGraphs(model)
    return model.eval()

