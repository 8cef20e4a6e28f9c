"""Draft steps that follow their request's row rules (``nebula_flow/penalties.py``: logit bias,
penalties, min_tokens, a grammar), as the verify will.

A draft is only a proposal: the output follows the target's distribution whatever it proposes.
But a draft that ignores the rules proposes tokens the verify then refuses: under a JSON schema
the bundled draft's proposals were nearly all forbidden (1.04 tokens a round, against 1.60 when it
follows the grammar: docs/benchmarks.md). So each draft step's row of a task with rules is made as
the verify makes the row at that position: the committed tokens plus the draft so far are its path.

A draft head that covers a subset of the vocabulary (``columns``) is scored as a full row with
the head's logits (0 elsewhere, so the grammar's verdict shows on every token) and read back at
its columns. Where the head holds no token the rules allow: a greedy draft takes the one token
they allow, if one (a grammar forces JSON's punctuation and keys, often tokens a head lacks),
else the task's draft ends there. A task whose matcher cannot follow its output (its grammar
broken by what a peer drafted) drafts with the other rules. Costs a read of those tasks' picks
per step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from nebula_flow.penalties import Penalties
from nebula_flow_workers.guides import Guides


class DraftRules:
    """The rules of a draft batch's tasks that have any (``of``), applied step by step."""

    def __init__(self, guides: Guides | None, tasks: Sequence, columns: torch.Tensor | None, vocab: int) -> None:
        self.columns, self.vocab = columns, vocab
        self.rules: dict[int, Penalties] = {}
        rids = Counter(t.rid for t in tasks if t.params.structured is not None)
        for i, t in enumerate(tasks):
            if not t.params.penalized:
                continue
            guide = None
            if t.params.structured is not None and guides is not None:
                try:  # (a request's several tasks, draft-ahead's branches: each its own matcher)
                    guide = guides.guide(t.rid, t.params, t.tokens[t.prompt_len:].tolist(), own=rids[t.rid] > 1,
                                         prompt=t.tokens[:t.prompt_len])
                except ValueError:
                    pass
            self.rules[i] = Penalties(t.params, t.tokens, t.prompt_len, t.suppress, guide)
        self.paths: dict[int, list[int]] = {i: [] for i in self.rules}
        self.greedy = {i: tasks[i].params.greedy for i in self.rules}
        self.forced: dict[int, int] = {}  # this step: rows whose token the rules force (``apply``)
        self.ends: dict[int, int] = {}  # tasks whose draft must end before this many tokens

    @staticmethod
    def of(guides: Guides | None, tasks: Sequence, columns: torch.Tensor | None, vocab: int) -> DraftRules | None:
        """The rules of ``tasks``, or None when none has any (the draft's fast path)."""
        if not any(t.params.penalized for t in tasks):
            return None
        return DraftRules(guides, tasks, columns, vocab)

    def apply(self, logits: torch.Tensor, active: list[int]) -> None:
        """Make, in place, the rows of ``logits`` (one per ``active`` task) of the tasks with rules."""
        self.forced = {}
        for j, i in enumerate(active):
            if i not in self.rules:
                continue
            if self.columns is None:
                full = logits[j]
            else:
                full = torch.zeros(self.vocab, dtype=logits.dtype, device=logits.device)
                full[self.columns] = logits[j]
            try:
                made = self.rules[i].row(full, self.paths[i])
            except ValueError:  # (the draft broke the grammar: it ends here)
                self._end(i)
                continue
            row = made if self.columns is None else made[self.columns]
            if not row.isfinite().any():  # (a reduced head holds no token the rules allow)
                allowed = made.isfinite().nonzero().flatten()
                if self.greedy[i] and len(allowed) == 1:  # they force one: the draft takes it
                    self.forced[j] = int(allowed)
                else:  # (a sampled draft's proposal cannot hold it)
                    self._end(i)
                continue
            logits[j] = row.to(logits.dtype)

    def _end(self, i: int) -> None:
        self.ends[i] = len(self.paths[i])
        del self.rules[i]

    def picked(self, tokens: torch.Tensor, active: list[int]) -> None:
        """Each ruled task's token of this step (``tokens``, one per ``active`` task; a token the
        rules force is written into it, where the head could not pick it)."""
        for j, token in self.forced.items():
            tokens[j] = token
        places = [j for j, i in enumerate(active) if i in self.rules]
        if places:
            for j, token in zip(places, tokens[places].tolist()):
                self.paths[active[j]].append(token)

    def cut(self, i: int, tokens: list, *proposal: list | None) -> tuple:
        """Task ``i``'s draft tokens (and their proposals) up to where it must end."""
        end = self.ends.get(i)
        return (tokens, *proposal) if end is None else (tokens[:end], *(p if p is None else p[:end] for p in proposal))
