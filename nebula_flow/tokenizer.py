"""Text <-> token ids, exactly as the checkpoint's HuggingFace fast tokenizer does it by default,
without transformers: the broker tokenizes, and transformers would load torch into it (the one
process that must stay light). ``tests/test_tokenizer.py`` checks the equality against
transformers' ``AutoTokenizer`` on the project's models.

What it reproduces: ``tokenizer.json`` (the `tokenizers` library: normalizer, pre-tokenizer,
model, post-processor, decoder); the post-processor transformers rebuilds when
``tokenizer_config.json`` says ``add_bos_token`` / ``add_eos_token``; decoding with special tokens
skipped; and the chat template (``chat_template.jinja`` or the config's ``chat_template``) rendered
in a sandbox as transformers renders it, for a conversation (or one user message) with the
generation prompt and the template's own options (``apply_chat_template``'s extra keywords).
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors

# What a chat template reads besides its options: a conversation's options may not replace them.
TEMPLATE_INPUTS = frozenset({"messages", "raise_exception", "strftime_now", "bos_token",
                             "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"})
# Options that are not the template's variables but, as transformers' ``apply_chat_template``'s keywords,
# how it is rendered: the generation prompt (the assistant's turn begun; default true, false where the
# final message is left open), and the final message left open for the model to continue (an answer
# begun for it; default false).
RENDER_OPTIONS = ("add_generation_prompt", "continue_final_message")


class TextCodec:
    """A checkpoint folder's tokenizer. ``encode`` adds the special tokens HF adds by default."""

    def __init__(self, path: str | Path) -> None:
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder} has no tokenizer.json (a fast tokenizer is needed)")
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.special = {name: _content(cfg.get(name)) for name in
                        ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}
        if "add_bos_token" in cfg or "add_eos_token" in cfg or self.tok.post_processor is None:
            self._bos_eos_processor(bool(cfg.get("add_bos_token")), bool(cfg.get("add_eos_token")))
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = template.read_text() if template.is_file() else cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # (named templates: the default one)
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"), None)
        self._template = None

    def _bos_eos_processor(self, add_bos: bool, add_eos: bool) -> None:
        """The post-processor transformers builds when the config names add_bos/eos_token."""
        bos, eos = self.special["bos_token"], self.special["eos_token"]
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
        special = [(t, self.tok.token_to_id(t)) for t, add in ((bos, add_bos), (eos, add_eos)) if add]
        self.tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    def encode(self, text: str, chat: bool = False, special: bool = True, unlocked: bool = False) -> list[int]:
        """Token ids of ``text``; ``chat``: as one user message in the chat template, with the
        generation prompt; ``special``: with the special tokens the tokenizer adds (not in chat).
        ``unlocked``: through the tokenizer's batch call, which releases the GIL while it works
        (the single-text call holds it): for long texts on a thread beside other work."""
        if chat:
            return self.encode_chat([{"role": "user", "content": text}], unlocked=unlocked)
        if unlocked:
            return self.tok.encode_batch([text], add_special_tokens=special)[0].ids
        return self.tok.encode(text, add_special_tokens=special).ids

    def encode_chat(self, messages: list[dict[str, Any]], options: dict[str, Any] | None = None,
                    unlocked: bool = False, special: bool = False) -> list[int]:
        """Token ids of a conversation through the chat template (the template's text holds its
        special tokens: the tokenizer adds none unless ``special``)."""
        return self.encode(self.render_chat(messages, options), special=special, unlocked=unlocked)

    def render_chat(self, messages: list[dict[str, Any]], options: dict[str, Any] | None = None) -> str:
        """The chat template's text for ``messages``; ``options`` are the template's own variables
        (e.g. ``enable_thinking``) and ``RENDER_OPTIONS``, as transformers takes
        ``apply_chat_template``'s keywords. ``ValueError`` when there is no template, an option would
        replace one of the template's inputs, or the template refuses the conversation."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; send the prompt without chat")
        options = dict(options or {})
        if taken := sorted(set(options) & TEMPLATE_INPUTS):
            raise ValueError(f"chat template options may not set {', '.join(taken)}")
        open_end = options.pop(RENDER_OPTIONS[1], False)
        generation_prompt = options.pop(RENDER_OPTIONS[0], open_end is not True)  # (a message left open: no new turn)
        if not isinstance(generation_prompt, bool) or not isinstance(open_end, bool) or generation_prompt and open_end:
            raise ValueError("add_generation_prompt and continue_final_message are booleans, not both true")
        import jinja2

        try:
            if self._template is None:
                self._template = _compile(self.chat_template)
            text = self._template.render(**options, messages=messages, add_generation_prompt=generation_prompt,
                                         **{k: v for k, v in self.special.items() if v is not None})
        except jinja2.TemplateError as exc:  # (a template's raise_exception, or a template that is broken)
            raise ValueError(f"the chat template refused this conversation: {exc}") from None
        except (TypeError, AttributeError, KeyError) as exc:  # (a message of a shape the template cannot read)
            raise ValueError(f"the chat template cannot read this conversation: {exc}") from None
        return _left_open(text, messages) if open_end else text

    def compile_chat_template(self) -> None:
        """Compile the chat template ahead of its first use, which otherwise pays jinja2's import
        and the compile (~50 ms for SmolLM2's) on the broker's dispatch thread. A template that
        does not compile is left to its first use to report."""
        if self.chat_template and self._template is None:
            import jinja2

            with contextlib.suppress(jinja2.TemplateError):
                self._template = _compile(self.chat_template)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def incremental(self, skip_special: bool = True) -> IncrementalText:
        """A decoder of one growing output that decodes only its new tokens each time."""
        return IncrementalText(self.tok, skip_special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special["eos_token"]
        return self.tok.token_to_id(eos) if eos is not None else None


class IncrementalText:
    """The text of a growing list of token ids, decoded a step at a time: each ``extend`` decodes
    only the ids since the last text it gave out, with the ids before them as context (as vLLM's
    incremental detokenizer does), so a request costs linear, not quadratic, time in its length.
    Text whose end is a partial character (its bytes not all there yet) is pending: given out
    once the character completes."""

    def __init__(self, tok: Tokenizer, skip_special: bool = True) -> None:
        self.tok, self.skip = tok, skip_special  # (skip_special: special tokens' text left out)
        self.prefix = self.read = 0  # ids[prefix:read]: the context; ids[read:]: not given out yet

    def extend(self, ids: list[int]) -> tuple[str, str]:
        """(the text given out now, the text pending after it) for ``ids``, the whole list so far."""
        before = self.tok.decode(ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = self.tok.decode(ids[self.prefix:], skip_special_tokens=self.skip)
        new = after[len(before):]
        if not new or after.endswith("\ufffd"):
            return "", new
        self.prefix, self.read = self.read, len(ids)
        return new, ""


def _left_open(text: str, messages: list[dict[str, Any]]) -> str:
    """``continue_final_message``: the rendered conversation cut right after the final message's
    text, whatever the template writes to close it (as transformers does; some templates strip a
    message's surrounding whitespace, so its stripped text is looked for too)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text to continue")
    for piece in (final, final.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[:at + len(piece)]
    raise ValueError("continue_final_message: the chat template does not write the final message's text as given")


def _content(token: Any) -> str | None:  # noqa: ANN401
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    return token.get("content") if isinstance(token, dict) else token


def _compile(template: str) -> Any:  # noqa: ANN401
    """A chat template in a sandbox, with the environment HF templates expect (trimmed blocks,
    loop controls, a tojson that does not escape HTML, raise_exception, strftime_now)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,  # noqa: ANN401
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def eos_token_ids(path: str | Path, codec: TextCodec | None = None) -> tuple[int, ...]:
    """The ids that end generation, as ``generate`` would pick them: generation_config first."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    if codec is not None and codec.eos_token_id is not None:
        return (codec.eos_token_id,)
    return ()
