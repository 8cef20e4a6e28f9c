"""Multi-step decoding: a draft-less verify that decodes several tokens in one task (pure; the
broker and the simulator share it).

In ``autoregressive`` mode a round is one target forward, and around it the pipeline pays the
hops to the worker and back, the broker's handling and the worker's handoffs: on the bundled pair
on a 2-core CPU ~2.8 ms a token beside a ~27 ms forward. For a request alone in its broker's
pool, the round's verify decodes up to the policy's ``decode_steps`` tokens, one forward each,
feeding each pick to the next (as vLLM's multi-step scheduling), so that overhead is paid once
for them. Each token is exactly the one a round of its own would commit: a greedy pick, or a
sample drawn with ``specdec.uniform(seed, position, ...)``, which depends on its position alone.

Only alone: with other requests in the pool, a request arriving while a batch decodes waits for
its steps, and a request that ends at the first of them leaves its place in the batch idle for
the rest. At 16 concurrent requests on the bundled pair stepping by 4 cost 8 % of the tokens/s
and tripled the median time to the first token (docs/benchmarks.md, "Multi-step decoding"),
where two workers' rounds already fill each other's gaps. A request's first round decodes one
token: it carries the prefill, and the first token streams at once. A request whose rows follow
per-token rules the broker keeps (penalties, min_tokens, a grammar) or that asks for
log-probabilities decodes one token a round. The worker may decode a few tokens past a stop
string (the broker cuts them, as it cuts a round's). Speculative modes never step: their policy
replans each round from the last one's outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nebula_flow.budget import alone
from nebula_flow.params import SamplingParams
from nebula_flow.request import DRAFT, Request

if TYPE_CHECKING:
    from nebula_flow.scheduler import Scheduler


def possible(most: int, mode: str) -> bool:
    """Whether ``mode`` under the policy's ``decode_steps`` (``most``) ever decodes several tokens a round."""
    return most > 1 and mode == "autoregressive"


def decode_steps(most: int, mode: str, pool: int, remaining: int, params: SamplingParams, first: bool = False) -> int:
    """The tokens a draft-less verify decodes, sent while its broker's pool holds ``pool``
    requests (itself included), for a request with ``remaining`` tokens to go and ``params``;
    ``most``: the policy's ``decode_steps`` (1: one token a round); ``first``: the request's
    first round, which carries its prefill (one token, streamed at once)."""
    if not possible(most, mode) or not alone(pool) or first or remaining <= 1 or params.penalized \
            or params.logprobs is not None:
        return 1
    return min(most, remaining)


def assign(scheduler: Scheduler, batch: list[Request]) -> None:
    """Set ``steps`` on the draft-less verifies of a batch being sent (the broker's and the
    simulator's dispatch). Where the mode or the knob never steps, ``start_round``'s 1 stands:
    nothing is done per task on the broker's hot path."""
    if not possible(scheduler.policy.decode_steps, scheduler.mode):
        return
    for req in batch:
        if not req.draft and req.phase != DRAFT:
            req.steps = decode_steps(scheduler.policy.decode_steps, scheduler.mode, len(scheduler.requests),
                                     req.remaining, req.params, not req.output)
