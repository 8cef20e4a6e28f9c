"""KV preparation: which positions a batch lacks, pulling them from their holders (network pulls
on the prefetch thread while the previous batch computes, same-host reads at compute start),
and the KV counters a worker reports."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from nebula_flow.kv.store import KVStore, add_by_size
from nebula_flow.kv.transport import KVTransport
from nebula_flow_workers.runner import Task

# A batch whose same-host reads go into new caches of this many bytes or more gets those caches
# made on the prefetch thread while the previous batch computes: a new shared file's pages fault
# in at ~1.2 us each here (24 MB: ~7 ms), against ~0.1 ms for the thread handoff.
ROOM_BYTES = 1 << 20
log = logging.getLogger("nebula_flow.worker")


class KVPrep:
    """This worker's KV for its role (``store``; None: a colocated worker or an n-gram drafter)
    and the transport it moves KV over (None: no KV server)."""

    def __init__(self, role: str, store: KVStore | None, stores: list[KVStore], transport: KVTransport | None) -> None:
        self.role, self.store, self.stores, self.transport = role, store, stores, transport
        self.worker_id = 0  # this worker's id at the broker (a holder that is us needs no pull)

    def lookup(self, rid: int, role: str, start: int, end: int):  # noqa: ANN201 - KV server thread
        """What a peer asks this worker's KV server for: positions ``start:end`` of ``rid``."""
        return self.store.snapshot(rid, start, end) if self.store is not None and role == self.role else None

    def pulls(self, tasks: list[Task], local: bool | None = None) -> dict[str, list[tuple[int, np.ndarray, int]]]:
        """The KV this batch needs from peers: holder endpoint -> [(rid, tokens, valid length)].
        ``local``: only holders read from this host's memory (True), only the others (False), all (None)."""
        if self.store is None or self.transport is None:
            return {}
        by_holder: dict[str, list[tuple[int, np.ndarray, int]]] = {}
        for t in tasks:
            h = t.holder
            if h is not None and h.endpoint and h.worker != self.worker_id and h.valid > 0:
                by_holder.setdefault(h.endpoint, []).append((t.rid, t.tokens, h.valid))
        if local is None:
            return by_holder
        return {e: w for e, w in by_holder.items() if self.transport.reads_locally(e) == local}

    def room_to_make(self, tasks: list[Task]) -> dict[str, list[tuple[int, np.ndarray, int]]]:
        """This batch's same-host reads into caches not held here (by holder, as ``_pulls``),
        when they are large enough (``ROOM_BYTES``) to be worth a thread handoff."""
        store = self.store
        if store is None or store.share_folder is None:
            return {}
        room = {e: new for e, ws in self.pulls(tasks, local=True).items()
                if (new := [w for w in ws if w[0] not in store.caches])}
        positions = sum(min(valid, len(tokens) - 1) for ws in room.values() for _, tokens, valid in ws)
        return room if positions * store.row_bytes >= ROOM_BYTES else {}

    def prefetch(self, pulls: dict[str, list[tuple[int, np.ndarray, int]]],
                  room: dict[str, list[tuple[int, np.ndarray, int]]] | None = None) -> None:
        """Pull a batch's missing KV (``_pulls``) from its holders: network pulls on the prefetch
        thread (overlapping compute), same-host reads and no-overlap pulls at compute start.
        ``room`` (``_room_to_make``; on the prefetch thread, first): for large same-host reads,
        make the caches they fill and have the pages on both sides in, so that at compute start
        they are only copies."""
        store = self.store
        for endpoint, wanted in (room or {}).items():
            try:
                store.make_room(wanted)
                self.transport.prepare_reads(endpoint, [(rid, self.role, 0, min(valid, len(tokens) - 1))
                                                        for rid, tokens, valid in wanted])
            except Exception:  # only a head start: the pull at compute start does what is left
                log.exception("preparing KV reads from %s failed", endpoint)
        for endpoint, wanted in pulls.items():  # one exchange per holder for the whole batch
            try:
                store.fetch_many(self.role, wanted, endpoint, self.transport)
            except Exception:  # never let a transfer problem cost the batch: recompute instead
                log.exception("KV pull from %s failed", endpoint)
                store.stats.pull_failures += len(wanted)

    def stats(self, stall_s: float) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for store in self.stores:
            for k, v in store.stats.to_wire().items():
                if k == "by_size":
                    add_by_size(merged.setdefault(k, {}), v)
                else:
                    merged[k] = merged.get(k, 0) + v
        merged["stall_s"] = merged.get("stall_s", 0.0) + stall_s
        merged["overlap_s"] = max(0.0, merged.get("pull_s", 0.0) - merged["stall_s"])
        merged["transport"] = self.transport.scheme if self.transport else "none"
        merged["server_errors"] = getattr(self.transport, "errors", 0)
        if hasattr(self.transport, "routes"):  # shm+zmq: items read from same-host files / asked over the network
            merged["routes"] = dict(self.transport.routes)
        merged["held_requests"] = sum(len(store.caches) for store in self.stores)
        return merged
