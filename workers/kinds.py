"""What one kind of a batch's tasks comes back as: the runners' calls for draft, pre-draft (draft-ahead),
verify and whole-round tasks, and their answers as ``TaskResult``s."""

from __future__ import annotations

from typing import Any

from nebula_flow.protocol import ProtocolError, TaskResult
from nebula_flow_workers.runner import Task

BOTH_MODELS = ("colocated", "any")  # the roles that hold both models (whole rounds)


def run_kind(kind: str, group: list[Task], role: str, draft: Any, target: Any) -> list[TaskResult]:  # noqa: ANN401
    """The results of ``group`` (tasks of ``kind``) on a worker of ``role`` with these runners
    (None where it holds no such model); ``ProtocolError`` where the role cannot run them."""
    outs = [TaskResult(t.rid, t.kind, t.round, t.attempt) for t in group]
    if kind == "draft" and draft:
        for out, t, d in zip(outs, group, draft.draft(group)):
            if t.prefilled is not None:  # (a chunk of its prompt: it comes back for the rest)
                out.prefilled = t.prefilled
                continue
            out.draft, out.runner_ups, out.chains = d.tokens, d.runner_ups, d.chains
            out.propose(d.q_idx, d.q_prob)
    elif kind == "ahead" and draft and role == "draft":  # (draft-ahead: per outcome)
        outs = []
        for t, branches in zip(group, draft.predraft(group)):
            for assumed, d in branches:
                outs.append(TaskResult(t.rid, t.kind, t.round, t.attempt, draft=d.tokens,
                                       runner_ups=d.runner_ups, chains=d.chains, assumes=assumed))
                outs[-1].propose(d.q_idx, d.q_prob)
            if not branches:  # (it pre-drafted nothing: the broker stops waiting for it)
                outs.append(TaskResult(t.rid, t.kind, t.round, t.attempt))
    elif kind == "verify" and target and role != "draft":
        for out, t, committed in zip(outs, group, target.verify(group)):
            out.cached = target.store.take_copied(t.rid)
            scores(out, t)
            if committed is None:  # (a chunk of its prompt, or it failed alone)
                out.prefilled, out.error = t.prefilled, t.error
                continue
            out.committed = committed
            if t.chains and not t.draft:  # a chain the target looked up itself
                out.chains = t.chains
    elif kind == "round" and role in BOTH_MODELS:
        # the target's budget decides which prompts only prefill a chunk, in both models
        ends = target.chunk_ends(group)
        drafting = [i for i, t in enumerate(group) if t.k > 0 or ends[i] is not None]
        drafts = draft.draft([group[i] for i in drafting], [ends[i] for i in drafting])
        for i, d in zip(drafting, drafts):
            if ends[i] is None:
                t = group[i]
                t.draft, t.q_idx, t.q_prob, t.runner_ups, t.chains = d.tokens, d.q_idx, d.q_prob, d.runner_ups, d.chains
        for out, t, committed in zip(outs, group, target.verify(group, ends)):
            out.cached = target.store.take_copied(t.rid)
            scores(out, t)
            if committed is None:
                out.prefilled, out.error = t.prefilled, t.error
                continue
            out.committed, out.draft, out.runner_ups, out.chains = committed, t.draft, t.runner_ups, t.chains
    else:
        raise ProtocolError("wrong_role", f"a {role} worker cannot run {kind} tasks")
    return outs


def scores(out: TaskResult, t: Task) -> None:
    """``out`` with the log-probabilities ``t``'s verify reported: its committed tokens' and its
    prompt's (``workers/logprobs.py``)."""
    out.logprobs, out.logprob_ids = t.logprobs or (None, None)
    if t.prompt_scores is not None:
        out.prompt_logprobs, out.prompt_logprob_ids, out.prompt_logprob_ranks, out.scored_from = t.prompt_scores
