"""Adaptive speculation length: each round's k (and token-tree width) from the request's recent
acceptance and the measured cost of each. Pure.

A round proposing k tokens commits 1 + (accepted drafts) tokens. If each draft token is accepted
with probability a (given the ones before it were), a round commits on average
``1 + a + a^2 + ... + a^k`` tokens, and costs, in target decode steps,
``round + k * (draft_step + verify_row)``: the fixed cost of a verify round (its forward and the
messages), plus per draft token one draft forward and one more verify row (or, measured, the
verify block of k + 1 rows itself in place of ``1 + k * verify_row``). The policy picks the
k in 0..k_max with the most tokens per cost; k = 0 is plain decoding (no draft task at all).

The acceptance a of a request is estimated from its own rounds: a round that accepted m of k
drafts shows m acceptances and, if m < k, one rejection (the geometric model behind the
formula). Counts decay by ``DECAY`` per round, so a request moving from boilerplate into novel
text (or back) changes k within a few rounds; a prior of one acceptance and one rejection
starts every request at a = 0.5, and rounds without drafts relax the counts back toward it.

Default costs (``DEFAULT_COSTS``) are the bundled pair's, measured on a 2-core CPU with AMX in
bf16 with packed weights: a draft step 2.3 ms and a verify row ~0.95 ms against a 31.7 ms decode
step, ~4 ms of messages per round. They are only where a deployment starts: the costs depend on
the hardware more than on the models. The same pair in fp32 on a CPU without native bf16: a draft
step 1.8 ms against a 47 ms decode step, and (on MKL's plain kernels) a verify block of 1-3 rows
48-55 ms but of 4 rows 82 ms: CPU kernels cost in steps of rows, not per row. So workers time their own forwards by
rows (``StepCosts``) and the policy weighs a round with those times (``measured_costs``): the
draft step, and the verify block of each size, in decode steps.

A token tree (``alts`` runner-ups to the first draft token verified beside the chain) pays off
only when the first draft token is rejected (probability ``1 - a``) and a runner-up is the
target's token (the request's ``alt_rate``, counted like its acceptance); it costs ``alts``
verify rows. ``choose_round`` weighs that against the chain alone.

A fused prompt-lookup chain (``fuse_pays``) is verified only in rounds where the context has a
match, and adds the tokens it wins beyond the draft (the request's ``fused_gain``: decayed mean
tokens won per round that verified one) at the cost of its rows. It pays when that gain per cost
beats the round's own tokens per cost; under load, when the chain's rows lengthen a verify
batched with other requests' rows, it must pay for the whole batch. ``choose_fuse`` takes the
longest chain that pays among the most and its halvings. Its prior is hopeful (``FUSED_PRIOR``),
so every request tries it, and rounds without it relax back toward the prior, so a request
looks again later.

Under draft-ahead (``nebula_flow/ahead.py``) a round whose draft a pre-draft made waits for none
of its draft steps: they ran while the round before verified. So a request's rounds count how
often that happened (``ahead_rate``, decayed like its acceptance, starting at none) and its k is
planned with a draft step costing only the rest of the time (``hiding``): where most rounds hit,
a longer draft costs verify rows alone, and the policy picks it.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.7  # weight of a round's evidence one round later
RELAX = 0.9  # per round without drafts, the counts move this slowly back toward the prior
PRIOR = (1.0, 1.0)  # (acceptances, rejections) every request starts with
FUSED_PRIOR = (2.0, 1.0)  # (tokens won, rounds) of a fused chain every request starts with
# (rounds whose draft a pre-draft was, rounds drafted on the critical path) every request starts with
# under draft-ahead: none hidden until its own rounds show hits (``hiding``)
AHEAD_PRIOR = (0.0, 1.0)
DEFAULT_COSTS = (0.073, 0.03, 1.1)  # draft step, verify row, round: in target decode steps
# A request whose plan is no draft still drafts (k = 1) every this many rounds: the measured costs
# that ruled drafting out are refreshed only by drafts (as a routed look at a drafter that would
# draft nothing drafts one token). (A deployment's first draft forwards on a
# CPU took 14-34 ms against ~3 ms later, and with no draft after them the policy kept k = 0 for
# good: pooled on the bundled pair ran at ~41 tokens/s instead of ~52 in 2 of 5 starts.)
RECHECK_EVERY = 16
FIT_ROWS = 16  # forwards of more new rows (prefills) do not inform a round's costs
FIT_WEIGHT = 0.2  # the newest forward's weight in its row count's moving mean


@dataclass
class Acceptance:
    """Decayed counts of a request's draft acceptances and rejections."""

    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    # rounds whose first draft token was rejected while runner-ups were verified: one won / none did
    alt_won: float = PRIOR[0]
    alt_lost: float = PRIOR[1]
    # rounds that verified a fused prompt-lookup chain: the tokens it won beyond the draft, rounds
    fused_won: float = FUSED_PRIOR[0]
    fused_rounds: float = FUSED_PRIOR[1]
    # draft-ahead: rounds whose draft was pre-drafted while the round before verified / drafted after it
    ahead_hits: float = AHEAD_PRIOR[0]
    ahead_misses: float = AHEAD_PRIOR[1]

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def alt_rate(self) -> float:
        """How often a runner-up was the target's token when the first draft token was not."""
        return self.alt_won / (self.alt_won + self.alt_lost)

    @property
    def fused_gain(self) -> float:
        """Mean tokens a fused chain won beyond the draft, in rounds that verified one."""
        return self.fused_won / self.fused_rounds

    @property
    def ahead_rate(self) -> float:
        """How often a round's draft was pre-drafted (draft-ahead): off the critical path."""
        return self.ahead_hits / (self.ahead_hits + self.ahead_misses)

    def update_ahead(self, hit: bool) -> None:
        """Record a drafted round under draft-ahead: its draft was a pre-draft's, or made after the verify."""
        self.ahead_hits = self.ahead_hits * DECAY + hit
        self.ahead_misses = self.ahead_misses * DECAY + (not hit)

    def update_fused(self, won: int | None) -> None:
        """Record a round's fused chain: ``won`` tokens beyond the draft, or None when the round
        verified none (then the counts relax toward the prior, as ``update``'s do)."""
        if won is None:
            self.fused_won = self.fused_won * RELAX + FUSED_PRIOR[0] * (1 - RELAX)
            self.fused_rounds = self.fused_rounds * RELAX + FUSED_PRIOR[1] * (1 - RELAX)
            return
        self.fused_won = self.fused_won * DECAY + won
        self.fused_rounds = self.fused_rounds * DECAY + 1

    def update_alternatives(self, alts: int, chain_accepted: int, via_alt: bool) -> None:
        """Record a verified round that had ``alts`` runner-ups to its first draft token: evidence
        only when that token was rejected (``chain_accepted`` 0)."""
        if alts > 0 and chain_accepted == 0:
            self.alt_won = self.alt_won * DECAY + via_alt
            self.alt_lost = self.alt_lost * DECAY + (not via_alt)

    def update(self, proposed: int, accepted: int, decay: float = DECAY) -> None:
        """Record a verified round that proposed ``proposed`` drafts and accepted ``accepted``.
        A round without drafts shows nothing: the counts relax toward the prior instead, so a
        request that dropped to k = 0 probes with drafts again a few rounds later. ``decay``: a
        pool's experience of a drafter (``routing``) remembers many more rounds than a request's."""
        if proposed <= 0:
            self.accepted = self.accepted * RELAX + PRIOR[0] * (1 - RELAX)
            self.rejected = self.rejected * RELAX + PRIOR[1] * (1 - RELAX)
            return
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1.0 if accepted < proposed else 0.0)


