"""A worker's result for one task, checked against what the policy asked for.

A draft result must hold at most ``k`` tokens, its runner-ups and fused chains as asked; a
verify result must commit a path of the round's token tree plus one token. Anything else is a
``ProtocolError`` (the broker ends that request with a clear error, never a hang).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nebula_flow import fusion
from nebula_flow.ahead import Ahead, Branch
from nebula_flow.protocol import ProtocolError, TaskResult
from nebula_flow.request import ROUND, Request
from nebula_flow.tree import TokenTree


@dataclass
class Verified:
    """What a verify (or whole round) committed, and what each part of its tree won."""

    committed: list[int]
    draft: list[int]
    runner_ups: list[int]
    chains: list[list[int]]
    draft_accepted: int  # draft tokens accepted
    via_alt: bool  # a runner-up to the first draft token won
    fused: int  # tokens a fused prompt-lookup chain won beyond the draft
    second: int | None = None  # a fused round's second draft: its tokens on the committed path (``fusion``)


def in_vocab(ids: list[int], vocab: int | None, what: str) -> None:
    """Token ids a worker sent are ids of the target's vocabulary (``vocab``: None when unknown)."""
    if vocab is not None and ids and not 0 <= min(ids) <= max(ids) < vocab:
        raise ProtocolError("malformed", f"{what} holds token ids outside the vocabulary [0, {vocab})")


def drafted(req: Request, out: TaskResult, vocab: int | None = None) -> tuple[list[int], list[int], list[list[int]]]:
    """A draft or round result's draft, runner-ups and fused chains, as the policy asked for."""
    draft = out.draft
    if len(draft) > req.k:  # (fewer: a drafter with nothing worth proposing, e.g. n-gram without a match)
        raise ProtocolError("malformed", f"draft has {len(draft)} tokens, asked for at most {req.k}")
    for ids, what in ((draft, "the draft"), (out.runner_ups, "the runner-ups"), *((c, "a fused chain") for c in out.chains)):
        in_vocab(ids, vocab, what)
    return draft, alternatives(req, out.runner_ups, draft), fused_chains(req, out.chains)


def prefilled(req: Request, out: TaskResult) -> int:
    """The positions a prefilled (chunked) result says its worker holds: at most every committed
    token but the last, whose logits the task still needs."""
    if out.prefilled > len(req.prompt) + len(req.output) - 1:
        raise ProtocolError("malformed", f"prefilled {out.prefilled} positions of a task with "
                                         f"{len(req.prompt) + len(req.output)} tokens")
    return out.prefilled


def proposal(out: TaskResult) -> dict[str, Any]:
    """A sampled draft's proposal q, flat as it travels, copied out of the message's frames (it
    outlives them); the verify task carries it on as is."""
    if out.q_len is None:
        raise ProtocolError("malformed", "a sampled draft needs its proposal q")
    return {"q_idx": out.q_idx.copy(), "q_prob": out.q_prob.copy(), "q_len": list(out.q_len)}


def verified(req: Request, out: TaskResult, vocab: int | None = None) -> Verified:
    """Check a verify or round result's committed tokens against the round's token tree (and
    the target's vocabulary: the last one is the target's own)."""
    if req.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt):
        raise ProtocolError("malformed", "a verify committed tokens before it scored the prompt (prompt_logprobs)")
    seconds: list[list[int]] = []
    if out.kind == ROUND:  # (drafted and verified in one task: its draft comes with the result)
        draft, runner_ups, chains = drafted(req, out, vocab)
    else:
        draft, runner_ups, chains, seconds = req.draft, req.runner_ups, req.chains, fusion.chains(req)
        if not draft:  # a round without a draft: the target looked the chain up itself
            chains = fused_chains(req, out.chains)
            for chain in chains:
                in_vocab(chain, vocab, "a fused chain")
    committed = out.committed or []
    in_vocab(committed, vocab, "the committed tokens")
    if req.steps > 1:  # a multi-step decode (``nebula_flow/steps.py``): no draft, up to that many tokens
        if not 0 < len(committed) <= req.steps:
            raise ProtocolError("malformed", f"{len(committed)} committed tokens by a decode of {req.steps} steps")
        return Verified(committed, [], [], [], 0, False, 0)
    accepted = len(committed) - 1
    plain = not (runner_ups or chains or seconds)  # (a plain chain, most rounds: its tree is the draft, a path of it a prefix)
    if not committed or (committed[:-1] != draft[:accepted] if plain else
                         len(TokenTree([draft, *([a] for a in runner_ups), *chains, *seconds]).path(committed[:-1])) != accepted):
        raise ProtocolError("malformed", f"{len(committed)} committed tokens are not a path of the round's "
                                         f"drafts and one more token")
    if plain:  # (every accepted token is the draft's: nothing won by a runner-up or a chain)
        return Verified(committed, draft, runner_ups, chains, accepted, False, 0)
    taken = on_chain(draft, committed)
    via_alt = taken == 0 and accepted > 0 and committed[0] in runner_ups
    fused = max((on_chain(c, committed) for c in chains), default=0) - max(taken, int(via_alt))
    return Verified(committed, draft, runner_ups, chains, taken, via_alt, max(0, fused),
                    on_chain(seconds[0], committed) if seconds else None)


