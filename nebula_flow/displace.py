"""Whom a full pool turns away for a more urgent request (priority scheduling under overload).

The broker admits at most ``max_pending`` requests. With priority scheduling, a request that comes
while the pool is full takes the place of the least urgent request that has not started: one of a
higher priority number (the latest of those), whose prompt no worker has computed any of and that
has no output (queued, or waiting for a shared start: ``prefixes.py``). That request ends with a
``busy`` error, as it would have had it come now: nothing computed is lost, and a client that
retries later is served. A request that has started is never turned away: its KV and its stream
would be lost. Without a request less urgent than the new one, the new one is the one refused.

vLLM's priority scheduling likewise serves the most urgent requests first under load (it preempts
running ones, recomputing them later); a bounded pool here turns away only the unstarted.

Pure (no sockets, no clock): the broker calls it, and a test drives it on a scheduler alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nebula_flow.request import Request
    from nebula_flow.scheduler import Scheduler

QUEUES = ("draft", "target", "colocated")  # the topics a request's first task queues on


def _unstarted(req: Request | None) -> bool:
    return req is not None and not req.output and not req.holders


def displaced_by(scheduler: Scheduler, priority: int) -> Request | None:
    """The request of ``scheduler``'s pool a new request of ``priority`` takes the place of, or None:
    the least urgent of those not started whose priority number is above ``priority`` (ties: the
    latest admitted)."""
    candidates: list[Request] = []
    for name in QUEUES:  # (each topic's first unstarted one, least urgent first)
        for rid in scheduler.topics[name].least_urgent(priority):
            if _unstarted(req := scheduler.requests.get(rid)):
                candidates.append(req)
                break
    if scheduler.prefixes is not None:  # (those waiting for a shared start are on no topic)
        for waiting in scheduler.prefixes.followers.values():
            candidates.extend(req for rid, _ in waiting if _unstarted(req := scheduler.requests.get(rid))
                              and req.params.priority > priority)
    return max(candidates, key=lambda r: (r.params.priority, r.rid), default=None)
