"""A topic: the broker's queue of ready tasks for one role, in priority order, indexed by KV holder."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator
from itertools import chain


class _Fifo:
    """Queued request ids of one priority in queue order, indexed by the worker that holds each one's KV.

    Removal is O(1) and a worker finds the tasks it holds without scanning the whole queue,
    so dispatch stays cheap with thousands of queued requests and many workers. The holder is
    recorded when a task is queued (holders only change while a request is in flight).
    """

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self._seq: dict[int, int] = {}  # rid -> queue position key, in queue order
        self._holder: dict[int, int | None] = {}
        self._by_holder: dict[int | None, dict[int, int]] = {}
        self._front = self._back = 0

    def append(self, rid: int, holder: int | None) -> None:
        self._back += 1
        self._seq[rid] = self._back
        self._holder[rid] = holder
        self._by_holder.setdefault(holder, {})[rid] = self._back

    def appendleft(self, rid: int, holder: int | None) -> None:
        """Put ``rid`` first (a re-queued task); rare, so rebuilding the order is fine."""
        self._front -= 1
        self._seq = {rid: self._front, **self._seq}
        self._holder[rid] = holder
        self._by_holder[holder] = {rid: self._front, **self._by_holder.get(holder, {})}

    def remove(self, rid: int) -> None:
        del self._seq[rid]
        holder = self._holder.pop(rid)
        group = self._by_holder[holder]
        del group[rid]
        if not group:
            del self._by_holder[holder]

    def forget_holder(self, holder: int) -> None:
        group = self._by_holder.pop(holder, None)
        if group:
            for rid in group:
                self._holder[rid] = None
            merged = {**self._by_holder.get(None, {}), **group}
            self._by_holder[None] = dict(sorted(merged.items(), key=lambda kv: kv[1]))

    def held_by(self, holders: Iterable[int | None]) -> Iterator[int]:
        groups = [self._by_holder[h].items() for h in holders if h in self._by_holder]
        if len(groups) == 1:
            return (rid for rid, _ in groups[0])
        return (rid for rid, _ in heapq.merge(*groups, key=lambda kv: kv[1]))

    def held(self, holder: int | None) -> int:
        return len(self._by_holder.get(holder, ()))

    def holders(self) -> Iterable[int | None]:
        return self._by_holder.keys()

    def __iter__(self) -> Iterator[int]:
        return iter(self._seq)

    def __len__(self) -> int:
        return len(self._seq)


class Topic:
    """Queued request ids: the lowest ``priority`` first (vLLM's order: a request's ``priority``, 0 unless
    the policy's ``priority_scheduling`` lets it differ), each priority first in, first out, indexed by
    the worker that holds each one's KV. With one priority (the usual case) it is one FIFO; with many
    (at most one per pooled request), dispatch walks them in order.
    """

    def __init__(self, rids: Iterable[int] = ()) -> None:
        self._levels: dict[int, _Fifo] = {}  # priority -> its FIFO, in priority order
        self._level_of: dict[int, _Fifo] = {}  # rid -> the FIFO it waits in
        for rid in rids:
            self.append(rid)

    def _level(self, priority: int) -> _Fifo:
        level = self._levels.get(priority)
        if level is None:  # (a new priority: rare, so re-sorting the few levels is fine)
            level = _Fifo(priority)
            self._levels = dict(sorted({**self._levels, priority: level}.items()))
        return level

    def append(self, rid: int, holder: int | None = None, priority: int = 0) -> None:
        level = self._levels.get(priority)  # (the broker's hot path: one lookup)
        if level is None:
            level = self._level(priority)
        level.append(rid, holder)
        self._level_of[rid] = level

    def appendleft(self, rid: int, holder: int | None = None, priority: int = 0) -> None:
        """Put ``rid`` first among its priority (a re-queued task)."""
        level = self._level(priority)
        level.appendleft(rid, holder)
        self._level_of[rid] = level

    def remove(self, rid: int) -> None:
        level = self._level_of.pop(rid)
        level.remove(rid)
        if not level._seq:
            del self._levels[level.priority]

    def forget_holder(self, holder: int) -> None:
        """A holder left: its queued tasks count as held by no one, in queue order."""
        for level in self._levels.values():
            level.forget_holder(holder)

    def held_by(self, holders: Iterable[int | None], most_urgent: bool = False) -> Iterator[int]:
        """Queued tasks held by any of ``holders``, in queue order; ``most_urgent``: only those of the
        lowest priority queued (a worker's own tasks go first only among tasks as urgent as any)."""
        if len(self._levels) == 1 or most_urgent and self._levels:
            return next(iter(self._levels.values())).held_by(holders)
        holders = list(holders)
        return chain.from_iterable(level.held_by(holders) for level in self._levels.values())

    def held(self, holder: int | None) -> int:
        """How many queued tasks ``holder`` holds."""
        return sum(level.held(holder) for level in self._levels.values())

    def least_urgent(self, than: int) -> Iterator[int]:
        """Queued request ids of a priority number above ``than``: the least urgent first, each
        priority's latest first (whom a full pool turns away for a more urgent request: ``displace``)."""
        for level in reversed(self._levels.values()):
            if level.priority <= than:
                return
            yield from reversed(level._seq)

    def urgent_or_held_by(self, holders: Iterable[int | None]) -> Iterator[int]:
        """Queued tasks of every priority but the least urgent queued (none with one priority), then those
        held by any of ``holders``, each in queue order (a task may come twice): where priorities differ,
        a task can be more urgent than what a worker would run otherwise (``overtaking_bar``)."""
        return chain(chain.from_iterable(list(self._levels.values())[:-1]), self.held_by(holders))

    def overtaking_bar(self, holder: int, running: Iterable[int]) -> float:
        """With ``priority_scheduling``, a task of a priority below this goes to worker ``holder`` (with
        room) though another holds its KV: it is more urgent than some task queued, than every one
        ``holder`` holds here and than all it runs (``running``: their priorities, read only where
        priorities differ: the broker's hot path passes a generator). So an urgent task
        waits for no busy holder while a worker runs less urgent ones; one as urgent as a worker's own
        stays with its holder (at a saturated pool's share of urgent requests, moving those too cost
        more in KV moves than it gained; ``docs/benchmarks.md``, "Priority scheduling")."""
        if len(self._levels) < 2:
            return -math.inf
        own = next((p for p, level in self._levels.items() if level.held(holder)), math.inf)
        return min(next(reversed(self._levels)), own, min(running, default=math.inf))

    def head_priority(self) -> float:
        """The most urgent priority queued (infinity when none is)."""
        return next(iter(self._levels), math.inf)

    def holders(self) -> list[int | None]:
        return list(dict.fromkeys(chain.from_iterable(level.holders() for level in self._levels.values())))

    def __iter__(self) -> Iterator[int]:
        if len(self._levels) == 1:
            return iter(next(iter(self._levels.values())))
        return chain.from_iterable(self._levels.values())

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, rid: object) -> bool:
        return rid in self._level_of


def queued_by_priority(topics: Iterable[Topic]) -> dict[str, int]:
    """Queued tasks by priority over ``topics``, most urgent first (the broker's status)."""
    counts: dict[int, int] = {}
    for topic in topics:
        for priority, level in topic._levels.items():
            counts[priority] = counts.get(priority, 0) + len(level)
    return {str(p): n for p, n in sorted(counts.items())}