def logprobs(req: Request, out: TaskResult, vocab: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """A verify's log-probabilities of its committed tokens and of the top tokens beside each, as
    the request asked for (``SamplingParams.logprobs``; None: not asked), copied out of the frames."""
    top, lp, ids = req.params.logprobs, out.logprobs, out.logprob_ids
    if top is None:
        if lp is not None or ids is not None:
            raise ProtocolError("malformed", "logprobs the request did not ask for")
        return None
    n = len(out.committed or [])
    if lp is None or ids is None or lp.dtype != np.float32 or ids.dtype != np.int32 or lp.shape != (n, 1 + top) \
            or ids.shape != (n, top) or not np.isfinite(lp).all() or (lp > 1e-3).any():
        raise ProtocolError("malformed", f"logprobs must be float32 [{n}, {1 + top}] log-probabilities (finite, <= 0) "
                                         f"and logprob_ids int32 [{n}, {top}]")
    if top and vocab is not None and not 0 <= ids.min() <= ids.max() < vocab:
        raise ProtocolError("malformed", f"logprob_ids hold token ids outside the vocabulary [0, {vocab})")
    return lp.copy(), ids.copy()


def prompt_scores(req: Request, out: TaskResult, vocab: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The log-probabilities of the prompt's tokens a verify scored, from position ``scored_from``,
    of the top tokens beside each (``SamplingParams.prompt_logprobs``) and each token's rank, copied
    out of the frames."""
    top, lp, ids, at = req.params.prompt_logprobs, out.prompt_logprobs, out.prompt_logprob_ids, out.scored_from
    rank = out.prompt_logprob_ranks
    if top is None or req.prompt_logprobs is None:
        raise ProtocolError("malformed", "prompt logprobs the request did not ask for")
    n = len(lp) if lp is not None else 0
    if lp is None or ids is None or lp.dtype != np.float32 or ids.dtype != np.int32 or lp.shape != (n, 1 + top) \
            or ids.shape != (n, top) or not np.isfinite(lp).all() or (lp > 1e-3).any():
        raise ProtocolError("malformed", f"prompt_logprobs must be float32 [n, {1 + top}] log-probabilities (finite, "
                                         f"<= 0) and prompt_logprob_ids int32 [n, {top}]")
    if not 1 <= at <= len(req.prompt_logprobs) or at + n > len(req.prompt):
        raise ProtocolError("malformed", f"prompt logprobs from position {at} ({n} of them) leave a gap or pass the "
                                         f"prompt's end ({len(req.prompt_logprobs)} of {len(req.prompt)} scored)")
    if top and n and vocab is not None and not 0 <= ids.min() <= ids.max() < vocab:
        raise ProtocolError("malformed", f"prompt_logprob_ids hold token ids outside the vocabulary [0, {vocab})")
    if rank is None or rank.dtype != np.int32 or rank.shape != (n,) or n and not 1 <= rank.min() <= rank.max() <= \
            (vocab or 1 << 31):
        raise ProtocolError("malformed", "prompt_logprob_ranks must be int32 [n] ranks from 1 to the vocabulary's size")
    return lp.copy(), ids.copy(), rank.copy(), at


def on_chain(chain: list[int], committed: list[int]) -> int:
    """How many of ``chain``'s tokens a round committed: its leading run equal to the accepted tokens."""
    accepted = committed[:-1]
    return next((i for i, (a, b) in enumerate(zip(chain, accepted)) if a != b), min(len(chain), len(accepted)))


def alternatives(req: Request, runner_ups: list[int], draft: list[int]) -> list[int]:
    """The runner-ups to the first draft token a result brings, checked against the ones the
    policy asked for (``req.alts``: a two-level token tree)."""
    if runner_ups and not draft:
        raise ProtocolError("malformed", "alternatives to the first draft token need a draft")
    if len(runner_ups) > req.alts or len(set(runner_ups)) != len(runner_ups) or (runner_ups and draft[0] in runner_ups):
        raise ProtocolError("malformed", f"{len(runner_ups)} alternatives (asked for {req.alts}) must be distinct "
                                         "and differ from the first draft token")
    return runner_ups


def fused_chains(req: Request, chains: list[list[int]]) -> list[list[int]]:
    """The chains a result fused beside its draft (or, without one, looked up for its verify),
    checked against what the policy asked for (``req.fuse``: at most one chain of that many)."""
    if len(chains) > (1 if req.fuse else 0):
        raise ProtocolError("malformed", f"{len(chains)} fused chains (asked for {1 if req.fuse else 0})")
    for c in chains:
        if not 0 < len(c) <= req.fuse:
            raise ProtocolError("malformed", f"a fused chain of {len(c)} tokens (asked for 1..{req.fuse})")
    return chains


def cost_tables(raw: object, roles: tuple[str, ...], longest: int) -> dict[str, list[float | None]]:
    """A RESULT's ``device.step_costs`` or ``device.batch_costs`` (per model role, forward seconds by
    new rows or by rows bucket, at most ``longest`` entries), or ValueError."""
    if not isinstance(raw, dict):
        raise ValueError("cost tables must be an object")
    out = {}
    for role, seconds in raw.items():
        if role not in roles or not isinstance(seconds, list) or not 0 < len(seconds) <= longest \
                or not all(t is None or _seconds(t) for t in seconds):
            raise ValueError(f"bad cost table for {role!r}")
        out[role] = [None if t is None else float(t) for t in seconds]
    return out


def _seconds(value: Any, least: float = 1e-9) -> bool:  # noqa: ANN401
    """A finite duration of at least ``least`` seconds, under an hour (a bool is no number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and least <= value < 3600.0


def predrafted(st: Ahead, items: list[TaskResult], worker: int, drafter: str | None, sampled: bool,
               vocab: int | None = None) -> list[Branch]:
    """A pre-draft's branches (draft-ahead), checked against what it was asked for (``st``): each
    assumes a verify outcome of the round being verified (accepted draft tokens plus one), a draft
    of at most ``st.k`` tokens after it (with its proposal q when sampled), runner-ups and a fused
    chain as asked. A result without ``assumes`` says the worker pre-drafted nothing; one with an
    ``error``, that it failed (``ProtocolError`` "predraft_failed")."""
    branches, seen = [], set()
    for out in items:
        if out.error:  # (the worker could not run it: counted, where "nothing made" is not)
            raise ProtocolError("predraft_failed", f"a pre-draft failed at its worker: {out.error[:300]}")
        if not out.assumes:
            if out.draft:
                raise ProtocolError("malformed", "a pre-drafted branch needs the outcome it assumes")
            continue
        a = out.assumes
        if len(a) > len(st.draft) + 1 or a[:-1] != st.draft[:len(a) - 1] or tuple(a) in seen:
            raise ProtocolError("malformed", "a pre-drafted branch must assume a distinct outcome of the verified "
                                             "draft: its first tokens and one more")
        seen.add(tuple(a))
        if not out.draft or len(out.draft) > st.k:
            raise ProtocolError("malformed", f"a pre-drafted branch has {len(out.draft)} tokens, asked for 1..{st.k}")
        in_vocab(a, vocab, "a pre-draft's outcome")
        req = Asked(st.k, st.alts, st.fuse)
        draft, runner_ups, chains = drafted(req, out, vocab)
        branches.append(Branch(list(a), draft, proposal(out) if sampled else {}, runner_ups, chains, worker, drafter))
    return branches


@dataclass
class Asked:
    """What a pre-draft asked of each branch, or a second draft of its draft (fused drafters), in the
    shape the draft checks read (``Request``'s)."""

    k: int
    alts: int
    fuse: int
