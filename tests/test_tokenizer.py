"""The broker's tokenizer (no transformers, no torch) gives exactly what transformers gives."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nebula_flow.bundled import prepare_target
from nebula_flow.tokenizer import TextCodec, eos_token_ids

TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog.",
    "   leading spaces\tand\ttabs\n\n\ntrailing   ",
    "unicode: café, naïve, Ελληνικά, 日本語, emoji 🚀🔥, math ∑∫√",
    "<|endoftext|> a special token written in the text, and <|im_start|>user too",
    "",
    "x" * 300,
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n        self.capacity = capacity\n",
]


def _pairs(tiny_pair: Path) -> list[Path]:
    return [tiny_pair / "target", prepare_target()]


def test_encode_decode_and_chat_equal_transformers(tiny_pair: Path) -> None:  # noqa: ANN001
    for folder in _pairs(tiny_pair):
        codec, hf = TextCodec(folder), AutoTokenizer.from_pretrained(str(folder))
        assert codec.vocab_size == len(hf) and codec.eos_token_id == hf.eos_token_id
        assert eos_token_ids(folder, codec) == eos_token_ids(folder)
        for text in TEXTS:
            ids = hf(text)["input_ids"]
            assert codec.encode(text) == ids, (folder.name, text)
            assert codec.encode(text, special=False) == hf(text, add_special_tokens=False)["input_ids"]
            assert codec.decode(ids) == hf.decode(ids, skip_special_tokens=True)
            assert codec.decode(ids[:5]) == hf.decode(ids[:5], skip_special_tokens=True)  # (a partial character)
            if hf.chat_template:
                want = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)
                want = want["input_ids"] if hasattr(want, "keys") else want
                assert codec.encode(text, chat=True) == list(want), (folder.name, text)
        if hf.chat_template:  # a conversation, and a template option (the tiny template's thinking switch)
            talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]},
                    {"role": "assistant", "content": TEXTS[1]}, {"role": "user", "content": TEXTS[3]}]
            for options in ({}, {"enable_thinking": False}):
                want = hf.apply_chat_template(talk, add_generation_prompt=True, tokenize=True, **options)
                want = want["input_ids"] if hasattr(want, "keys") else want
                assert codec.encode_chat(talk, options) == list(want), (folder.name, options)


def test_a_folder_without_a_fast_tokenizer_or_a_template_gets_a_clear_error(tmp_path: Path, tiny_pair: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        TextCodec(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tiny_pair / "target" / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        TextCodec(tmp_path).encode("hi", chat=True)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('only system messages') }}")
    with pytest.raises(ValueError, match="only system messages"):  # (a clear error, which the broker answers)
        TextCodec(tmp_path).encode("hi", chat=True)


def test_chat_templates_render_without_transformers_loaded(tiny_pair: Path) -> None:
    """The broker renders templates in a process that never imports transformers (which would
    bring jinja2's extensions along): render one in such a process."""
    import subprocess
    import sys

    code = ("import sys; from nebula_flow.tokenizer import TextCodec; "
            f"ids = TextCodec({str(tiny_pair / 'target')!r}).encode('hi', chat=True); "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules; print(len(ids))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and int(out.stdout) > 1, out.stderr


def test_the_broker_compiles_the_chat_template_off_its_dispatch_thread(tiny_pair: Path, tmp_path: Path) -> None:
    """A broker compiles its chat template on its tokenizer thread as it starts, so the first chat
    request does not pay it on the dispatch thread (~50 ms for SmolLM2's); the compiled template
    renders what a fresh one does. A template that does not compile is left to the first request
    to report, as before."""
    from nebula_flow.options import BrokerOptions
    from nebula_flow_broker.server import Broker

    broker = Broker(BrokerOptions(model=str(tiny_pair / "target")))
    try:
        broker.prompts.pool.submit(lambda: None).result(60)  # (one thread, in order: the compile is done)
        codec = broker.admission.codec
        assert codec._template is not None
        talk = [{"role": "user", "content": "hi"}]
        assert codec.encode_chat(talk) == TextCodec(tiny_pair / "target").encode_chat(talk)
    finally:
        broker.prompts.close()
    (tmp_path / "tokenizer.json").write_bytes((tiny_pair / "target" / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    broken = TextCodec(tmp_path)
    broken.compile_chat_template()
    assert broken._template is None
    with pytest.raises(ValueError, match="chat template refused"):
        broken.encode("hi", chat=True)
