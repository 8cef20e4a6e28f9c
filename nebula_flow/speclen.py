"""Adaptive speculation length: each round's k from the request's recent acceptance. Pure.

A round proposing k tokens commits 1 + (accepted drafts) tokens. If each draft token is accepted
with probability a (given the ones before it were), a round commits on average
``1 + a + a^2 + ... + a^k`` tokens, and costs, in target decode steps,
``round + k * (draft_step + verify_row)``: the fixed cost of a verify round (its forward and the
messages), plus per draft token one draft forward and one more verify row. The policy picks the
k in 0..k_max with the most tokens per cost; k = 0 is plain decoding (no draft task at all).

The acceptance a of a request is estimated from its own rounds: a round that accepted m of k
drafts shows m acceptances and, if m < k, one rejection (the geometric model behind the
formula). Counts decay by ``DECAY`` per round, so a request moving from boilerplate into novel
text (or back) changes k within a few rounds; a prior of one acceptance and one rejection
starts every request at a = 0.5, and rounds without drafts relax the counts back toward it.

Default costs (``DEFAULT_COSTS``) are the bundled pair's, measured on a 2-core CPU in bf16 with
packed weights: a draft step 2.3 ms and a verify row ~0.95 ms against a 31.7 ms decode step,
~4 ms of messages per round. (Before packing: 2.6, 2.6 and 48.5 ms; the choices of k were the
same.) On a GPU a verify row is nearly free and a draft step is cheaper: set ``spec_costs``.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.7  # weight of a round's evidence one round later
RELAX = 0.9  # per round without drafts, the counts move this slowly back toward the prior
PRIOR = (1.0, 1.0)  # (acceptances, rejections) every request starts with
DEFAULT_COSTS = (0.073, 0.03, 1.1)  # draft step, verify row, round: in target decode steps


@dataclass
class Acceptance:
    """Decayed counts of a request's draft acceptances and rejections."""

    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, proposed: int, accepted: int) -> None:
        """Record a verified round that proposed ``proposed`` drafts and accepted ``accepted``.
        A round without drafts shows nothing: the counts relax toward the prior instead, so a
        request that dropped to k = 0 probes with drafts again a few rounds later."""
        if proposed <= 0:
            self.accepted = self.accepted * RELAX + PRIOR[0] * (1 - RELAX)
            self.rejected = self.rejected * RELAX + PRIOR[1] * (1 - RELAX)
            return
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + (1.0 if accepted < proposed else 0.0)


def expected_tokens(rate: float, k: int) -> float:
    """Mean tokens a round commits with k drafts, each accepted with probability ``rate``."""
    return sum(rate ** i for i in range(k + 1))


def choose_k(acc: Acceptance, k_max: int, costs: tuple[float, float, float] = DEFAULT_COSTS) -> int:
    """The k in 0..k_max with the most expected tokens per unit of cost."""
    draft_step, verify_row, round_cost = costs
    rate = acc.rate
    return max(range(k_max + 1),
               key=lambda k: (expected_tokens(rate, k) / (round_cost + k * (draft_step + verify_row)), -k))