def hiding(costs: tuple[float, float, float], hidden: float) -> tuple[float, float, float]:
    """``costs`` with a draft step on a round's critical path ``1 - hidden`` of the time: under
    draft-ahead a round whose draft was pre-drafted while the round before verified waits for none
    of its draft steps (SwiftSpec), so the longer draft such rounds can afford is weighed as such."""
    draft_step, verify_row, round_cost = costs
    return draft_step * (1.0 - hidden), verify_row, round_cost


def expected_tokens(rate: float, k: int) -> float:
    """Mean tokens a round commits with k drafts, each accepted with probability ``rate``."""
    return sum(rate ** i for i in range(k + 1))


def choose_k(acc: Acceptance, k_max: int, costs: tuple[float, float, float] = DEFAULT_COSTS) -> int:
    """The k in 0..k_max with the most expected tokens per unit of cost."""
    return choose_round(acc, k_max, costs)[0]


def choose_round(acc: Acceptance, k_max: int, costs: tuple[float, float, float] = DEFAULT_COSTS,
                 max_alts: int = 0, verify: tuple[float | None, ...] = ()) -> tuple[int, int]:
    """(k, alts): the k in 0..k_max, and 0 or ``max_alts`` runner-ups to the first draft token
    (a token tree; only with k > 0), with the most expected tokens per unit of cost. Ties go to
    the smaller k, then to no runner-ups.

    ``verify[r - 1]``: a verify forward of r rows in decode steps, where measured (``StepCosts``);
    CPU kernels cost in steps, not per row (measured in fp32, MKL: 48 ms for 1-3 rows, 82 ms for 4-6),
    so a row that crosses a step costs far more than the mean. Elsewhere ``1 + (r - 1) * verify_row``."""
    return best_round(acc, k_max, costs, max_alts, verify)[1:]


