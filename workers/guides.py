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

from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from nebula_flow import structured
from nebula_flow.params import SamplingParams

MAX_MATCHERS = 1024  # requests whose matcher a worker keeps (least recently verified go first)


class Guide:
    """One request's matcher, at its committed output."""

    def __init__(self, matcher: object, vocab: int, eos: Sequence[int]) -> None:
        self.matcher, self.vocab, self.eos = matcher, vocab, eos

    def allowed(self, path: Sequence[int], avoid: Sequence[int] = ()) -> torch.Tensor:
        """Boolean [vocab]: the ids the grammar allows after ``path``; without ``avoid`` (min_tokens'
        ids) unless that would leave nothing (a complete grammar allows only EOS: it wins)."""
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
        self._matchers: OrderedDict[int, tuple[str, object, list[int]]] = OrderedDict()

    @staticmethod
    def of(model_dir: str | Path, vocab: int) -> Guides | None:
        """The guides of a model folder, or None when it has no ``tokenizer.json`` (structured
        outputs are then refused at this worker)."""
        from nebula_flow.tokenizer import eos_token_ids

        if not (Path(model_dir) / "tokenizer.json").is_file():
            return None
        return Guides(model_dir, vocab, eos_token_ids(model_dir))

    def _llg_tokenizer(self):  # noqa: ANN202
        if self._tokenizer is None:  # (~0.3 s for a 49k vocabulary: once, at the first structured request)
            from llguidance import LLTokenizer

            self._tokenizer = LLTokenizer(self.path.read_text(), n_vocab=self.vocab,
                                          eos_token=self.eos or None)
        return self._tokenizer

    def guide(self, rid: int, params: SamplingParams, output: Sequence[int], own: bool = False) -> Guide:
        """Request ``rid``'s matcher advanced over ``output`` (its committed output tokens); ``own``:
        a copy of it (the next call for ``rid`` moves the matcher it keeps)."""
        from llguidance import LLMatcher

        grammar = structured.grammar(params.structured)
        entry = self._matchers.pop(rid, None)
        output = list(output)
        if entry is None or entry[0] != grammar:
            entry = (grammar, LLMatcher(self._llg_tokenizer(), grammar, log_level=0), [])
        _, matcher, seen = entry
        common = 0
        for a, b in zip(seen, output):
            if a != b:
                break
            common += 1
        if common < len(seen):
            matcher.rollback(len(seen) - common)
        if common < len(output) and not matcher.consume_tokens(output[common:]):
            error = matcher.get_error()
            raise ValueError(f"request {rid}'s output breaks its grammar: {error}")
        self._matchers[rid] = (grammar, matcher, output)
        while len(self._matchers) > MAX_MATCHERS:
            self._matchers.popitem(last=False)
        return Guide(matcher.deep_copy() if own else matcher, self.vocab, self.eos)


class DraftMasks:
    """Drafting under grammars: each draft step of a structured task picks only what the grammar
    allows after the task's output and the draft so far, so the draft does not spend verify rows
    on tokens the target's grammar refuses. A draft is only a proposal: a task whose output its
    matcher cannot follow (one that comes without its prompt's length) drafts freely, and
    exactness never depends on this. ``columns``: the token id of each output-head row (a reduced
    draft head; None: the identity). Where a reduced head holds none of the tokens the grammar
    allows, a greedy draft takes the one it forces (JSON's punctuation between keys: often a token
    the head lacks), else the draft ends there. Costs a read of the structured rows' picks per step."""

    def __init__(self, guides: Guides, tasks: Sequence, columns: torch.Tensor | None) -> None:
        self.columns = columns
        self.guides: dict[int, Guide] = {}
        rids = Counter(t.rid for t in tasks if t.params.structured is not None)
        for i, t in enumerate(tasks):
            if t.params.structured is not None:
                try:  # (a request's several tasks, draft-ahead's branches: each its own matcher)
                    self.guides[i] = guides.guide(t.rid, t.params, t.tokens[t.prompt_len:].tolist(), own=rids[t.rid] > 1)
                except ValueError:
                    pass
        self.paths: dict[int, list[int]] = {i: [] for i in self.guides}
        self.greedy = {i: tasks[i].params.greedy for i in self.guides}
        self.forced: dict[int, int] = {}  # this step: rows whose token the grammar forces (``apply``)
        self.ends: dict[int, int] = {}  # tasks whose draft must end before this many tokens

    def cut(self, i: int, tokens: list, *proposal: list | None) -> tuple:
        """Task ``i``'s draft tokens (and their proposals) up to where it must end."""
        end = self.ends.get(i)
        return (tokens, *proposal) if end is None else (tokens[:end], *(p if p is None else p[:end] for p in proposal))

    @staticmethod
    def of(guides: Guides | None, tasks: Sequence, columns: torch.Tensor | None) -> DraftMasks | None:
        if guides is None or all(t.params.structured is None for t in tasks):
            return None
        masks = DraftMasks(guides, tasks, columns)
        return masks if masks.guides else None

    def apply(self, logits: torch.Tensor, active: list[int]) -> None:
        """Mask, in place, the rows of ``logits`` (one per ``active`` task) of the structured tasks."""
        self.forced: dict[int, int] = {}
        for j, i in enumerate(active):
            if i not in self.guides:
                continue
            try:
                allowed = self.guides[i].allowed(self.paths[i])
            except ValueError:  # (the draft went past the grammar's end: free from here)
                del self.guides[i]
                continue
            if self.columns is not None:
                full, allowed = allowed, allowed[self.columns]
                if not allowed.any():  # (a reduced head holds no token the grammar allows)
                    if self.greedy[i] and int(full.sum()) == 1:  # the grammar forces one: the draft takes it
                        self.forced[j] = int(full.nonzero())
                    else:  # (a sampled draft's proposal cannot hold it: its draft ends here)
                        self.ends[i] = len(self.paths[i])
                        del self.guides[i]
                    continue
            logits[j, :len(allowed)].masked_fill_(~allowed.to(logits.device), float("-inf"))

    def picked(self, tokens: torch.Tensor, active: list[int]) -> None:
        """Each structured task's token of this step (``tokens``, one per ``active`` task; a token
        the grammar forces is written into it, where the head could not pick it)."""
        for j, token in self.forced.items():
            tokens[j] = token
        places = [j for j, i in enumerate(active) if i in self.guides]
        if places:
            for j, token in zip(places, tokens[places].tolist()):
                self.paths[active[j]].append(token)
