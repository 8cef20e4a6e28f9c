"""The TASKS a batch the policy chose becomes: each request's round half, its pre-draft
(draft-ahead) or its second draft (fused drafters), with the KV holders it needs and what the
policy asks of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from nebula_flow import budget, fusion, steps
from nebula_flow.prefixes import ROLES
from nebula_flow.protocol import Holder, TaskSpec
from nebula_flow.request import AHEAD, DRAFT, ROUND, VERIFY, Request
from nebula_flow.roles import holder_key
from nebula_flow.scheduler import Scheduler
from nebula_flow_broker.known import tokens_for

HolderOf = Callable[[tuple[int, int]], Holder]  # (worker, valid) -> with its KV endpoint


def task_specs(scheduler: Scheduler, wid: int, batch: list[Request], workers: Mapping[int, Any],
               full_tokens: bool = False) -> list[TaskSpec]:
    """The tasks of a batch worker ``wid``'s PULL is served (from its stage's topic); ``workers``: the
    broker's, whose ``kv_endpoint`` each holder names. Each carries the tokens ``wid`` lacks of its
    request (``full_tokens``: all of them; ``broker/known.py``)."""
    def holder(held: tuple[int, int]) -> Holder:
        info = workers.get(held[0])
        return Holder(*held, info.kv_endpoint if info is not None else None)

    w = scheduler.workers[wid]
    if w.stage == AHEAD:
        return [predicted(req, predraft(scheduler, req, holder, tokens_for(req, wid, full_tokens))) for req in batch]
    tasks, alone = [], budget.sends_alone(batch, len(scheduler.requests), scheduler.streaming,
                                          scheduler.workers.values())
    steps.assign(scheduler, batch)  # (multi-step decoding: a draft-less verify's ``steps``)
    for req in batch:
        tokens, base, crc = tokens_for(req, wid, full_tokens)
        if fusion.is_second(w, req):  # (a fused round's second draft: a plain draft of its own drafter's)
            s = req.second
            tasks.append(predicted(req, penalized(req, TaskSpec(req.rid, DRAFT, req.round, s.attempt, tokens, s.k,
                                                            req.params.to_wire(), req.seed,
                                                            holder(req.holders.get(holder_key("draft", s.drafter), (0, 0))),
                                                            base=base, base_crc=crc, prompt_len=len(req.prompt)))))
            continue
        task = TaskSpec(req.rid, req.phase, req.round, req.attempt, tokens, req.k, req.params.to_wire(),
                        req.seed, holder(req.holders.get(scheduler.task_holder_key(req), (0, 0))), draft=req.draft,
                        runner_ups=req.runner_ups if req.draft else [], chains=[*req.chains, *fusion.chains(req)] if req.draft else [],
                        base=base, base_crc=crc, prompt_len=len(req.prompt))
        if req.phase == ROUND and "target" in req.holders:  # (an elastic round: its target KV's holder too)
            task.target_holder = holder(req.holders["target"])
        if req.affinity and (task.holder.valid == 0 or task.target_holder is None and req.phase == ROUND) \
                and scheduler.policy.prefix_pulls:  # (no KV of its own yet: its prompt's start may be held elsewhere)
            prefix_sources(req, task, wid, holder, scheduler.task_holder_key(req))
        if req.alts and req.phase in (DRAFT, ROUND):
            task.alts = req.alts
        if req.fuse and (req.phase != VERIFY or not req.draft):  # (without a draft the target looks it up)
            task.fuse = req.fuse
        if req.params.penalized:  # (checked here: this loop is the broker's hot path)
            penalized(req, task)
        if req.q:  # (a sampled draft's proposal, flat as it came: checked when it arrived)
            task.q_idx, task.q_prob, task.q_len = req.q["q_idx"], req.q["q_prob"], req.q["q_len"]
        if req.prediction is not None:  # (checked here, as penalties are)
            predicted(req, task)
        if req.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt) and req.phase != DRAFT:
            task.score_from = len(req.prompt_logprobs)  # (the target scores it)
        task.alone = alone
        task.steps = req.steps
        tasks.append(task)
    return tasks


def prefix_sources(req: Request, task: TaskSpec, wid: int, holder: HolderOf, key: str) -> None:
    """Where ``task`` has no holder of a model's KV (its own, ``key``; an elastic round's target KV too)
    and another worker's likely holds its prompt's start (``Request.affinity``), name that worker and
    the request whose KV it was: ``wid`` pulls those positions from there instead of computing them
    (a colocated round's ``holder`` holds both models' KV)."""
    def source(role: str) -> Holder | None:
        where = req.affinity.get(role) if role in ROLES else None
        if where is None or len(where) < 3 or where[0] == wid:  # (a replayed log's affinity names no request)
            return None
        found = holder(where[:2])
        found.source = where[2]
        found.source_prompt = where[3] if len(where) > 3 else 0  # (0, unknown: a worker that needs it computes)
        return found

    if task.holder.valid == 0 and (found := source(key)) is not None:
        task.holder = found
    if req.phase == ROUND and task.target_holder is None and (found := source("target")) is not None:
        task.target_holder = found


def predraft(scheduler: Scheduler, req: Request, holder: HolderOf, tokens: tuple[Any, int, int]) -> TaskSpec:
    """The ``ahead`` task pre-drafting ``req``'s next round (``nebula_flow/ahead.py``): the committed
    tokens (``tokens``: what ``tokens_for`` gives), the draft being verified, and what to draft for each outcome."""
    st, (rest, base, crc) = req.ahead, tokens
    return penalized(req, TaskSpec(req.rid, AHEAD, st.round, st.attempt, rest, st.k, req.params.to_wire(), req.seed,
                                   holder(req.holders.get(holder_key("draft", req.drafter), (0, 0))), draft=st.draft,
                                   alts=st.alts, fuse=st.fuse, ahead=st.outcomes, base=base, base_crc=crc,
                                   prompt_len=len(req.prompt)))


def predicted(req: Request, task: TaskSpec) -> TaskSpec:
    """``task`` with its request's prediction where it carries the request's tokens from the start:
    the worker's book keeps it beside them for the request's later tasks (``workers/token_book.py``)."""
    if req.prediction is not None and not task.base:
        task.prediction = req.prediction
    return task


def penalized(req: Request, task: TaskSpec) -> TaskSpec:
    """``task`` with what its rows' rules need (``nebula_flow/penalties.py``), where ``req`` has
    any: min_tokens names the ids it must not pick yet (penalties count the output's tokens apart
    from the prompt's, whose length every task carries). Every task kind carries them: a draft
    follows the same rules as the verify."""
    if req.params.penalized and len(req.output) < req.params.min_tokens:
        task.suppress = req.suppress
    return task
