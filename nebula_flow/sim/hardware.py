"""Ready descriptions of models and accelerators for the roofline cost model.

Numbers are public spec-sheet figures (dense fp16/bf16 tensor throughput with fp32
accumulation, memory bandwidth, memory size) and model configurations. ``mfu``/``mbu`` are
the fractions of peak compute / bandwidth a tuned serving engine reaches; ``per_layer_s`` and
``fixed_s`` are per-forward overheads (kernel launches with CUDA graphs, sampling, framework).
They are assumptions, stated here so a user can change them in a scenario file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the link between two of them."""

    name: str
    flops: float  # peak dense fp16/bf16 FLOP/s
    mem_bw: float  # bytes/s
    memory_gb: float
    link_bw: float  # bytes/s from one device to a peer (KV pulls)
    link_latency_s: float  # per transfer
    link: str = ""
    mfu: float = 0.6
    mbu: float = 0.8
    fixed_s: float = 2e-4  # per forward: launch, sampling, host work
    per_layer_s: float = 1.5e-5  # per layer per forward (kernels that do not scale with the work)


HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    # No peer-to-peer on GeForce cards: KV goes GPU -> host -> GPU over PCIe 4.0 x16.
    Hardware("rtx4090", 165.2e12, 1008 * GB, 24, 20 * GB, 15e-6, "PCIe 4.0 x16 through host memory"),
    Hardware("a100", 312e12, 2039 * GB, 80, 300 * GB, 5e-6, "NVLink 3 (300 GB/s each way)"),
    # A small inference card (NVIDIA L4: 121 TFLOPS dense fp16, 300 GB/s GDDR6): drafts, not 8B targets.
    Hardware("l4", 121e12, 300 * GB, 24, 25 * GB, 10e-6, "PCIe 4.0 x16"),
    Hardware("h100", 989e12, 3350 * GB, 80, 450 * GB, 4e-6, "NVLink 4 (450 GB/s each way)"),
    Hardware("h200", 989e12, 4800 * GB, 141, 450 * GB, 4e-6, "NVLink 4 (450 GB/s each way)"),
    # A single CPU core: useful to compare with the bundled pair on this kind of machine.
    Hardware("cpu-core", 1.0e11, 10 * GB, 8, 2 * GB, 50e-6, "loopback TCP", mfu=0.5, mbu=0.6,
             fixed_s=1e-3, per_layer_s=1e-4),
)}


@dataclass(frozen=True)
class ModelSpec:
    """What the roofline needs to know about a decoder-only transformer."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2  # fp16/bf16 weights and KV

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h

    @property
    def params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + embed * (1 if self.tie_embeddings else 2) + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes read per forward: every layer plus the output head (the embedding is a lookup)."""
        return (self.num_layers * self.layer_params + self.vocab_size * self.hidden_size) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("qwen3-0.6b", 28, 1024, 16, 8, 128, 3072, 151936, tie_embeddings=True),
    ModelSpec("qwen3-1.7b", 28, 2048, 16, 8, 128, 6144, 151936, tie_embeddings=True),
    ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
    ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936),
    ModelSpec("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, tie_embeddings=True),
    ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
    ModelSpec("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, tie_embeddings=True),
    ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_embeddings=True),
)}


def model_from_hf_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """A ``ModelSpec`` from a HuggingFace ``config.json`` dictionary."""
    try:
        heads = cfg["num_attention_heads"]
        return ModelSpec(name, cfg["num_hidden_layers"], cfg["hidden_size"], heads,
                         cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads,
                         cfg["intermediate_size"], cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as exc:
        raise ValueError(f"{name}: config.json lacks {exc}") from None


def resolve_model(spec: str) -> ModelSpec:
    """A built-in name, a checkpoint directory, or a path to its ``config.json``."""
    if spec.lower() in MODELS:
        return MODELS[spec.lower()]
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return model_from_hf_config(json.loads(p.read_text()), p.parent.name)
    raise ValueError(f"unknown model {spec!r}: give one of {', '.join(MODELS)}, a checkpoint directory "
                     "or a config.json path")


def resolve_hardware(name: str, overrides: dict[str, Any] | None = None) -> Hardware:
    """A built-in accelerator, with any of its fields overridden (e.g. ``{"mbu": 0.7}``)."""
    hw = HARDWARE.get(name.lower())
    if hw is None:
        raise ValueError(f"unknown hardware {name!r}: give one of {', '.join(HARDWARE)}")
    overrides = dict(overrides or {})
    known = {f.name for f in fields(Hardware)} - {"name"}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown hardware fields {sorted(unknown)} (known: {sorted(known)})")
    return replace(hw, **overrides)
