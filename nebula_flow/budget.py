"""The token budget of one forward pass: chunked prefill (pure; the worker runner and the
simulator share it).

A request's first task carries its whole prompt: without a bound, one forward computes every
uncached token of every task in the batch, and a long prompt stalls the decode and verify rows
beside it for as long as its prefill takes (seconds on a CPU). With a budget on the uncached
committed tokens a forward computes, the tasks that fit go first (decode steps first, smallest
first) and a task with a long uncached prompt computes only a chunk of it this forward: it
returns "prefilled up to here" and comes back for the next chunk, while the others' rounds go
on (as vLLM's and SGLang's chunked prefill do). A task's draft or verify tree rows are not
counted: they are bounded by the policy's k and trees, and splitting them off would only add a
round trip.

A request alone in its broker's pool prefills whole: a chunk is there to keep other requests'
streams flowing, and there are none, so chunking it only added forwards and round trips (the
bundled pair's chat prompts, single stream: 117 ms to the first token chunked by 16, 73 ms
whole; docs/benchmarks.md). So does every request of a pool where no output has begun and
whose requests the workers batch at once (a burst of new requests; prompts scored for their
log-probabilities with one output token, as an evaluation harness sends them: 16 prompts of 256
tokens, 4 at a time, were scored 1.95-2.13x faster whole: docs/benchmarks.md). The broker marks
such a task ``alone`` when it sends it, and so every task sent beside a request of that burst
whose output has not begun (``sends_alone``). A forward whose every task is alone has the policy's
burst budget (``max_burst_tokens``; 0: none): a burst of long prompts on a CPU, whole, was one
forward of many seconds, after which a dozen streams began in the same second; bounded, the
smallest prompts go first and the streams begin one forward after another, while the burst's
prompts go on at the burst's budget beside them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nebula_flow.request import Request
    from nebula_flow.roles import WorkerState

MIN_CHUNK = 16  # a chunked prefill moves at least this far each forward, so a full budget never starves it


def alone(pool: int) -> bool:
    """Whether a task of a request that shares its broker's pool of ``pool`` requests (itself
    included) goes out alone: its prompt then prefills whole."""
    return pool == 1


def prefills_whole(pool: int, streaming: int, workers: Iterable[WorkerState]) -> bool:
    """Whether a task sent while its broker's pool holds ``pool`` requests (its own included),
    ``streaming`` of them with their output begun, goes out ``alone``: its prompt prefills whole.
    Not where the pool outgrows what the verifying ``workers`` batch at once (a burst at saturation):
    the requests queued behind would wait for the longest prompt of every batch, where chunks let
    the short prompts' streams begin first (simulated on the Azure code trace, 4 elastic workers:
    p50 latency 24.8 s whole against 16.5 s chunked)."""
    return pool == 1 or streaming == 0 and pool <= sum(w.capacity for w in workers if w.role != "draft")


def sends_alone(batch: list[Request], pool: int, streaming: int, workers: Iterable[WorkerState]) -> bool:
    """Whether the tasks of ``batch``, sent while its broker's pool holds ``pool`` requests,
    ``streaming`` of them with their output begun, go out ``alone``: where ``prefills_whole`` (their
    requests are then a burst's), and where one of them is a burst's request whose output has not
    begun. So a burst's prompts, and the rounds sent beside them, keep the burst's budget after its
    first streams began; another broker's tasks in the same forward are not alone, and take the
    forward back to the plain budget."""
    if prefills_whole(pool, streaming, workers):
        for req in batch:
            req.burst = True
        return True
    return any(req.burst and not req.output for req in batch)


def forward_budget(budget: int, burst: int, alone: list[bool]) -> int:
    """The budget of a forward of tasks each ``alone`` or not (0: no bound): ``burst`` (at least
    ``budget``; 0: none) where every task of it is alone, else ``budget``. (With several brokers,
    a task alone in its own pool may share the forward with another broker's.)"""
    if not budget or not alone or not all(alone):
        return budget
    return max(burst, budget) if burst else 0


def plan_forward(needs: list[int], deferrable: list[int], budget: int) -> list[int | None]:
    """For each task of a forward: None where it runs whole, else how many of its uncached
    tokens this forward computes (0: none this time; it keeps its place).

    ``needs[i]``: task i's uncached committed tokens (its prompt's for a first task, 1 for a
    decode step); ``deferrable[i]``: how many of them may wait (all but the last, whose logits
    the task needs). ``budget``: the most of them one forward computes (0: no bound). Tasks that
    fit run whole, smallest first; a task that does not fit gets what is left of the budget for
    its prefill (the first such task at least ``MIN_CHUNK``); a task whose tokens cannot be
    deferred always runs whole."""
    if budget <= 0 or sum(needs) <= budget:
        return [None] * len(needs)
    plan: list[int | None] = [None] * len(needs)
    left, chunked = budget, False
    for i in sorted(range(len(needs)), key=lambda i: needs[i]):
        if needs[i] <= left or deferrable[i] <= 0:
            left -= needs[i]
            continue
        chunk = min(deferrable[i], max(left, 0 if chunked else MIN_CHUNK))
        plan[i] = chunk
        left -= chunk
        chunked = True
    return plan
