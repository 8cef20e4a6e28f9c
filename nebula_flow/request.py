"""Broker-side state of one request: its tokens, its round in progress, its stop rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from nebula_flow.lookup import matched
from nebula_flow.params import SamplingParams
from nebula_flow.speclen import Acceptance

if TYPE_CHECKING:
    from nebula_flow.ahead import Ahead
    from nebula_flow.fusion import Gain, Second

# The phase of a request says which topic its next task sits on.
DRAFT, VERIFY, ROUND, DONE = "draft", "verify", "round", "done"
AHEAD = "ahead"  # not a phase: the kind of a task pre-drafting a request's next round (draft-ahead)


@dataclass
class Request:
    """One generation in the broker's pool. ``owner`` is opaque to the policy (the client)."""

    rid: int
    req_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    owner: Any = None
    output: list[int] = field(default_factory=list)
    phase: str = DRAFT
    round: int = 0
    attempt: int = 0
    k: int = 0  # draft tokens asked for in the current round
    steps: int = 1  # tokens the current round's draft-less verify decodes (``nebula_flow/steps.py``)
    alts: int = 0  # runner-ups to the first draft token asked for in the current round (token tree)
    slot: int | None = None  # the pair / colocated worker a request is bound to, if any
    draft: list[int] = field(default_factory=list)
    q: dict[str, Any] = field(default_factory=dict)  # q_idx, q_prob, q_len of the draft
    runner_ups: list[int] = field(default_factory=list)  # alternatives to draft[0] (a two-level token tree)
    fuse: int = 0  # the longest prompt-lookup chain to fuse beside this round's draft (a token tree)
    chains: list[list[int]] = field(default_factory=list)  # the chains fused beside the draft
    holders: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (worker, valid)
    # a new request: holder key -> (worker, positions, request) whose prefix cache likely holds its prompt's start, and
    # the request whose KV it was (prefixes.py); the policy log's replays give the first two
    affinity: dict[str, tuple[int, ...]] = field(default_factory=dict)
    waits_for: int | None = None  # a new request: the request computing its prompt's start that it waits for (prefixes.py)
    known: dict[int, tuple[int, int]] = field(default_factory=dict)  # worker -> (tokens sent it, their CRC-32): broker/known.py
    resent: int = 0  # its tasks sent again whole for a worker that lacked their tokens (broker/known.py)
    tokens_per_round: list[int] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    alt_accepted: int = 0  # rounds an alternative to the first draft token won
    fused_accepted: int = 0  # tokens accepted from fused chains beyond what the draft had
    burst: bool = False  # a task of it went out alone (a burst's, or alone in the pool): ``budget.sends_alone``
    cached: int = 0  # positions its target workers copied from other requests' KV (prefix cache): usage's cached_tokens
    prediction: np.ndarray | None = None  # the client's prediction of the output (int32): chains are looked up in it too
    acceptance: Acceptance = field(default_factory=Acceptance)  # decayed, for adaptive k (speclen): the drafter's in use
    drafter: str | None = None  # the drafter this round's draft is routed to (then: the one that drafted it)
    by_drafter: dict[str, Acceptance] = field(default_factory=dict)  # each drafter's acceptance for this request
    drafter_used: dict[str, int] = field(default_factory=dict)  # drafter -> the last round it drafted
    explore_gaps: dict[str, int] = field(default_factory=dict)  # drafter -> rounds unused before trying it again
    drafter_rounds: dict[str, int] = field(default_factory=dict)  # drafter -> rounds it drafted
    ks: list[int] = field(default_factory=list)  # the k of each round
    ahead: Ahead | None = None  # draft-ahead: the pre-draft of the round after this one's verify (``nebula_flow/ahead.py``)
    second: Second | None = None  # fused drafters: this round's second draft (``nebula_flow/fusion.py``)
    second_gain: dict[str, Gain] = field(default_factory=dict)  # drafter -> what its second chains won beyond the first
    text: str = ""
    sent: int = 0  # characters of ``text`` streamed (a tail that may begin a stop string waits: ``Admission.release``)
    detok: Any = None  # the broker's incremental decoder of ``output`` (tokenizer.IncrementalText)
    finish_reason: str | None = None
    logprobs: list | None = None  # asked for: each output token's entry (``protocol.Tokens.logprobs``)
    prompt_logprobs: list | None = None  # asked for: the prompt's tokens' entries so far (the first's logprob: null)
    suppress: list[int] = field(default_factory=list)  # min_tokens: the ids that would end it (``penalties``)
    t_submit: float = 0.0
    t_first: float | None = None
    # ``tokens``' array, grown as the output grows (committed tokens never change), and how much of it is filled
    _token_buf: np.ndarray | None = field(default=None, repr=False, compare=False)
    _token_len: int = field(default=0, repr=False, compare=False)

    @property
    def tokens(self) -> np.ndarray:
        """Committed tokens, prompt first: what every task's KV must cover. Tasks carry what their
        worker lacks of them (``broker/known.py``), so the array grows with the output instead of
        being rebuilt each round."""
        n, have, buf = len(self.prompt) + len(self.output), self._token_len, self._token_buf
        if buf is None or n > len(buf) or n < have:
            # (room for the whole output at once: filling in a prompt again costs ~13 us a 1,000 tokens)
            grown = np.empty(max(n, 2 * len(buf) if buf is not None else len(self.prompt) + self.params.max_new_tokens, 64),
                             dtype=np.int32)
            grown[:len(self.prompt)] = self.prompt
            buf, have = grown, len(self.prompt)
            self._token_buf = buf
        if n > have:
            buf[have:n] = self.output[have - len(self.prompt):]
        self._token_len = n
        return buf[:n]

    @property
    def reproducible(self) -> bool:
        """A sampled request with the client's own seed: its output must not depend on placement."""
        return not self.params.greedy and self.params.seed is not None

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    def cut(self, n: int) -> None:
        """Keep the first ``n`` output tokens (a stop string ends there), all of this round's."""
        self.tokens_per_round[-1] -= len(self.output) - n
        del self.output[n:]

    def commit(self, committed: list[int], eos_ids: tuple[int, ...]) -> list[int]:
        """Append a verify's tokens, cut at EOS (unless ignored), a stop token id and
        max_new_tokens; returns what was kept."""
        kept = committed[: self.remaining]
        stops = () if self.params.ignore_eos else eos_ids
        if self.params.stop_token_ids:
            stops = (*stops, *self.params.stop_token_ids)
        if stops:
            for i, t in enumerate(kept):
                if t in stops:
                    kept = kept[: i + 1]
                    self.finish_reason = "stop"
                    break
        self.output.extend(kept)
        self.tokens_per_round.append(len(kept))
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = "length"
        return kept

    def stats(self) -> dict[str, Any]:
        rounds = len(self.tokens_per_round)
        return {
            "rounds": rounds,
            "tokens_per_round": self.tokens_per_round,
            "mean_tokens_per_round": (len(self.output) / rounds) if rounds else 0.0,
            "proposed": self.proposed,
            "k_per_round": self.ks,
            "accepted": self.accepted,
            "alternatives_accepted": self.alt_accepted,
            "fused_accepted": self.fused_accepted,
            "drafter_rounds": self.drafter_rounds,
            "prompt_tokens": len(self.prompt),
            "cached_tokens": max(0, min(self.cached, len(self.prompt) - 1)),
            "output_tokens": len(self.output),
            "seed": self.seed,
            **({"prediction_tokens": len(self.prediction), "prediction_accepted": matched(self.prediction, self.output)}
               if self.prediction is not None else {}),
        }
