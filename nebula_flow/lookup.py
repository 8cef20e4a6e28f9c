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


ANCHOR = 8  # ``matched`` takes the prediction up again where the output's next this many tokens occur in it


def matched(prediction: np.ndarray, output: list[int]) -> int:
    """How many of a prediction's tokens the output holds, in order (usage's accepted prediction
    tokens): runs where the two agree, read left to right; where they part, past up to ``MAX_SKIP``
    replaced tokens (as ``predicted`` takes the prediction up again), else at the output's next
    place whose ``ANCHOR`` tokens occur in the prediction (the first occurrence not before where
    it was). Vectorized but for the places where the two part: the broker counts it on its thread as
    a request ends, where difflib's exact matching blocks grow with the product of the lengths."""
    pred, out = np.asarray(prediction, dtype=np.int64), np.asarray(output, dtype=np.int64)
    pred_keys, out_keys = _window_keys(pred), _window_keys(out)
    order = np.argsort(pred_keys, kind="stable")
    sorted_keys = pred_keys[order]
    anchorable = np.flatnonzero(np.isin(out_keys, pred_keys))  # (output places whose window may occur in the prediction)
    held = p = i = 0
    while i < len(out):
        if p < len(pred) and out[i] == pred[p]:
            span = min(len(out) - i, len(pred) - p)
            differ = np.flatnonzero(out[i:i + span] != pred[p:p + span])
            run = int(differ[0]) if len(differ) else span
            held, i, p = held + run, i + run, p + run
            continue
        if sub := next((s for s in range(1, MAX_SKIP + 1) if _agree(out, pred, i + s, p + s, RESYNC_N)), 0):  # replaced
            i, p = i + sub, p + sub
            continue
        i, p = _anchor(out, pred, out_keys, sorted_keys, order, anchorable, i, p)
    return held


def _window_keys(tokens: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each ``ANCHOR``-token window of ``tokens`` (in order; none if shorter)."""
    if len(tokens) < ANCHOR:
        return np.empty(0, dtype=np.uint64)
    keys = np.zeros(len(tokens) - ANCHOR + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):  # (the hash wraps modulo 2**64)
        for t in range(ANCHOR):
            keys = keys * np.uint64(1_000_003) + tokens[t:len(tokens) - ANCHOR + 1 + t].astype(np.uint64)
    return keys


def _anchor(out: np.ndarray, pred: np.ndarray, out_keys: np.ndarray, sorted_keys: np.ndarray, order: np.ndarray,
            anchorable: np.ndarray, i: int, p: int) -> tuple[int, int]:
    """The next (output place, prediction place) at or after (i, p) whose windows are equal;
    (the output's end, p) where there is none."""
    for j in anchorable[np.searchsorted(anchorable, i):].tolist():
        lo, hi = np.searchsorted(sorted_keys, out_keys[j], "left"), np.searchsorted(sorted_keys, out_keys[j], "right")
        for c in np.sort(order[lo:hi]).tolist():
            if c >= p and _agree(out, pred, j, c, ANCHOR):  # (checked: hashes may collide)
                return j, c
    return len(out), p


def _agree(out: np.ndarray, pred: np.ndarray, i: int, p: int, most: int) -> bool:
    """Whether the output from ``i`` and the prediction from ``p`` agree on their next ``most``
    tokens (as many as both hold, at least one)."""
    span = min(most, len(out) - i, len(pred) - p)
    return span > 0 and bool((out[i:i + span] == pred[p:p + span]).all())


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