def best_round(acc: Acceptance, k_max: int, costs: tuple[float, float, float] = DEFAULT_COSTS,
               max_alts: int = 0, verify: tuple[float | None, ...] = ()) -> tuple[float, int, int]:
    """``choose_round``'s choice with its worth: (expected tokens per decode step, k, alts). The
    worth is what routing among drafters compares (``nebula_flow.routing``)."""
    choices = [(k, alts) for k in range(k_max + 1) for alts in sorted({0, max_alts if k > 0 else 0})]
    worth, k, alts = max((round_worth(acc, k, alts, costs, verify), -k, -alts) for k, alts in choices)
    return worth, -k, -alts


def round_worth(acc: Acceptance, k: int, alts: int, costs: tuple[float, float, float] = DEFAULT_COSTS,
                verify: tuple[float | None, ...] = (), fused: int = 0) -> float:
    """Expected tokens per decode step of a round of k drafts, ``alts`` runner-ups and a fused
    chain of ``fused`` tokens (see ``choose_round`` for ``verify``)."""
    draft_step, _, round_cost = costs
    tokens = expected_tokens(acc.rate, k) + ((1 - acc.rate) * acc.alt_rate if alts else 0.0)
    tokens += min(acc.fused_gain, fused) if fused else 0.0  # (a chain wins at most its length)
    return tokens / (round_cost - 1 + verify_cost(1 + k + alts + fused, costs, verify) + k * draft_step)


def verify_cost(rows: int, costs: tuple[float, float, float] = DEFAULT_COSTS, verify: tuple[float | None, ...] = ()) -> float:
    """A verify forward of ``rows`` rows in decode steps: measured where known, else ``1 + (rows - 1) *
    verify_row``."""
    known = verify[rows - 1] if rows <= len(verify) else None
    return known if known is not None else 1 + (rows - 1) * costs[1]


def fuse_pays(acc: Acceptance, k: int, alts: int, fused: int, costs: tuple[float, float, float] = DEFAULT_COSTS,
              verify: tuple[float | None, ...] = (), batch: int = 1) -> bool:
    """Whether a round of k drafts (0: none, the chain alone) and ``alts`` runner-ups gets more
    tokens per cost with a fused chain of ``fused`` tokens beside it than without (in the rounds
    that find one).

    ``batch`` > 1: a round without drafts whose verify the target batches with ``batch`` one-row
    rounds in all (under load, ``disable_by_batch_size``). The chain's rows then make the whole
    batch's forward longer, and pay only if the batch commits more tokens per cost with them:
    (batch + gain) / cost(batch + fused rows) against batch / cost(batch rows), the forward's cost
    taken by its rows from the same table (on a CPU, rows cost alike however they are split)."""
    if fused <= 0:
        return False
    if batch > 1 and k == 0:
        gain = min(acc.fused_gain, fused)
        return (batch + gain) / verify_cost(batch + fused, costs, verify) > batch / verify_cost(batch, costs, verify)
    return round_worth(acc, k, alts, costs, verify, fused) > round_worth(acc, k, alts, costs, verify)


PREDICTED_CHAIN = 16  # the longest chain a request with a client's prediction fuses, whatever ``fuse_ngram`` says
LONG_PREDICTED_CHAIN = 32  # ... and while its chains win nearly all of that (``LONG_CHAIN_GAIN`` of it)
LONG_CHAIN_GAIN = 0.75


def longest_chain(fuse_ngram: int, predicted: bool, acc: Acceptance) -> int:
    """The longest fused chain a round may verify (``choose_fuse`` then weighs it): ``fuse_ngram``;
    with a client's prediction (Predicted Outputs) at least ``PREDICTED_CHAIN``, and twice that
    while the request's chains win nearly all of it (a prediction the output follows): long
    chains pay there and only there, since past the next mismatch their rows are spent."""
    if not predicted:
        return fuse_ngram
    long = acc.fused_gain >= LONG_CHAIN_GAIN * PREDICTED_CHAIN
    return max(fuse_ngram, LONG_PREDICTED_CHAIN if long else PREDICTED_CHAIN)


