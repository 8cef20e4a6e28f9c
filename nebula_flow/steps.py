"""Multi-step decoding: a draft-less verify that decodes several tokens in one task (pure; the
broker and the simulator share it).

In ``autoregressive`` mode a round is one target forward, and around it the pipeline pays the
hops to the worker and back, the broker's handling and the worker's handoffs: on the bundled pair
on a 2-core CPU ~2.8 ms a token beside a ~28 ms forward. When no other task waits for a worker,
the round's verify decodes up to the policy's ``decode_steps`` tokens, one forward each, feeding
each pick to the next (vLLM's multi-step scheduling), so that overhead is paid once for them.
Each token is exactly the one a round of its own would commit: a greedy pick, or a sample drawn
with ``specdec.uniform(seed, position, ...)``, which depends on its position alone.

A request's first round decodes one token: it carries the prefill, and the first token streams
at once. The price: a request that arrives meanwhile waits for up to ``decode_steps`` forwards before its
prefill, and the worker may decode a few tokens past a stop string (the broker cuts them, as it
cuts a round's). A request whose rows follow per-token rules the broker keeps (penalties,
min_tokens, a grammar) or that asks for log-probabilities decodes one token a round. Speculative
modes never do this: their policy replans each round from the last one's outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nebula_flow.params import SamplingParams
from nebula_flow.request import DRAFT, Request

if TYPE_CHECKING:
    from nebula_flow.scheduler import Scheduler


def possible(most: int, mode: str) -> bool:
    """Whether a deployment of ``mode`` under the policy's ``decode_steps`` (``most``) ever decodes
    several tokens a round (the broker looks at its queues only then)."""
    return most > 1 and mode == "autoregressive"


def decode_steps(most: int, mode: str, waiting: int, remaining: int, params: SamplingParams, first: bool = False) -> int:
    """The tokens a draft-less verify decodes, sent when ``waiting`` other tasks wait for a worker
    of its stage, for a request with ``remaining`` tokens to go and ``params``; ``most``: the
    policy's ``decode_steps`` (1: one token a round). ``first``: the request's first round, which
    carries its prefill: one token, streamed at once (decoding on delayed the first token by the
    steps' forwards: 56 -> 141 ms single stream on the bundled pair)."""
    if not possible(most, mode) or waiting or first or remaining <= 1 or params.penalized or params.logprobs is not None:
        return 1
    return min(most, remaining)


def assign(scheduler: Scheduler, batch: list[Request]) -> None:
    """Set ``steps`` on the draft-less verifies of a batch being sent (the broker's and the
    simulator's dispatch, after the batch left its topic: what still waits is what waits)."""
    most = scheduler.policy.decode_steps
    if not possible(most, scheduler.mode):
        return
    waiting = sum(scheduler.depth().values())
    for req in batch:
        if not req.draft and req.phase != DRAFT:
            req.steps = decode_steps(most, scheduler.mode, waiting, req.remaining, req.params, not req.output)
