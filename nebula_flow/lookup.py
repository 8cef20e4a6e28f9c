"""Prompt lookup: what followed an earlier occurrence of a context's last n tokens. The n-gram
drafter (``workers/ngram.py``, a ``--model`` of ``ngram[:MAX or :MIN-MAX]``) proposes it alone;
a model drafter fuses it into its own rounds as a second chain of the round's token tree
(``fuse_ngram``)."""

from __future__ import annotations

import re

import numpy as np


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int, alts: int = 0) -> tuple[list[int], list[int]]:
    """(draft, alternatives): up to k tokens that followed an earlier occurrence of the last n
    tokens (the longest n that occurs; the latest occurrence with k tokens after it, else the
    earliest, which has the most), and up to ``alts`` other tokens that followed other occurrences
    (the latest first): runner-ups to the draft's first token. ([], []) when none occurs."""
    length = len(tokens)
    if length < 2:
        return [], []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = occurrences(tokens, n, ends)
        if len(hits):
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            draft = tokens[start:start + k].tolist()
            others = dict.fromkeys(int(t) for t in tokens[hits[::-1] + n] if t != draft[0]) if alts else {}
            return draft, list(others)[:alts]
    return [], []


PREDICTION_MAX_N = 16  # the longest context matched in a prediction: a file's repeated lines need a long one
MAX_SKIP, RESYNC_N = 2, 4  # a prediction is taken up again past this many replaced tokens, after a context this long


def lookup_with(tokens: np.ndarray, prediction: np.ndarray | None, k: int, min_n: int, max_n: int,
                alts: int = 0) -> tuple[list[int], list[int]]:
    """``lookup``, but first in the client's ``prediction`` of the output (Predicted Outputs),
    where it gave one: the tokens that follow the context's last n there (``predicted``)."""
    if prediction is not None and len(prediction):
        draft = predicted(tokens, prediction, k, min_n)
        if draft:
            return draft, []
    return lookup(tokens, k, min_n, max_n, alts)


def predicted(tokens: np.ndarray, prediction: np.ndarray, k: int, min_n: int) -> list[int]:
    """Up to k tokens of ``prediction`` that follow an occurrence there of the last n tokens of
    ``tokens`` (the longest n up to ``PREDICTION_MAX_N`` that occurs; its first occurrence with
    tokens after it: a prediction is read from its start as the output grows), or [].

    Where the output has just replaced a token or two of the prediction, its last tokens occur
    nowhere there; the context before them (at least ``RESYNC_N`` tokens) is looked up instead and
    the prediction is taken up as many tokens after it: after a substitution the chains go on at
    once instead of waiting for n new tokens that match."""
    for skip in range(MAX_SKIP + 1):
        context = tokens[:len(tokens) - skip]
        fewest = min_n if skip == 0 else max(min_n, RESYNC_N)
        most = min(PREDICTION_MAX_N, len(context))
        if most < fewest or len(prediction) < 2 + skip:
            return []
        corpus = np.concatenate([prediction, context[-most:]])  # (the context's tail last, as ``occurrences`` wants)
        ends = np.flatnonzero(prediction[:-1 - skip] == context[-1])  # (a window must end inside the prediction, before its end)
        for n in range(most, fewest - 1, -1):
            hits = occurrences(corpus, n, ends)
            if len(hits):
                start = int(hits[0]) + n + skip
                return prediction[start:start + k].tolist()
    return []


def occurrences(tokens: np.ndarray, n: int, ends: np.ndarray) -> np.ndarray:
    """The starts s (0 .. len - 1 - n, in order) of the earlier windows ``tokens[s:s + n]`` equal
    to the last n tokens. ``ends``: where the last token occurs before its own place, the only
    places such a window can end (comparing every window of every n instead cost 20-57 us warm
    at 150-2,000 tokens, against ~11, on the critical path of each round that fuses a chain)."""
    hits = ends[ends >= n - 1] - (n - 1)
    for j in range(n - 1):
        hits = hits[tokens[hits + j] == tokens[len(tokens) - n + j]]
    return hits


NGRAM_SPEC = re.compile(r"ngram(?::(?:(\d+)-)?(\d+))?")
DEFAULT_MIN_N, DEFAULT_MAX_N = 2, 4  # (a single repeated token is a weak hint in prose)


def is_ngram(spec: str) -> bool:
    """Whether a model spec names the n-gram drafter (not a checkpoint to load or resolve)."""
    return NGRAM_SPEC.fullmatch(spec) is not None


def parse_ngram(spec: str) -> tuple[int, int] | None:
    """(min_n, max_n) for a ``--model`` of ``ngram``, ``ngram:MAX`` or ``ngram:MIN-MAX``; None
    when ``spec`` names something else (a checkpoint)."""
    m = NGRAM_SPEC.fullmatch(spec)
    if m is None:
        return None
    max_n = int(m.group(2)) if m.group(2) else DEFAULT_MAX_N
    min_n = int(m.group(1)) if m.group(1) else min(DEFAULT_MIN_N, max_n)
    if not 1 <= min_n <= max_n <= 16:
        raise ValueError(f"{spec}: n-gram sizes must satisfy 1 <= MIN <= MAX <= 16")
    return min_n, max_n