def choose_fuse(acc: Acceptance, k: int, alts: int, max_fused: int, costs: tuple[float, float, float] = DEFAULT_COSTS,
                verify: tuple[float | None, ...] = (), batch: int = 1) -> int:
    """The longest fused chain that pays (``fuse_pays``) among ``max_fused`` and its halvings, or
    0. A shorter chain costs fewer rows and wins at most its length: under load, where long
    chains rarely pay for the batch, a request still tries (and profits from) short ones."""
    f = max_fused
    while f > 0:
        if fuse_pays(acc, k, alts, f, costs, verify, batch):
            return f
        f //= 2
    return 0


class StepCosts:
    """A model's forward time for one sequence by its number of new rows: a decode or draft step
    (1 row), a verify block (k + 1 rows and any runner-ups). Each row count keeps a moving mean
    (``FIT_WEIGHT`` for the newest forward), so it follows a machine that speeds up or slows
    down; forwards of many rows (prefills, ``FIT_ROWS``) are left out."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        if not 1 <= rows <= FIT_ROWS or seconds <= 0:
            return
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + FIT_WEIGHT * (seconds - old)

    def table(self) -> list[float | None]:
        """Seconds by rows (index rows - 1) up to the most rows seen; None where not seen."""
        return [self.seconds.get(r) for r in range(1, max(self.seconds, default=0) + 1)]


def median_table(tables: list[list[float | None]]) -> list[float | None] | None:
    """Per row count, the median of several workers' ``StepCosts.table`` (None where none saw it;
    None for no tables): a request may run on any of them."""
    if not tables:
        return None
    out = []
    for i in range(max(map(len, tables))):
        seen = sorted(t[i] for t in tables if i < len(t) and t[i] is not None)
        out.append(seen[len(seen) // 2] if seen else None)
    return out


def measured_costs(draft: list[float | None] | None, target: list[float | None] | None,
                   base: tuple[float, float, float] | list[float] = DEFAULT_COSTS,
                   ) -> tuple[tuple[float, float, float], tuple[float | None, ...]]:
    """``choose_round``'s costs from measured forward times (``StepCosts.table`` of a draft and of
    a target; None: none yet): the draft step in target decode steps, and the target's verify
    forwards by rows in decode steps. The verify row beyond them is the mean step over the rows
    measured; what is not measured, and the round's fixed cost (its messages), stay ``base``'s."""
    draft_step, verify_row, round_cost = base
    draft, target = _no_dearer_than_more_rows(draft), _no_dearer_than_more_rows(target)
    decode = _one_row(target)
    if decode is None:
        return (float(draft_step), float(verify_row), float(round_cost)), ()
    if (step := _one_row(draft)) is not None:
        draft_step = step / decode
    verify = tuple(None if t is None else t / decode for t in target)
    rows = max(r for r, v in enumerate(verify, 1) if v is not None)
    if rows > 1:
        verify_row = max(0.0, (verify[rows - 1] - 1) / (rows - 1))
    return (float(draft_step), float(verify_row), float(round_cost)), verify


def _no_dearer_than_more_rows(seconds: list[float | None] | None) -> list[float | None] | None:
    """A ``StepCosts.table`` with no forward dearer than one of more rows measured: a forward never
    costs less for more rows, so such a time is a cold outlier (a deployment's first draft steps on
    a CPU, right after its thread count changed, took 26-90 ms against ~3.7 ms for steps of 2 to 6
    rows), which the moving mean keeps until fresh forwards of that row count wash it out."""
    if seconds is None:
        return None
    out, cheapest = list(seconds), float("inf")
    for i in reversed(range(len(out))):
        if out[i] is not None:
            cheapest = out[i] = min(out[i], cheapest)
    return out


def _one_row(seconds: list[float | None] | None) -> float | None:
    """A forward of one row, from a ``StepCosts.table``: as measured, else from the two fewest row
    counts measured (a target whose rounds all had drafts never ran one row), else the fewest's."""
    seen = [(r, t) for r, t in enumerate(seconds or [], 1) if t is not None and t > 0]
    if not seen:
        return None
    (r1, t1), *rest = seen
    if r1 == 1 or not rest:
        return t1
    r2, t2 = rest[0]
    return max(t1 / 2, t1 - (t2 - t1) / (r2 - r1) * (r1 - 1))
