"""A topic: the broker's queue of ready tasks for one role, indexed by KV holder."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator


class Topic:
    """A FIFO of queued request ids, indexed by the worker that holds each one's KV.

    Removal is O(1) and a worker finds the tasks it holds without scanning the whole queue,
    so dispatch stays cheap with thousands of queued requests and many workers. The holder is
    recorded when a task is queued (holders only change while a request is in flight).
    """

    def __init__(self, rids: Iterable[int] = ()) -> None:
        self._seq: dict[int, int] = {}  # rid -> queue position key, in queue order
        self._holder: dict[int, int | None] = {}
        self._by_holder: dict[int | None, dict[int, int]] = {}
        self._front = self._back = 0
        for rid in rids:
            self.append(rid)

    def append(self, rid: int, holder: int | None = None) -> None:
        self._back += 1
        self._add(rid, holder, self._back)

    def appendleft(self, rid: int, holder: int | None = None) -> None:
        """Put ``rid`` first (a re-queued task); rare, so rebuilding the order is fine."""
        self._front -= 1
        self._seq = {rid: self._front, **self._seq}
        self._holder[rid] = holder
        self._by_holder[holder] = {rid: self._front, **self._by_holder.get(holder, {})}

    def _add(self, rid: int, holder: int | None, seq: int) -> None:
        self._seq[rid] = seq
        self._holder[rid] = holder
        self._by_holder.setdefault(holder, {})[rid] = seq

    def remove(self, rid: int) -> None:
        del self._seq[rid]
        holder = self._holder.pop(rid)
        group = self._by_holder[holder]
        del group[rid]
        if not group:
            del self._by_holder[holder]

    def forget_holder(self, holder: int) -> None:
        """A holder left: its queued tasks count as held by no one, in queue order."""
        group = self._by_holder.pop(holder, None)
        if group:
            for rid in group:
                self._holder[rid] = None
            merged = {**self._by_holder.get(None, {}), **group}
            self._by_holder[None] = dict(sorted(merged.items(), key=lambda kv: kv[1]))

    def held_by(self, holders: Iterable[int | None]) -> Iterator[int]:
        """Queued tasks held by any of ``holders``, in queue order."""
        groups = [self._by_holder[h].items() for h in holders if h in self._by_holder]
        if len(groups) == 1:
            return (rid for rid, _ in groups[0])
        return (rid for rid, _ in heapq.merge(*groups, key=lambda kv: kv[1]))

    def held(self, holder: int | None) -> int:
        """How many queued tasks ``holder`` holds."""
        return len(self._by_holder.get(holder, ()))

    def holders(self) -> list[int | None]:
        return list(self._by_holder)

    def __iter__(self) -> Iterator[int]:
        return iter(self._seq)

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, rid: object) -> bool:
        return rid in self._seq
