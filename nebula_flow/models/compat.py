"""Draft/target pair compatibility: same tokenizer, same vocabulary up to padding."""

from __future__ import annotations

import json
from pathlib import Path

from nebula_flow.models.config import ModelConfig

# Some families pad the embedding matrix differently between sizes (e.g. Qwen2.5 0.5B vs 7B);
# ids past the shorter vocabulary are never produced by the tokenizer.
MAX_VOCAB_PADDING = 1024


class IncompatiblePair(ValueError):
    """The draft cannot serve this target: the message says why."""


def tokenizer_vocab(path: str | Path) -> dict[str, int] | None:
    """token -> id from ``tokenizer.json`` (model vocabulary plus added tokens), if present."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    raw = json.loads(f.read_text())
    vocab = dict(raw.get("model", {}).get("vocab") or {})
    for tok in raw.get("added_tokens", []):
        vocab[tok["content"]] = tok["id"]
    return vocab


def check_pair(draft: str | Path, target: str | Path) -> None:
    """Raise ``IncompatiblePair`` unless ``draft`` can propose tokens for ``target``."""
    d_cfg, t_cfg = ModelConfig.from_dir(draft), ModelConfig.from_dir(target)
    if abs(d_cfg.vocab_size - t_cfg.vocab_size) > MAX_VOCAB_PADDING:
        raise IncompatiblePair(f"vocabulary sizes differ: draft {d_cfg.vocab_size}, target {t_cfg.vocab_size}")
    d_vocab, t_vocab = tokenizer_vocab(draft), tokenizer_vocab(target)
    if d_vocab is not None and t_vocab is not None:
        shared = min(d_cfg.vocab_size, t_cfg.vocab_size)
        diff = [t for t, i in t_vocab.items() if i < shared and d_vocab.get(t) != i]
        if diff:
            raise IncompatiblePair(f"tokenizers differ ({len(diff)} tokens map to other ids, e.g. {diff[:3]!r}); "
                                   "a draft must use the target's tokenizer")
