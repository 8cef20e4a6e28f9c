"""A small model pair the project builds itself: for tests and for a machine with no models.

``build_tiny_pair(out)`` writes two ordinary HuggingFace checkpoint directories,
``out/target`` and ``out/draft``, sharing one byte-level BPE tokenizer trained on the
Python standard library's sources. The weights are random but shaped like a trained model's
in one respect: the residual stream dominates, so the draft (the target's first layer, with
the same embeddings and head) agrees with the target often but not always. That exercises
both the accept and the reject paths of verification. The text it writes is not meaningful.
"""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file

from nebula_flow.models.config import ModelConfig
from nebula_flow.models.llama import CausalLM

EOS = "<|endoftext|>"


def _corpus(limit_bytes: int = 2_000_000) -> list[str]:
    """Text to train the tokenizer on: the standard library's Python sources."""
    texts, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = f.read_text(errors="replace")
        texts.append(text)
        total += len(text)
        if total > limit_bytes:
            break
    return texts or ["def f(x):\n    return x + 1\n"]


THINKING = ("<think>", "</think>")  # a reasoning model's markers (``api/reasoning.py``): ids 1 and 2 with ``thinking``


def build_tokenizer(out: Path, vocab_size: int, thinking: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, *(THINKING if thinking else ())],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = (  # (as gpt-oss's: the reasoning effort a template variable names, in the system part)
                          "{% if reasoning_effort is defined %}<|system|>\nReasoning: {{ reasoning_effort }}\n{% endif %}"
                          "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
                          # (as Qwen3's: the thinking switch a template option turns off)
                          "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}")
    fast.save_pretrained(str(out))


def tiny_config(vocab: int, layers: int, eos_id: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "bos_token_id": None, "eos_token_id": eos_id, "torch_dtype": "float32"}


def init_target(model: CausalLM, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        fan_in = p.shape[-1] if p.dim() > 1 else 1
        std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            p.normal_(0.0, std, generator=gen)
    # Later layers write less into the residual stream, as in trained models, so an
    # early-exit draft agrees with the full model much of the time.
    for i, layer in enumerate(model.model.layers):
        scale = 1.0 if i == 0 else 0.35
        with torch.no_grad():
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def _save(model: CausalLM, raw_cfg: dict, out: Path, tokenizer_dir: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw_cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": raw_cfg["eos_token_id"]}))
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())


def build_tiny_pair(out: str | Path, vocab_size: int = 512, target_layers: int = 4, seed: int = 0,
                    thinking: bool = False) -> Path:
    """Write ``out/target`` and ``out/draft``; returns ``out``. Deterministic for a seed.
    ``thinking``: the tokenizer has a reasoning model's thinking markers (``THINKING``)."""
    out = Path(out)
    tok_dir = out / "tokenizer"
    build_tokenizer(tok_dir, vocab_size, thinking)
    from transformers import AutoTokenizer

    eos_id = AutoTokenizer.from_pretrained(str(tok_dir)).convert_tokens_to_ids(EOS)
    vocab = max(vocab_size, eos_id + 1)
    gen = torch.Generator().manual_seed(seed)
    t_cfg = tiny_config(vocab, target_layers, eos_id)
    target = CausalLM(ModelConfig.from_dict(t_cfg))
    init_target(target, gen)
    _save(target, t_cfg, out / "target", tok_dir)
    d_cfg = tiny_config(vocab, 1, eos_id)
    draft = CausalLM(ModelConfig.from_dict(d_cfg))
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    draft.load_state_dict(state)
    _save(draft, d_cfg, out / "draft", tok_dir)
    (out / "READY").write_text("ok\n")
    return out


def ensure_tiny_pair(out: str | Path) -> Path:
    """Build the pair once; later calls reuse it."""
    out = Path(out)
    if not (out / "READY").is_file():
        build_tiny_pair(out)
    return out
