"""Model configuration read from a HuggingFace ``config.json``.

Only the fields the Llama-family runtime needs are kept. Both the transformers v4 layout
(``rope_theta`` + ``rope_scaling``) and the v5 layout (``rope_parameters``) are accepted,
because real checkpoints on disk use either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class ModelConfigError(ValueError):
    """A checkpoint's config.json is missing, malformed or names an unsupported family."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # the window of the layers that slide (``sliding_layers``)
    rope: dict[str, Any] = field(default_factory=dict)
    sliding_layers: tuple[bool, ...] = ()  # per layer: does it attend within ``sliding_window`` only
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # A draft may score only a subset of the vocabulary (its output head has ``draft_head_size``
    # rows; the checkpoint's ``head_token_ids`` tensor maps row -> token id). Proposals stay
    # lossless because the verifier uses exactly the distribution the draft sampled from.
    draft_head_size: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            head_dim = int(raw.get("head_dim") or hidden // heads)
            attention_bias = bool(raw.get("attention_bias", False))
            window = raw.get("sliding_window") if model_type == "mistral" or raw.get("use_sliding_window") else None
            layers = int(raw["num_hidden_layers"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias and no o bias; Llama/Qwen3 use attention_bias for all four.
                qkv_bias=True if model_type == "qwen2" else attention_bias,
                o_bias=False if model_type == "qwen2" else attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                sliding_window=int(window) if window else None,
                sliding_layers=_sliding_layers(raw, model_type, layers) if window else (),
                rope=_rope_parameters(raw),
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                draft_head_size=int(raw["draft_head_size"]) if raw.get("draft_head_size") else None,
            )
        except ModelConfigError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelConfigError(f"malformed model config: {exc!r}") from exc

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelConfigError(f"no config.json in {path} (expected a HuggingFace checkpoint directory)")
        return cls.from_dict(json.loads(cfg_path.read_text()))

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention, or None where it sees every position."""
        slides = self.sliding_window and layer < len(self.sliding_layers) and self.sliding_layers[layer]
        return self.sliding_window if slides else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one position takes in fp32 (K and V, every layer)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


def _sliding_layers(raw: dict[str, Any], model_type: str, layers: int) -> tuple[bool, ...]:
    """Which layers slide, as transformers decides: Mistral's all; Qwen2/Qwen3's those the config's
    ``layer_types`` call sliding, else those from ``max_window_layers`` on (default 28)."""
    if model_type == "mistral":
        return (True,) * layers
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(t == "sliding_attention" for t in types)
    first = int(raw.get("max_window_layers", 28))
    return tuple(i >= first for i in range(layers))


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    if rope_type in ("llama3", "yarn"):  # (as transformers: the top-level field first, then the context)
        params["original_max_position_embeddings"] = raw.get(
            "original_max_position_embeddings", params.get("original_max_position_embeddings",
                                                           raw.get("max_position_embeddings", 2048)))
    return params
