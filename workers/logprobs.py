"""The log-probabilities a verify reports for the tokens it committed (``SamplingParams.logprobs``)
and for the prompt's tokens it scored (``SamplingParams.prompt_logprobs``).

Each committed token was predicted by one row of the verify's logits: the first by the row of the
last committed token, each later one by the row of the tree node before it on the accepted path.
Its log-probability is that row's log-softmax at the token, from the raw logits (before
temperature, top-k and top-p: the model's own distribution, what vLLM reports by default), so it
is the same whether the token was drafted and accepted or produced by the target itself, and the
same as autoregressive decoding reports. Beside it, the row's ``top`` most likely tokens.
"""

from __future__ import annotations

import numpy as np
import torch

FLOOR = -9999.0  # a token the model rules out (-inf) is reported at this (as vLLM's API does): JSON has no -inf


def committed_logprobs(logits: torch.Tensor, path: list[int], committed: list[int], top: int) -> tuple[np.ndarray, np.ndarray]:
    """``(logprobs [n, 1 + top] float32, ids [n, top] int32)`` for the ``n`` committed tokens:
    column 0 each token's own log-probability, then the ``top`` most likely tokens' (most likely
    first) and their ids. ``logits``: the verify's rows of one sequence (row 0: the last committed
    token's; row 1 + p: tree node p's); ``path``: the accepted path's nodes (``TokenTree.path``).
    A target's logit columns are token ids (only a draft may have a reduced head)."""
    rows = torch.tensor([0, *(1 + p for p in path)][:len(committed)], dtype=torch.long, device=logits.device)
    return scored(logits.index_select(0, rows), committed, top)


def scored(logits: torch.Tensor, tokens: list[int] | np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """``(logprobs [n, 1 + top] float32, ids [n, top] int32)`` of ``tokens`` (n), token i as row i of
    ``logits`` predicted it (a verify's committed tokens; a prompt's, ``prompt_scores``): column 0 its
    own log-probability, then the ``top`` most likely tokens' (most likely first)."""
    return _scored(logits.float(), tokens, top)


def prompt_scores(logits: torch.Tensor, tokens: list[int] | np.ndarray, top: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``scored``'s, and each token's rank in its row (int32; 1: the most likely; the logits above
    the token's, plus one, so ties share the better rank): vLLM reports it with each prompt token's
    log-probability, among the top ones or not (``SamplingParams.prompt_logprobs``)."""
    rows = logits.float()
    values, ids = _scored(rows, tokens, top)
    chosen = rows.gather(1, torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=rows.device)[:, None])
    if rows.device.type == "cpu":  # (numpy a row at a time: a [rows, vocab] comparison at once took ~10x as long)
        ranks = np.array([np.count_nonzero(r > c) + 1 for r, c in zip(rows.numpy(), chosen[:, 0].tolist())], np.int32)
    else:
        ranks = ((rows > chosen).sum(dim=-1) + 1).cpu().numpy().astype(np.int32)
    return values, ids, ranks


def _scored(logits: torch.Tensor, tokens: list[int] | np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    # (log-softmax is the logit less the row's log-sum-exp: taken only where it is reported, the
    # rows are read twice and nothing of their size is written: a prompt's are thousands of rows)
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = logits.gather(1, torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=logits.device)[:, None])
    best = torch.topk(logits, top, dim=-1) if top else None
    values = (torch.cat([chosen, best.values], dim=1) if best is not None else chosen).sub_(norm).clamp_min_(FLOOR)
    ids = best.indices if best is not None else torch.zeros((len(tokens), 0), dtype=torch.long, device=logits.device)
    return values.cpu().numpy().astype(np.float32), ids.cpu().numpy().astype(np.int32)
