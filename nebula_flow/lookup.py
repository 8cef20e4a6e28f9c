"""Prompt lookup: what followed an earlier occurrence of a context's last n tokens. The n-gram
drafter (``workers/ngram.py``) proposes it alone; a model drafter fuses it into its own rounds
as a second chain of the round's token tree (``--fuse-ngram``)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int, alts: int = 0) -> tuple[list[int], list[int]]:
    """(draft, alternatives): up to k tokens that followed an earlier occurrence of the last n
    tokens (the longest n that occurs; the latest occurrence with k tokens after it, else the
    earliest, which has the most), and up to ``alts`` other tokens that followed other occurrences
    (the latest first): runner-ups to the draft's first token. ([], []) when none occurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length-1-n: every earlier place the last n tokens could be
        hits = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[length - n:]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            draft = tokens[start:start + k].tolist()
            others = dict.fromkeys(int(t) for t in tokens[hits[::-1] + n] if t != draft[0]) if alts else {}
            return draft, list(others)[:alts]
    return [], []
