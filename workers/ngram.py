"""A prompt-lookup (n-gram) drafter: no model and no KV. It proposes the tokens that followed the
latest earlier occurrence of the request's last n tokens in its own context (prompt and output),
trying n from ``max_n`` down to ``min_n``. It costs microseconds per draft and is right where the
output repeats its context (code edits, quoting, summaries, structured output) and useless
elsewhere, which is why it runs beside a model drafter and routing (``nebula_flow/routing.py``)
sends each request's rounds to whichever of them pays for that request.

Without a match it proposes nothing (an empty draft: the round is plain decoding). Its proposals
are exact points, so a sampled request's q is one-hot: the target accepts the token with its own
probability of it and otherwise samples from its distribution without it (still exact).
"""

from __future__ import annotations

import time

import numpy as np

from nebula_flow.lookup import DEFAULT_MAX_N, DEFAULT_MIN_N, lookup_with
from nebula_flow.speclen import StepCosts
from nebula_flow_workers.runner import Draft, Task


class NgramRunner:
    """The draft side of ``ModelRunner`` for the n-gram drafter (``model`` and ``store``: None)."""

    model = None
    store = None

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.proposal_top_k = 1
        self.busy_s = 0.0
        self.forwards = 0
        self.step_costs = StepCosts()  # (a "step": one request's lookup; the policy sees it as ~free)

    def draft(self, tasks: list[Task], ends: list[int | None] | None = None) -> list[Draft]:
        """Look up each task's chain (no KV: no prefill to chunk, so ``ends`` changes nothing)."""
        out = []
        for t in tasks:
            t0 = time.perf_counter()
            tokens, runner_ups = lookup_with(np.asarray(t.tokens), t.prediction, t.k, self.min_n, self.max_n, t.alts) if t.k > 0 else ([], [])
            took = time.perf_counter() - t0
            self.busy_s += took
            self.forwards += 1
            self.step_costs.observe(1, took / max(1, len(tokens)))
            if t.params.greedy:
                out.append(Draft(tokens, None, None, runner_ups))
            else:
                out.append(Draft(tokens, [np.array([x], dtype=np.int32) for x in tokens],
                                 [np.ones(1, dtype=np.float32) for _ in tokens], runner_ups))
        return out

    def predraft(self, tasks: list[Task]) -> list[list[tuple[list[int], Draft]]]:
        """Nothing to pre-draft (draft-ahead): a lookup takes microseconds when its round comes."""
        return [[] for _ in tasks]
