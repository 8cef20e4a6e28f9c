"""A TASKS batch made runnable: each ``TaskSpec`` (already checked against the wire schema by
decoding) checked against this worker's model and turned into the runner's ``Task``."""

from __future__ import annotations

import orjson

from nebula_flow.params import InvalidParams, SamplingParams
from nebula_flow.protocol import ProtocolError, Rejected, TaskResult, TaskSpec, malformed
from nebula_flow_workers.runner import Task
from nebula_flow_workers.token_book import TokenBook


def runnable(spec: TaskSpec, vocab_size: int | None, book: TokenBook, guided: bool = True) -> Task:
    """The runner's task for ``spec``, or ``ProtocolError``. ``vocab_size``: the ids a task may hold
    (None: any, an n-gram drafter); ``book``: the tokens earlier tasks brought (``spec`` carries those
    after its ``base``); ``guided``: this worker can follow a grammar in a verify (``workers/guides.py``)."""
    try:
        params = sampling_params(spec.params)
    except (InvalidParams, TypeError) as exc:
        raise ProtocolError("invalid_params", str(exc)) from None
    if params.structured is not None and not guided and spec.kind not in ("draft", "ahead"):
        raise ProtocolError("invalid_params", "structured outputs need the target checkpoint's tokenizer.json "
                            "at this worker (an emulated worker cannot follow a grammar)")
    if vocab_size is not None:
        if len(spec.tokens) and spec.tokens.max() >= vocab_size:  # (those before its base: checked as they came)
            raise malformed(f"task tokens must be ids below {vocab_size}")
        for name, ids in (("draft", spec.draft), ("runner_ups", spec.runner_ups), *(("chains", c) for c in spec.chains)):
            if ids and max(ids) >= vocab_size:
                raise malformed(f"{name} must be token ids below {vocab_size}")
    if spec.draft and not params.greedy and spec.q_len is None and spec.kind != "ahead":  # (a pre-draft reads tokens)
        raise malformed("a sampled draft needs its proposal q")
    q_idx, q_prob = spec.proposal() if spec.q_len is not None else (None, None)
    if vocab_size is not None and spec.prediction is not None and len(spec.prediction) \
            and spec.prediction.max() >= vocab_size:
        raise malformed(f"a prediction must be token ids below {vocab_size}")
    tokens = book.tokens(spec)
    return Task(spec.rid, spec.kind, spec.round, spec.attempt, tokens, spec.k,
                params, spec.seed, list(spec.draft), q_idx, q_prob, holder=spec.holder,
                target_holder=spec.target_holder, alts=spec.alts,
                runner_ups=list(spec.runner_ups), fuse=spec.fuse, chains=[list(c) for c in spec.chains], ahead=spec.ahead,
                prompt_len=spec.prompt_len, suppress=list(spec.suppress), alone=spec.alone,
                steps=spec.steps, prediction=book.prediction(spec.rid), score_from=spec.score_from)


def runnable_batch(items: list[TaskSpec | Rejected], vocab_size: int | None, book: TokenBook,
                   guided: bool) -> tuple[list[Task], list[TaskResult], list[ProtocolError]]:
    """A TASKS batch's runnable tasks (``runnable``), the error results of those that are not (one
    malformed or that this worker cannot run: the broker ends its request; ``tokens_missing``: it
    sends the task again whole), and the errors of items that name no task."""
    tasks, failures, unnamed = [], [], []
    for item in items:
        try:
            if isinstance(item, Rejected):
                raise item.error
            tasks.append(runnable(item, vocab_size, book, guided))
        except ProtocolError as exc:
            result = failed(item, exc)
            if result is None:
                unnamed.append(exc)
            else:
                failures.append(result)
    return tasks, failures, unnamed


def sampling_params(raw: dict) -> SamplingParams:
    """``SamplingParams.from_wire(raw)``, made once per distinct parameters: every round of a
    request carries the same ones, and checking them cost ~10 us a task on the batch's critical
    path. (Keyed by their JSON: exact, 1, 1.0 and true apart, and ~10x quicker than ``repr``, which
    took ~3 ms for a large JSON schema; invalid ones raise every time.)"""
    try:
        key = orjson.dumps(raw)
    except TypeError:  # (not JSON: from_wire says what is wrong)
        return SamplingParams.from_wire(raw)
    params = _PARAMS.get(key)
    if params is None:
        params = SamplingParams.from_wire(raw)
        if len(_PARAMS) >= 4096:  # (a bound, not an LRU: a worker sees few distinct parameter sets)
            _PARAMS.clear()
        _PARAMS[key] = params
    return params


_PARAMS: dict[bytes, SamplingParams] = {}


def current(waiting: list[Task], frees: list[int]) -> list[Task]:
    """The tasks ``waiting`` for a batch, less those of the requests a FREE that came after them
    ends (cancelled while the task waited behind the batch computing): such a task's result would
    be stale, and the KV it made would outlive its request, for no FREE comes again. (Only those
    waiting: a broker that restarts numbers its requests afresh, so a later task may reuse a rid.)"""
    return [t for t in waiting if t.rid not in frees] if frees else waiting


def failed(item: TaskSpec | Rejected, error: ProtocolError) -> TaskResult | None:
    """The error result that fails a task this worker cannot run (None: it names no task)."""
    head = {"rid": item.rid, "kind": item.kind, "round": item.round, "attempt": item.attempt} \
        if isinstance(item, TaskSpec) else item.head
    return TaskResult(**head, error=f"{error.code}: {error.message}") if head else None
