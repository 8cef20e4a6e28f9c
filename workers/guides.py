"""Grammar matchers for the structured-output requests a worker verifies (``nebula_flow/structured.py``).

A worker is stateless: any round of a request may come to it, from any point of its output. It
keeps an llguidance matcher for each request it verified lately, advanced over the output tokens
it last saw. The next task of that request consumes only the tokens committed since; a task that
does not extend them (its output was cut back, or another worker ran the rounds between) rolls the
matcher back to the common prefix first. So a round costs the matcher its new tokens, and a
request's first round here costs its whole output once (llguidance consumes a token in
microseconds).

In a verify, the row after path ``p`` (the draft's or a tree's tokens beyond the committed ones)
may pick only what the grammar allows after output + p: ``Guide.allowed`` consumes ``p``, reads the
mask and rolls ``p`` back.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from nebula_flow import structured
from nebula_flow.api import reasoning
from nebula_flow.params import SamplingParams

MAX_MATCHERS = 1024  # requests whose matcher a worker keeps (least recently verified go first)
MAX_GRAMMARS = 64  # grammars whose starting matcher a worker keeps
MARKER_WINDOW = 64  # the prompt's last tokens searched for thinking markers (a chat template's generation prompt)


class Guide:
    """One request's matcher, at its committed output. ``opener``: the grammar has not begun yet
    (a reasoning model still thinking): it binds only what follows this token, anything before."""

    def __init__(self, matcher: object, vocab: int, eos: Sequence[int], opener: int | None = None) -> None:
        self.matcher, self.vocab, self.eos, self.opener = matcher, vocab, eos, opener

    def allowed(self, path: Sequence[int], avoid: Sequence[int] = ()) -> torch.Tensor:
        """Boolean [vocab]: the ids the grammar allows after ``path``; without ``avoid`` (min_tokens'
        ids) unless that would leave nothing (a complete grammar allows only EOS: it wins)."""
        if self.opener is not None:
            if self.opener not in path:  # (still thinking: every id)
                return self._avoiding(torch.ones(self.vocab, dtype=torch.bool), avoid)
            path = list(path)[list(path).index(self.opener) + 1:]
        m = self.matcher
        took = m.try_consume_tokens(list(path)) if path else 0
        if took < len(path) and not m.is_stopped():
            m.rollback(took)
            raise ValueError(f"a path breaks the grammar at its token {took}: {m.get_error() or 'not allowed'}")
        if took < len(path):  # (a path past the grammar's end: what follows its EOS is never output)
            allowed = torch.zeros(self.vocab, dtype=torch.bool)
            allowed[[t for t in self.eos if t < self.vocab]] = True
        else:
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:self.vocab]
            allowed = torch.from_numpy(bits.astype(bool))
        if took:
            m.rollback(took)
        if not allowed.any():  # (a grammar this vocabulary cannot go on with: the output ends)
            allowed[[t for t in self.eos if t < self.vocab]] = True
        return self._avoiding(allowed, avoid)

    def _avoiding(self, allowed: torch.Tensor, avoid: Sequence[int]) -> torch.Tensor:
        if avoid:
            ids = torch.tensor([t for t in avoid if t < self.vocab], dtype=torch.long)
            kept = allowed.clone()
            kept[ids] = False
            if kept.any():
                return kept
        return allowed


class Guides:
    """The matchers of one target model's requests. ``model_dir`` holds the checkpoint's
    ``tokenizer.json``; ``vocab``: the model's logits width; ``eos``: the ids that end an output."""

    def __init__(self, model_dir: str | Path, vocab: int, eos: Sequence[int]) -> None:
        self.path = Path(model_dir) / "tokenizer.json"
        self.vocab, self.eos = vocab, list(eos)
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()  # (built once, by ``prepare``'s thread or the first request)
        self._matchers: OrderedDict[int, tuple[str, object, list[int]]] = OrderedDict()
        self._fresh: dict[str, object] = {}  # grammar -> a matcher at its start, copied for each new request
        self._thinking: tuple[int | None, int | None] | None = None  # the ids of <think> and </think>, once found

    @staticmethod
    def of(model_dir: str | Path, vocab: int) -> Guides | None:
        """The guides of a model folder, or None when it has no ``tokenizer.json`` (structured
        outputs are then refused at this worker)."""
        from nebula_flow.tokenizer import eos_token_ids

        if not (Path(model_dir) / "tokenizer.json").is_file():
            return None
        return Guides(model_dir, vocab, eos_token_ids(model_dir))

    def prepare(self) -> threading.Thread:
        """Build the grammar engine's tokenizer now, on a thread of its own, so that the first
        structured request does not wait for it (~0.3 s for a 49k vocabulary): a worker calls this
        as it starts. Returns the thread. (Not a daemon: a worker that exits at once, refused by its
        broker, must not finalize the interpreter under a thread inside llguidance's native code,
        which crashed it; exiting waits for the build instead.)"""
        thread = threading.Thread(target=self._llg_tokenizer, name="guides-tokenizer")
        thread.start()
        return thread

    def _llg_tokenizer(self):  # noqa: ANN202
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                self._tokenizer = LLTokenizer(self.path.read_text(), n_vocab=self.vocab,
                                              eos_token=self.eos or None)
            return self._tokenizer

    def _start(self, grammar: str):  # noqa: ANN202
        """A matcher of ``grammar`` at its start, kept to be copied (a large schema's took ~64 ms to
        build, a copy 20 us)."""
        if (fresh := self._fresh.get(grammar)) is None:
            from llguidance import LLMatcher

            if len(self._fresh) >= MAX_GRAMMARS:
                self._fresh.clear()
            fresh = self._fresh[grammar] = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        return fresh

    def _markers(self) -> tuple[int | None, int | None]:
        """The ids of the thinking markers (``api/reasoning.py``), where each is one token of this
        tokenizer (an added token, as Qwen3's and DeepSeek-R1's are)."""
        if self._thinking is None:
            ids = [self._llg_tokenizer().tokenize_str(marker) for marker in (reasoning.START, reasoning.END)]
            self._thinking = tuple(i[0] if len(i) == 1 else None for i in ids)
        return self._thinking

    def answer_begins(self, prompt: Sequence[int], output: Sequence[int]) -> int | None:
        """Where a reasoning model's answer begins in ``output``: after the first end of thinking
        since the prompt's last start of it (0: thinking ended in the prompt, as a chat template
        writes it with thinking turned off, or this tokenizer has no such markers); None: it is
        still thinking."""
        start, end = self._markers()
        if end is None:
            return 0
        prompt = list(prompt[-MARKER_WINDOW:])
        opened = max((i for i, t in enumerate(prompt) if t == start), default=-1)
        if end in prompt[opened + 1:]:
            return 0
        return output.index(end) + 1 if end in output else None

    def guide(self, rid: int, params: SamplingParams, output: Sequence[int], own: bool = False,
              prompt: Sequence[int] = ()) -> Guide:
        """Request ``rid``'s matcher advanced over ``output`` (its committed output tokens); ``own``:
        a copy of it (the next call for ``rid`` moves the matcher it keeps). A ``think_first``
        request's grammar binds only its answer, after its thinking (``answer_begins``, which
        reads the ``prompt`` too)."""
        grammar = structured.grammar_of(params)
        output = list(output)
        if params.think_first:
            begins = self.answer_begins(prompt, output)
            if begins is None:  # (still thinking: the grammar waits for its end)
                return Guide(self._start(grammar).deep_copy(), self.vocab, self.eos, opener=self._markers()[1])
            output = output[begins:]
        entry = self._matchers.pop(rid, None)
        if entry is None or entry[0] != grammar:
            entry = (grammar, self._start(grammar).deep_copy(), [])
        _, matcher, seen = entry
        common = 0
        for a, b in zip(seen, output):
            if a != b:
                break
            common += 1
        if common < len(seen) and not matcher.rollback(len(seen) - common):  # (past what it can undo: anew)
            matcher, common = self._start(grammar).deep_copy(), 0
        if common < len(output) and not matcher.consume_tokens(output[common:]):
            error = matcher.get_error()
            raise ValueError(f"request {rid}'s output breaks its grammar: {error}")
        self._matchers[rid] = (grammar, matcher, output)
        while len(self._matchers) > MAX_MATCHERS:
            self._matchers.popitem(last=False)
        return Guide(matcher.deep_copy() if own else matcher, self.vocab, self.eos)

