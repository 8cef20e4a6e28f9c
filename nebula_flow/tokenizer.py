"""Text <-> token ids, exactly as the model's HuggingFace tokenizer does it by default."""

from __future__ import annotations

import json
from pathlib import Path


class TextCodec:
    """Wraps the checkpoint's tokenizer. ``encode`` adds the same special tokens HF adds."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import: only where text is handled

        self.tok = AutoTokenizer.from_pretrained(str(path))

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            if not getattr(self.tok, "chat_template", None):
                raise ValueError("this tokenizer has no chat template; send the prompt without chat")
            ids = self.tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)


def eos_token_ids(path: str | Path, codec: TextCodec | None = None) -> tuple[int, ...]:
    """The ids that end generation, as ``generate`` would pick them: generation_config first."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    if codec is not None and codec.tok.eos_token_id is not None:
        return (int(codec.tok.eos_token_id),)
    return ()
