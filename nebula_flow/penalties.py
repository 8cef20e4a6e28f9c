"""Repetition penalties on the target's logits, as OpenAI, vLLM and HF transformers define them.

For the row that picks output token i (after ``prompt + output[:i]``):

- ``logit_bias`` (OpenAI's): each listed token's logit gets its bias added, first (as vLLM);
- ``repetition_penalty`` r (HF's ``RepetitionPenaltyLogitsProcessor``, vLLM's): the logit of every
  token already in the prompt or the output is divided by r where positive, multiplied where not;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): the logit of each token that the
  output holds c > 0 times drops by ``c * f + p`` (the prompt does not count);
- ``min_tokens`` m (vLLM's): while the output holds fewer than m tokens, the ids that would end it
  (EOS unless ignored, the stop token ids: the broker names them, ``Request.suppress``) cannot be
  picked (their logits are -inf);
- ``allowed_token_ids`` (vLLM's): no other id can be picked (their logits are -inf);
- ``bad_word_ids`` (vLLM's ``bad_words``, as the broker spells them): where the output ends with all
  but the last token of a sequence, its last token cannot be picked (a one-token word never can);
- a grammar (``structured``, ``nebula_flow/structured.py``): only the ids it allows after
  ``prompt + output[:i]`` can be picked (a ``guide`` gives them; the worker keeps it,
  ``workers/guides.py``); where min_tokens' ids are all it allows (it is complete), it wins.

Temperature, top-k and top-p then apply to the penalized logits. In a verify the rows of a draft
(or a token tree) each see the committed tokens plus the tree's tokens on the path to them, so
every row is penalized exactly as the row a plain decode would compute at that position: greedy
output is the penalized greedy output, and speculative sampling follows the penalized
distribution exactly (the draft's proposal may be anything). Where the rules together leave no id
(allowed_token_ids that a grammar, bad_words or min_tokens rule out), the row raises
``NoTokenAllowed``: the request fails with that error (a greedy pick would take id 0 against every
rule, a sampled one would draw from NaN). Pure: torch and numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nebula_flow.params import SamplingParams


class NoTokenAllowed(ValueError):
    """A row in which a request's rules leave no token: its output cannot go on."""


class Penalties:
    """A request's penalties at the start of a verify: the tokens it has seen, its output's counts
    and its grammar's ``guide`` (``workers.guides.Guide``: ``allowed(path, avoid)``), if any."""

    def __init__(self, params: SamplingParams, tokens: np.ndarray, prompt_len: int, suppress: list[int] = (),
                 guide: Any = None) -> None:  # noqa: ANN401
        self.params, self.suppress, self.output_len = params, list(suppress), len(tokens) - prompt_len
        self.guide = guide
        self.bias = None  # (ids, values) of the logit bias
        self.allowed = None if params.allowed_token_ids is None else torch.tensor(sorted(set(params.allowed_token_ids)))
        self._barred: torch.Tensor | None = None  # (allowed_token_ids: the mask of every other id, made once)
        self.bad = params.bad_word_ids
        # (bad words: the output's last tokens, as many as the longest word's head)
        self.tail = tokens[max(prompt_len, len(tokens) - max(map(len, self.bad)) + 1):].tolist() if self.bad else []
        if params.logit_bias:
            items = sorted(params.logit_bias.items())
            self.bias = (torch.tensor([t for t, _ in items]), torch.tensor([b for _, b in items], dtype=torch.float64))
        # (each only where its penalty is on: a request with a grammar alone, or a bias, needs neither)
        self.seen, self.seen_ids, self.counts = set(), None, {}
        if params.repetition_penalty != 1.0:
            seen = np.unique(tokens)  # prompt and output, sorted
            self.seen, self.seen_ids = set(seen.tolist()), torch.from_numpy(seen.astype(np.int64))
        if params.frequency_penalty or params.presence_penalty:
            ids, counts = np.unique(tokens[prompt_len:], return_counts=True)
            self.counts = dict(zip(ids.tolist(), counts.tolist()))  # the output's

    @staticmethod
    def of(params: SamplingParams, tokens: np.ndarray, prompt_len: int, suppress: list[int] = (),
           guide: Any = None) -> Penalties | None:  # noqa: ANN401
        return Penalties(params, tokens, prompt_len, suppress, guide) if params.penalized else None

    def row(self, logits: torch.Tensor, path: list[int]) -> torch.Tensor:
        """One row of logits penalized for the committed tokens plus ``path``: the tokens this row
        follows beyond them (a draft's or a tree's, in order)."""
        p = self.params
        out = logits.to(torch.float64, copy=True)
        vocab = out.shape[-1]
        if self.bias is not None:
            ids, values = self.bias
            keep = ids < vocab  # (the broker refuses others where it knows the vocabulary)
            out[ids[keep].to(out.device)] += values[keep].to(out.device)
        if p.repetition_penalty != 1.0:
            new = [t for t in dict.fromkeys(path) if t not in self.seen]
            idx = torch.cat([self.seen_ids, torch.tensor(new, dtype=torch.long)]).to(out.device)
            idx = idx[idx < vocab]
            vals = out[idx]
            out[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            counts = self.counts
            if path:
                counts = dict(counts)
                for t in path:
                    counts[t] = counts.get(t, 0) + 1
            if ids := [t for t in counts if t < vocab]:
                idx = torch.tensor(ids, device=out.device)
                c = torch.tensor([counts[t] for t in ids], dtype=out.dtype, device=out.device)
                out[idx] -= c * p.frequency_penalty + p.presence_penalty
        short = self.suppress and self.output_len + len(path) < p.min_tokens
        if self.guide is not None:
            allowed = self.guide.allowed(path, self.suppress if short else ())
            out[:len(allowed)].masked_fill_(~allowed.to(out.device), float("-inf"))
        elif short:
            out[[t for t in self.suppress if t < vocab]] = float("-inf")
        if self.bad:
            tail = self.tail + list(path)
            for word in self.bad:
                n = len(word) - 1
                if word[-1] < vocab and (n == 0 or len(tail) >= n and tuple(tail[-n:]) == word[:-1]):
                    out[word[-1]] = float("-inf")
        if self.allowed is not None:
            if self._barred is None or len(self._barred) != vocab or self._barred.device != out.device:
                self._barred = torch.ones(vocab, dtype=torch.bool, device=out.device)
                self._barred[self.allowed[self.allowed < vocab].to(out.device)] = False
            out.masked_fill_(self._barred, float("-inf"))
        if bool(torch.isneginf(out).all()):
            raise NoTokenAllowed(f"no token is allowed at output token {self.output_len + len(path) + 1}: this "
                                 "request's allowed_token_ids, bad_words, min_tokens and grammar together rule out "
                                 "every id")
        return out
