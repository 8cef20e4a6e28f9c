"""A batch's draft steps without trips to the host.

A round's k draft steps are k forwards of the draft model, each fed the tokens the step before
chose. Reading each step's choice on the host (to feed it back, to sample, to map a reduced head's
rows to token ids) synchronises with the device once per step: on a GPU the host then waits for
each forward's kernels before it can launch the next one's, so a draft step costs its host work
plus its kernels instead of overlapping them. Here a step's choice stays on the device: greedy
rows take their argmax, sampled rows draw from their proposal with the uniform the host would use
(``specdec.uniform(seed, position, STREAM_DRAFT)``: positions are known ahead, so the host computes
them without waiting), and the next forward reads those tokens where they are. What the steps
chose comes to the host once, after the last step (``DraftSteps.settle``).

There the host re-draws every sampled token with ``specdec.draw`` from the proposal as shipped
(an fp64 sum may round differently on a device than in numpy); where a draw differs, the draft
ends before it. A shorter draft is verified exactly like any other, so the output still follows
the target's distribution; on a CPU the two agree (the tests check it token for token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nebula_flow import specdec
from nebula_flow.models import staging
from nebula_flow.params import SamplingParams


@dataclass
class _Step:
    """What one step chose, still on the device."""

    rows: list[int]  # the sequences (places in the batch) that drafted at this step, in order
    tokens: torch.Tensor  # [len(rows)] the token ids they chose: the next step's input
    sampled: list[int]  # the places in ``rows`` that sampled, in the order of the tensors below
    q_idx: torch.Tensor | None  # [len(sampled), P] token ids of each sampled row's proposal, most likely first
    q_prob: torch.Tensor | None  # [len(sampled), P] fp32: the proposal as shipped
    picks: torch.Tensor | None  # [len(sampled)] the place in its proposal each row drew


@dataclass
class Drafted:
    """One sequence's draft as the host learned it (``DraftSteps.settle``)."""

    fed: list[int]  # every token the steps chose, in order (the KV of all but the last was computed)
    tokens: list[int]  # the draft: ``fed``, or its prefix up to a draw the host does not confirm
    q_idx: list[np.ndarray] | None  # sampled: the proposal of each draft token (None: greedy)
    q_prob: list[np.ndarray] | None
    runner_ups: list[int]  # the next most likely first tokens after the one chosen
    picks: list[int] = field(default_factory=list)  # sampled: the place in its proposal each step drew
    drawn: list[int] = field(default_factory=list)  # sampled: the place ``specdec.draw`` picks there (-1: none)


