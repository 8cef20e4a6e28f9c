"""Speculative decoding math: the draft's proposal and the target's verification.

Lossless by construction:

* Greedy (temperature 0): the draft proposes argmax tokens; the target accepts the longest
  prefix equal to its own argmax and appends its own argmax at the first mismatch (or after
  the last draft token). The output is the target's greedy output, token for token.
* Sampling: standard speculative rejection sampling. The draft samples token x from a
  proposal q and ships q (sparse: its top-P entries, renormalised). The verifier accepts x
  with probability min(1, p(x)/q(x)); on rejection it samples from norm(max(0, p - q)); if all
  drafts pass it samples a bonus token from p. Because the verifier uses exactly the q the
  draft sampled from, the output follows p exactly, whatever q is.

Every random number is ``uniform(seed, position, stream)``: a pure function of the request's
seed, the absolute position of the token being decided and what it decides. No worker RNG
state is involved, so the output is the same whatever worker, batch or mode runs the round.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from nebula_flow.params import SamplingParams
from nebula_flow.penalties import Penalties
from nebula_flow.tree import TokenTree

STREAM_DRAFT = 1  # the draft's choice of a proposal token
STREAM_ACCEPT = 2  # the accept/reject test of a proposal token
STREAM_RESAMPLE = 3  # sampling a correction or bonus token from the target
STREAM_FUSED = 8  # the accept test of a fused chain's token: STREAM_FUSED + its place among its node's candidates

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: int) -> float:
    """A uniform number in [0, 1) determined by (seed, position, stream) alone."""
    h = splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ position) ^ stream)
    return (h >> 11) * (1.0 / (1 << 53))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest logit (the first of equal ones), as ``logits.argmax(-1)``.
    On a CPU torch's argmax over a vocabulary-wide row is slow, and every greedy draft step and
    verify takes one on a round's critical path: 3 rows of 49,152 logits took 142 us in fp32 and
    357 us in bf16 where numpy's took 10 and 41, the bf16 -> fp32 conversion (exact) included
    (torch 2.13, 2 threads, warm; ``tools/bench_argmax.py``, docs/benchmarks.md). On a GPU: torch's."""
    if logits.device.type != "cpu":
        return logits.argmax(-1)
    rows = logits if logits.dtype == torch.float32 else logits.float()
    return torch.from_numpy(np.asarray(rows.numpy().argmax(-1)))


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """``argmax``'s picks as ints, on a CPU straight from numpy (no tensor made on the way: each
    library call a verify makes costs tens of microseconds when its code has gone cold)."""
    if logits.device.type != "cpu":
        return logits.argmax(-1).tolist()
    return (logits if logits.dtype == torch.float32 else logits.float()).numpy().argmax(-1).tolist()


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of logits -> the sampling distribution (temperature, then min-p, then top-k, then top-p,
    vLLM's order), fp64."""
    scores = logits.double() / params.temperature
    if params.min_p > 0.0:  # (p < min_p * p_max is s < s_max + log(min_p): no softmax of its own)
        cut = scores.max(dim=-1, keepdim=True).values + math.log(params.min_p)
        scores = scores.masked_fill(scores < cut, float("-inf"))
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        # On a CPU numpy's vectorised sort (1.7 ms against torch's 6.6 for 49k scores); tied scores at
        # the cut may then keep another of the tied tokens, which is as much the top-p set.
        if scores.device.type == "cpu":
            order = torch.from_numpy(np.argsort(scores.cpu().numpy(), axis=-1))
            sorted_scores = scores.gather(-1, order)
        else:
            sorted_scores, order = torch.sort(scores, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= 1 - params.top_p
        drop[..., -1] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores.softmax(-1)


def sample_index(probs: torch.Tensor | np.ndarray, u: float) -> int:
    """Inverse-CDF sample from unnormalised non-negative weights with the uniform ``u``."""
    cdf = np.cumsum(np.asarray(probs, dtype=np.float64))
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(idx, int(np.flatnonzero(np.asarray(probs) > 0)[-1]))


def normalize_proposal(q_prob: np.ndarray) -> np.ndarray:
    """The exact fp64 proposal both sides use, derived from the fp32 values on the wire."""
    q = np.asarray(q_prob, dtype=np.float64)
    return q / q.sum()


def propose(
    logits: torch.Tensor, params: SamplingParams, seed: int, position: int, proposal_top_k: int,
) -> tuple[int, np.ndarray | None, np.ndarray | None]:
    """Pick the draft token for ``position`` from one row of draft logits.

    Returns (token, q_idx, q_prob); q is None for greedy. With sampling, q is the draft's
    distribution cut to its ``proposal_top_k`` most likely tokens (fp32 on the wire).
    """
    if params.greedy:
        return int(argmax(logits)), None, None
    p = target_probs(logits, params)
    top = torch.topk(p, min(proposal_top_k, p.shape[-1]))
    q_prob = top.values.float().cpu().numpy()  # (logits may live on a device: only the top-k cross to the host)
    q_idx = top.indices.to(torch.int32).cpu().numpy()
    pick, q_idx, q_prob = draw(q_idx, q_prob, seed, position)
    return int(q_idx[pick]), q_idx, q_prob


def not_finite(model: str) -> ValueError:
    """A request's sampling distribution that is none (NaN or infinite logits): it fails alone, with this."""
    return ValueError(f"the {model} model's probabilities are not finite (NaN or infinite logits: the model "
                      "overflows in its dtype, or the sampling parameters push its logits past fp32's range)")


def draw(q_idx: np.ndarray, q_prob: np.ndarray, seed: int, position: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The draft's draw from its proposal as shipped (``q_prob`` fp32, most likely first): the
    entries that stay (the positive ones), and the place among them of the token drawn with
    ``uniform(seed, position, STREAM_DRAFT)``."""
    keep = q_prob > 0
    if not keep.any():  # (NaN probabilities compare false)
        raise not_finite("draft")
    q_prob, q_idx = q_prob[keep], q_idx[keep]
    return sample_index(normalize_proposal(q_prob), uniform(seed, position, STREAM_DRAFT)), q_idx, q_prob


def draw_rows(q_prob: np.ndarray, seeds: list[int], positions: list[int]) -> np.ndarray:
    """``draw`` for each row of ``q_prob`` ([rows, P] fp32, most likely first) at once: the place
    among its positive entries that each row's ``uniform(seeds[i], positions[i], STREAM_DRAFT)``
    picks, or -1 for a row without a distribution (no positive entry). The places ``draw`` picks
    row by row, bit for bit: rows whose positive entries come first (a top-k's, always) in one
    pass, each row's sum taken as numpy takes it alone; any other row through ``draw`` itself. (``draw`` costs
    ~13 us a row, most of it numpy's fixed cost per call, and a draft step checks every sampled
    row's draw on the host; 2026-12-07, 2-core AMD EPYC, AVX-512.)"""
    rows = q_prob.shape[0]
    if rows == 0:
        return np.zeros(0, dtype=np.int64)
    keep = q_prob > 0  # (NaN compares false)
    counts = keep.sum(-1)
    gaps = (keep[:, 1:] & ~keep[:, :-1]).any(-1)  # (a positive entry after one that is not)
    u = np.array([uniform(s, p, STREAM_DRAFT) for s, p in zip(seeds, positions)])
    q = np.where(keep, q_prob, 0).astype(np.float64)  # (zeros past a row's entries: its cumsum keeps its bits)
    sums = np.ones(rows)
    for m in set(counts[~gaps].tolist()) - {0}:  # (a row's sum as numpy sums its entries alone)
        at = (counts == m) & ~gaps
        sums[at] = q[at, :m].sum(-1)
    cdf = np.cumsum(q / sums[:, None], -1)  # (normalize_proposal's, then sample_index's)
    last = np.maximum(counts - 1, 0)
    picked = np.minimum((cdf <= (u * cdf[np.arange(rows), last])[:, None]).sum(-1), last)
    places = np.where((counts > 0) & ~gaps, picked, -1)
    ids = np.arange(q_prob.shape[1])
    for i in np.flatnonzero(gaps).tolist():  # (never from a top-k)
        places[i] = draw(ids, q_prob[i], seeds[i], positions[i])[0]
    return places


def verify(
    logits: torch.Tensor, draft: list[int], q_idx: list[np.ndarray] | None,
    q_prob: list[np.ndarray] | None, params: SamplingParams, seed: int, position: int,
    runner_ups: list[int] = (), chains: list[list[int]] = (), best: list[int] | None = None,
    penalties: Penalties | None = None,
) -> list[int]:
    """Decide the tokens a round commits: accepted drafts plus one correction/bonus token.

    ``logits`` holds len(draft)+1 target rows: row i scores the token at ``position + i``
    (row 0 follows the last committed token). Returns between 1 and len(draft)+1 tokens.

    A token tree (``TokenTree([draft, *[[a] for a in runner_ups], *chains])``): ``runner_ups`` are alternatives
    to ``draft[0]`` (the draft's runner-ups to it) and ``chains`` further draft chains (a prompt lookup's, fused into
    the round). Then ``logits`` holds 1 + len(tree) rows, row 1+i after tree node i, and the round
    walks the tree. Greedy: along the target's own choices, committing the path it finds plus the
    target's token after it, still exactly the target's greedy output (``best``: the rows' argmax,
    where the caller took it for a whole batch at once). Sampling: see ``_sample_tree``; the output
    still follows the target's distribution exactly. ``penalties``: each row's logits penalized for
    the committed tokens and the tree's tokens on its path (``nebula_flow/penalties.py``).
    """
    tree = TokenTree([draft, *([a] for a in runner_ups), *chains])
    if params.greedy:
        if penalties is not None:  # (each row its own: its path's tokens count too)
            def pick(node: int) -> int:
                return int(argmax(penalties.row(logits[node + 1], path_tokens(tree, node))))
        else:
            best = argmax_ids(logits) if best is None else best

            def pick(node: int) -> int:
                return best[node + 1]
        out, node = [], -1
        while True:  # (each row's pick made once: a penalized one costs a pass over the vocabulary)
            out.append(token := pick(node))
            if (node := tree.child(node, token)) is None:
                return out
    return _sample_tree(TargetRows(logits, params, penalties, tree), tree, len(draft), q_idx, q_prob, seed, position)


def path_tokens(tree: TokenTree, node: int) -> list[int]:
    """The tree's tokens from its root to ``node`` (-1: none), in order."""
    out = []
    while node >= 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return out[::-1]


class TargetRows:
    """The target's sampling distribution for each row of ``logits`` (``target_probs``, fp64 on
    the host), each made when first read: a round's walk reads only the rows on its path, most
    rounds fewer than all (a row's values do not depend on the rows made with it)."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams, penalties: Penalties | None = None,
                 tree: TokenTree | None = None) -> None:
        self.logits, self.params, self.penalties, self.tree = logits, params, penalties, tree
        self.vocab = logits.shape[-1]
        self.made: dict[int, np.ndarray] = {}

    def __getitem__(self, row: int) -> np.ndarray:
        if row not in self.made:
            scores = self.logits[row] if self.penalties is None else \
                self.penalties.row(self.logits[row], path_tokens(self.tree, row - 1))
            made = self.made[row] = target_probs(scores, self.params).cpu().numpy()
            if not made.sum() > 0.5:  # (a softmax sums to 1; NaN compares false)
                raise not_finite("target")
        return self.made[row]


def _sample_tree(p: TargetRows, tree: TokenTree, drafted: int, q_idx: list[np.ndarray] | None,
                 q_prob: list[np.ndarray] | None, seed: int, position: int) -> list[int]:
    """Speculative sampling over a token tree whose first ``drafted`` nodes are the draft (each
    sampled from its proposal q) and whose other nodes are fixed tokens chosen without looking
    at the target (a prompt lookup's, or the draft's runner-ups to the token it drew: their q is
    a point).

    At each node the candidates are its children, the draft's first: each is accepted with
    probability min(1, r(x)/q(x)), where r starts as the target's distribution p and each
    rejection leaves r = norm(max(0, r - q)) (recursive rejection sampling, as SpecInfer's
    multi-step speculative sampling). An accepted candidate moves the walk to its node; when all
    are rejected, the round commits a sample from the last r. Each step keeps the output
    distributed exactly as p: the draft's step is the usual one, and a fixed candidate y gives y
    with probability r(y) and otherwise a sample from r without y. With the draft alone this is
    the usual rejection sampler, number for number. A fixed candidate may depend on the draft's
    drawn tokens (a runner-up to the first): whatever they were, the step after their rejection
    gives exactly the residual, which is all the draft's step needs."""
    vocab = p.vocab
    out, node = [], -1
    while True:
        depth = len(out)
        residual = p[node + 1]
        for j, child in enumerate(c for c in range(node + 1, len(tree)) if tree.parents[c] == node):
            x = tree.tokens[child]
            q = np.zeros(vocab, dtype=np.float64)
            if child < drafted:  # the draft's own token (a node on the draft path has it first)
                idx = np.asarray(q_idx[depth], dtype=np.int64)
                inside = idx < vocab  # a draft with a padded vocabulary may propose ids the target lacks
                q[idx[inside]] = normalize_proposal(q_prob[depth])[inside]
                stream = STREAM_ACCEPT
            else:  # a fixed token: its q is a point
                if x < vocab:
                    q[x] = 1.0
                stream = STREAM_FUSED + j
            rx = residual[x] if x < vocab else 0.0
            if uniform(seed, position + depth, stream) * q[x if x < vocab else 0] < rx:
                out.append(x)
                node = child
                break
            rest = np.maximum(residual - q, 0.0)
            if rest.sum() <= 0:  # r == q up to rounding: any sample from r is exact
                rest = residual
            residual = rest / rest.sum()
        else:  # every candidate rejected (or a leaf: the bonus token)
            out.append(sample_index(residual, uniform(seed, position + depth, STREAM_RESAMPLE)))
            return out
