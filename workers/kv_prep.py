"""KV preparation: which positions a batch lacks, pulling them from their holders (network pulls
on the prefetch thread while the previous batch computes, same-host reads at compute start),
and the KV counters a worker reports."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from nebula_flow.elastic import estimate
from nebula_flow.kv.link_fit import LinkFit
from nebula_flow.kv.store import KVStore, Wanted, add_by_size
from nebula_flow.kv.transport import KVTransport, endpoint_part
from nebula_flow_workers.runner import ModelRunner, Task

# A batch whose same-host reads go into new caches of this many bytes or more gets those caches
# made on the prefetch thread while the previous batch computes: a new shared file's pages fault
# in at ~1.2 us each here (24 MB: ~7 ms), against ~0.1 ms for the thread handoff.
ROOM_BYTES = 1 << 20
log = logging.getLogger("nebula_flow.worker")


def network_address(endpoint: str) -> str:
    """The part of a holder's endpoint pulls go over the network to (not its shared folder or key)."""
    return endpoint_part(endpoint, "tcp://") or endpoint_part(endpoint, "ucx://") or endpoint


Pulls = dict[tuple[str, str], list[Wanted]]  # (holder endpoint, model role) -> wanted


class KVPrep:
    """This worker's KV that moves between workers (``served``: model role -> store; a draft or a
    target worker has its one, an elastic or a colocated worker both, an n-gram drafter none),
    every store it holds (``stores``), and the transport KV moves over (None: no KV server).
    ``runners``: model role -> its runner, whose measured forward times a network pull is weighed
    against (``kv/link_fit.py``). ``one_holder``: a round task's ``holder`` holds both models' KV (a
    colocated worker's: a prompt's start another colocated worker holds), not only the draft's."""

    def __init__(self, served: dict[str, KVStore], stores: list[KVStore], transport: KVTransport | None,
                 runners: dict[str, ModelRunner | None] | None = None, one_holder: bool = False) -> None:
        self.served, self.stores, self.transport = served, stores, transport
        self.runners = runners or {}
        self.one_holder = one_holder
        self.links: dict[str, LinkFit] = {}  # network holders' endpoints -> what pulls from them take
        self.slow: set[str] = set()  # holders whose pulls were first skipped (logged once)
        self.endpoint: str | None = None  # this worker's KV server (a holder that is us needs no pull)

    def lookup(self, rid: int, role: str, start: int, end: int):  # noqa: ANN201 - KV server thread
        """What a peer asks this worker's KV server for: positions ``start:end`` of ``rid``'s ``role`` KV."""
        store = self.served.get(role)
        return store.snapshot(rid, start, end) if store is not None else None

    def pulls(self, tasks: list[Task], local: bool | None = None) -> Pulls:
        """The KV this batch needs from peers: (holder endpoint, model role) -> [(rid, tokens, valid
        length, the request whose KV holds them there, its cache_salt)]. A new request's prompt start
        held by another request's KV on a peer (``Holder.source``) is pulled unless this worker's
        prefix cache holds as much. ``local``: only holders read from this host's memory (True), only the others
        (False), all (None)."""
        if self.transport is None:
            return {}
        by_holder: Pulls = {}
        for t in tasks:
            # a task's KV by model: a draft's, a verify's, or both for a round (an elastic worker's)
            needs = {"draft": [("draft", t.holder)], "ahead": [("draft", t.holder)], "verify": [("target", t.holder)]}.get(
                t.kind, [("draft", t.holder), ("target", t.holder if self.one_holder else t.target_holder)])
            for role, h in needs:
                if role in self.served and h is not None and h.endpoint and h.endpoint != self.endpoint and h.valid > 0:
                    if h.source is not None and self.served[role].held(t.rid, t.tokens, t.params.cache_salt, None, t.prompt_len) >= min(
                            h.valid, len(t.tokens) - 1):
                        continue  # (a prefix this worker holds too)
                    valid = h.valid if h.source is None else self.served[role].prefix_valid(h, t.prompt_len)
                    if valid > 0:
                        by_holder.setdefault((h.endpoint, role), []).append(
                            (t.rid, t.tokens, valid, t.rid if h.source is None else h.source, t.params.cache_salt))
        if local is None:
            return by_holder
        return {key: w for key, w in by_holder.items() if self.transport.reads_locally(key[0]) == local}

    def room_to_make(self, tasks: list[Task]) -> Pulls:
        """This batch's same-host reads into caches not held here (keyed as ``pulls``), when they
        are large enough (``ROOM_BYTES``) to be worth a thread handoff."""
        room = {key: new for key, ws in self.pulls(tasks, local=True).items()
                if self.served[key[1]].share_folder is not None
                and (new := [w for w in ws if w[0] not in self.served[key[1]].caches])}
        nbytes = sum(min(valid, len(tokens) - 1) * self.served[role].row_bytes
                     for (_, role), ws in room.items() for _, tokens, valid, _, _ in ws)
        return room if nbytes >= ROOM_BYTES else {}

    def prefetch(self, pulls: Pulls, room: Pulls | None = None) -> None:
        """Pull a batch's missing KV (``pulls``) from its holders: network pulls on the prefetch
        thread (overlapping compute), same-host reads and no-overlap pulls at compute start.
        ``room`` (``room_to_make``; on the prefetch thread, first): for large same-host reads,
        make the caches they fill and have the pages on both sides in, so that at compute start
        they are only copies."""
        for (endpoint, role), wanted in (room or {}).items():
            try:
                self.served[role].make_room(wanted)
                self.transport.prepare_reads(endpoint, [(source, role, 0, min(valid, len(tokens) - 1))
                                                        for _, tokens, valid, source, _ in wanted])
            except Exception:  # only a head start: the pull at compute start does what is left
                log.exception("preparing KV reads from %s failed", endpoint)
        for (endpoint, role), wanted in pulls.items():  # one exchange per holder and model for the whole batch
            store = self.served[role]
            link = None if self.transport.reads_locally(endpoint) else self.links.setdefault(endpoint, LinkFit())
            skipped = store.stats.pulls_skipped
            try:
                store.fetch_many(role, wanted, endpoint, self.transport, link, self.recompute(role))
            except Exception:  # never let a transfer problem cost the batch: recompute instead
                log.exception("KV pull from %s failed", endpoint)
                store.stats.pull_failures += len(wanted)
            if store.stats.pulls_skipped > skipped and endpoint not in self.slow:  # (said once a holder)
                self.slow.add(endpoint)
                fit = link.state(time.monotonic()) or {}  # (only a measured link skips a pull)
                seen = f"{fit.get('latency_ms')} ms latency, " + (f"{fit['mbit_s']} Mbit/s" if fit.get("mbit_s") else
                                                                "its rate not shown yet")
                log.info("KV from %s is recomputed where pulling it is slower (its link measured: %s); status "
                         "counts these as pulls_skipped", network_address(endpoint), seen)

    def recompute(self, role: str) -> Callable[[int], float | None] | None:
        """The seconds a forward of that many new rows of ``role``'s model takes here (None: not
        measured yet): the batch costs its runner measured (``elastic.estimate``)."""
        runner = self.runners.get(role)
        return None if runner is None else lambda rows: estimate(runner.batch_costs.table(), rows)

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
        now, merged["links"] = time.monotonic(), {}  # (the links to holders pulled from lately, as measured)
        for endpoint, link in list(self.links.items()):
            if link.idle(now):  # (forgotten: the links of holders gone do not pile up)
                self.links.pop(endpoint, None)
            elif (fit := link.state(now)) is not None:
                merged["links"][network_address(endpoint)] = fit
        return merged