def device_draw(q_prob: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``specdec.draw`` for rows of proposals (fp32, most likely first, zeros last) on their
    device: the place each row's uniform ``u`` (fp64) picks by inverse CDF."""
    q = q_prob.double()
    cdf = (q / q.sum(-1, keepdim=True)).cumsum(-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # (never past the last positive entry; a row with none, NaN, picks 0: the host ends its draft there)
    return torch.minimum(picks, (q_prob > 0).sum(-1) - 1).clamp_(min=0)


class DraftSteps:
    """The choices of one batch's draft steps, kept on the device until ``settle``.

    ``params``, ``seeds`` and ``starts`` (the position of each sequence's first draft token) are
    per sequence of the batch; ``token_ids`` maps output-head rows to token ids (a reduced head)."""

    def __init__(self, token_ids, proposal_top_k: int, params: list[SamplingParams], seeds: list[int],  # noqa: ANN001 - CausalLM.token_ids
                 starts: list[int]) -> None:
        self.token_ids, self.proposal_top_k = token_ids, proposal_top_k
        self.params, self.seeds, self.starts = params, seeds, starts
        self.steps: list[_Step] = []
        self.alts: tuple[list[int], list[int], torch.Tensor] | None = None

    def choose(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The next tokens of ``rows`` (one logits row each, [len(rows), V]), left on the device."""
        greedy = [j for j, r in enumerate(rows) if self.params[r].greedy]
        if len(greedy) == len(rows):
            tokens = self.token_ids(specdec.argmax(logits))
            self.steps.append(_Step(rows, tokens, [], None, None, None))
            return tokens
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy:
            at = staging.tensor(greedy, logits.device)
            tokens[at] = self.token_ids(specdec.argmax(logits.index_select(0, at)))
        groups: dict[tuple, list[int]] = {}  # rows sampling alike share one call
        for j, r in enumerate(rows):
            if not self.params[r].greedy:
                p = self.params[r]
                groups.setdefault((p.temperature, p.min_p, p.top_k, p.top_p), []).append(j)
        sampled, q_idx, q_prob, picks = [], [], [], []
        position = len(self.steps)
        for places in groups.values():
            at = staging.tensor(places, logits.device)
            p = specdec.target_probs(logits.index_select(0, at), self.params[rows[places[0]]])
            top = torch.topk(p, min(self.proposal_top_k, p.shape[-1]))
            u = staging.tensor([specdec.uniform(self.seeds[rows[j]], self.starts[rows[j]] + position, specdec.STREAM_DRAFT)
                                for j in places], logits.device, torch.float64)
            probs, ids = top.values.float(), self.token_ids(top.indices)
            drawn = device_draw(probs, u)
            tokens[at] = ids.gather(1, drawn[:, None])[:, 0]
            sampled += places
            q_idx.append(ids)
            q_prob.append(probs)
            picks.append(drawn)
        self.steps.append(_Step(rows, tokens, sampled, torch.cat(q_idx), torch.cat(q_prob), torch.cat(picks)))
        return tokens

    def runner_ups(self, logits: torch.Tensor, rows: list[int], wanted: list[int]) -> None:
        """Keep, for the first step, each row's ``wanted`` next most likely tokens after its
        choice (a token tree's alternatives); ``logits`` as ``choose`` got them."""
        if any(wanted):
            ranked = torch.topk(logits, min(max(wanted) + 1, logits.shape[-1])).indices
            self.alts = (rows, wanted, self.token_ids(ranked))

    def settle(self) -> list[Drafted]:
        """Bring every step's choices to the host at once and read each sequence's draft from them."""
        ints = [s.tokens.long() for s in self.steps]
        for s in self.steps:
            if s.sampled:  # (fp32 bits ride with the ids: one transfer)
                ints += [s.picks.long(), s.q_idx.flatten().long(), s.q_prob.view(torch.int32).flatten().long()]
        if self.alts is not None:
            ints.append(self.alts[2].flatten().long())
        flat = torch.cat(ints).cpu().numpy() if ints else np.zeros(0, dtype=np.int64)
        out = [Drafted([], [], None if p.greedy else [], None if p.greedy else [], []) for p in self.params]
        at = 0
        for s in self.steps:
            for r, token in zip(s.rows, flat[at:at + len(s.rows)].tolist()):
                out[r].fed.append(token)
            at += len(s.rows)
        for s in self.steps:
            if not s.sampled:
                continue
            n, width = len(s.sampled), s.q_idx.shape[-1]
            picks = flat[at:at + n]
            q_idx = flat[at + n:at + n + n * width].reshape(n, width).astype(np.int32)
            q_prob = flat[at + n + n * width:at + n + 2 * n * width].astype(np.int32).view(np.float32).reshape(n, width)
            at += n + 2 * n * width
            dests = [out[s.rows[place]] for place in s.sampled]
            drawn = specdec.draw_rows(q_prob, [self.seeds[s.rows[place]] for place in s.sampled],
                                      [self.starts[s.rows[place]] + len(d.picks) for place, d in zip(s.sampled, dests)])
            for j, d in enumerate(dests):
                d.q_idx.append(q_idx[j])
                d.q_prob.append(q_prob[j])
                d.picks.append(int(picks[j]))
                d.drawn.append(int(drawn[j]))
        for d in out:
            d.tokens = list(d.fed)
            if d.q_idx is not None:
                d.tokens, d.q_idx, d.q_prob = self._confirmed(d)
        if self.alts is not None:
            rows, wanted, _ = self.alts
            ranked = flat[at:].reshape(len(rows), -1).tolist()
            for r, n, ids in zip(rows, wanted, ranked):
                if out[r].tokens:  # (to the token drawn, when the draft kept it)
                    out[r].runner_ups = [x for x in ids if x != out[r].fed[0]][:n]
        return out

    @staticmethod
    def _confirmed(d: Drafted) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
        """A sampled draft cut before the first draw the host's ``specdec.draw`` does not repeat
        (or the first step without a distribution: NaN logits; the verify decides), with each kept
        token's proposal as shipped (its positive entries)."""
        tokens, q_idx, q_prob = [], [], []
        for token, idx, prob, pick, drawn in zip(d.fed, d.q_idx, d.q_prob, d.picks, d.drawn):
            if drawn < 0 or drawn != pick:
                break
            keep = prob > 0
            tokens.append(token)
            q_idx.append(idx[keep])
            q_prob.append(prob[keep])
        return tokens, q_idx, q_prob
