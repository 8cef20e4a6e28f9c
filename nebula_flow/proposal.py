"""A draft's proposal q as it travels in tasks and results (``protocol.TaskSpec``,
``protocol.TaskResult``): the fields' checks and their conversions."""

from __future__ import annotations

import numpy as np

from nebula_flow.wire import malformed


class Proposes:
    """A draft's proposal q for a sampled request, as fields of a task or result: per draft
    position, the token ids and probabilities it drew from (``q_len`` entries each), flat in two
    tensors. ``q_len`` is absent for a greedy draft. (Its users declare ``draft``, ``q_idx``,
    ``q_prob`` and ``q_len`` as fields.)"""

    def check_proposal(self) -> None:
        if self.q_len is None:
            return
        idx, prob, lens = self.q_idx, self.q_prob, self.q_len
        if (idx is None or prob is None or not all(n > 0 for n in lens) or idx.ndim != 1 or idx.shape != prob.shape
                or sum(lens) != len(idx) or idx.dtype != np.int32 or prob.dtype != np.float32
                or len(lens) != len(self.draft)):
            raise malformed("proposal q does not match the draft")
        n = len(lens)
        if n == 0:
            return
        # (array methods, all positions at once: a loop over positions, and np.all / np.any
        # themselves, cost about twice as much, at every hop of every sampled round; figures in
        # docs/benchmarks.md, "Checking a proposal")
        if not np.isfinite(prob).all() or prob.min() < 0 or idx.min() < 0:
            raise malformed("proposal q has invalid entries")
        starts = np.zeros(n, dtype=np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        if not (np.add.reduceat(prob, starts) > 0).all():
            raise malformed("proposal q has a position with no probability mass")
        position = np.repeat(np.arange(n), lens)
        # (a token outside its own proposal has q(x) = 0, which the verifier would always accept)
        own = (idx == np.asarray(self.draft, dtype=np.int64)[position]) & (prob > 0)
        if np.count_nonzero(np.bincount(position[own], minlength=n)) != n:
            raise malformed("a draft token is outside its own proposal q")
        keys = np.sort(position * (int(idx.max()) + 1) + idx)
        if (keys[1:] == keys[:-1]).any():
            raise malformed("proposal q repeats a token id")

    def proposal(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One (ids, probabilities) pair per draft position (views of the frames); empty lists for a
        greedy draft."""
        if not self.q_len:
            return [], []
        cuts = np.cumsum(self.q_len)[:-1]
        return np.split(self.q_idx, cuts), np.split(self.q_prob, cuts)

    def propose(self, idx: list[np.ndarray] | None, prob: list[np.ndarray] | None) -> None:
        """Set the proposal from per-position arrays (None: a greedy draft, no proposal)."""
        if idx is None:
            self.q_idx = self.q_prob = self.q_len = None
            return
        self.q_len = [len(a) for a in idx]
        self.q_idx = np.concatenate(idx).astype(np.int32) if idx else np.zeros(0, np.int32)
        self.q_prob = np.concatenate(prob).astype(np.float32) if prob else np.zeros(0, np.float32)
