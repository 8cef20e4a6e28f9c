"""Cores shared by the CPU workers of one host (``lend_cores``): a worker computes on its share of
the cores, and on the shares of workers that have sat idle a while.

Why: with one core per worker, a single stream computes on one core of two while the other
waits; with every worker on all cores, workers that compute at once oversubscribe them and
OpenMP's spinning threads collapse (docs/benchmarks.md, issue 23). A worker that claims the
idle workers' cores before each forward, and gives them back at its next forward once their
owner computes, gets all cores when it computes alone and its share when all compute.

The lease is a small file every worker of the deployment maps (one slot per worker, written
only by its owner), so it needs no lock and no messages: a slot read while its owner writes it
misjudges one forward's thread count, which costs time and never correctness. An owner that
wants its share back never waits: for the rest of the borrower's forward the cores are
oversubscribed. ``GRACE_S`` keeps that rare, but not free: under load it cost ~11% more CPU per
token (docs/benchmarks.md), so the deployment switch ``lend_cores`` is off by default. An owner
that waits out the borrower's forward (a lock per share) is the fix not yet built.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# A worker idle this long lends its cores. Under load a worker's batches follow each other within
# a few milliseconds (a hop and the broker), so its cores stay its own. 0.1 s was too short: under
# 16 concurrent requests on two 1-core workers it let one borrow at times, and the requests then
# settled unevenly between the two (273 batches against 203, 0.87x the tokens/s; docs/benchmarks.md).
GRACE_S = 0.5

SLOT = np.dtype([("pid", "<i8"), ("share", "<i4"), ("used", "<i4"), ("released", "<f8")])


@dataclass(frozen=True)
class Peer:
    """Another worker's slot as read: its share, the threads it computes on now (0: between
    batches) and when it last finished a batch."""

    share: int
    used: int
    released: float


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def lease_threads(share: int, cores: int, peers: list[Peer], now: float, grace_s: float = GRACE_S,
                  most: int | None = None) -> int:
    """How many threads a worker of ``share`` cores may compute its next forward on: its share,
    plus the cores no peer computes on or keeps (a peer idle under ``grace_s`` keeps its share),
    up to ``most`` (default: all ``cores``)."""
    kept = sum(p.used if p.used else (p.share if now - p.released < grace_s else 0) for p in peers)
    return max(share, min(most or cores, cores - kept))


def make_lease_file(path: Path, slots: int) -> None:
    """The deployment's lease file: ``slots`` empty slots, one per CPU worker."""
    path.write_bytes(bytes(SLOT.itemsize * slots))


class CoreLease:
    """One worker's side of the lease file at ``path``: its ``slot``, ``share`` cores of ``cores``."""

    def __init__(self, path: str, slot: int, share: int, cores: int,
                 set_threads: Callable[[int], None] = lambda n: None) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.slots = np.frombuffer(self._map, dtype=SLOT)
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"core lease slot {slot} is outside the file's {len(self.slots)}")
        self.slot, self.share, self.cores = slot, share, cores
        self.most = cores  # the most threads it borrows up to (its share: it computes on its share only)
        self.mine = self.slots[slot : slot + 1]  # (a view: writes go to the file)
        self.mine["share"], self.mine["used"], self.mine["released"], self.mine["pid"] = share, 0, 0.0, os.getpid()
        self.set_threads = set_threads  # (torch.set_num_threads in a worker)
        self.borrowed = 0  # forwards computed on more than the share
        self.threads = share  # what the worker computes on now (its torch was started with its share)

    def _peers(self) -> list[Peer]:
        out = []
        for i, s in enumerate(self.slots.tolist()):  # (pid, share, used, released)
            pid, share, used, released = s
            if i == self.slot or pid == 0 or not _alive(pid):  # (a dead worker's slot lends all it had)
                continue
            out.append(Peer(share, used, released))
        return out

    def claim(self) -> int:
        """Before each forward of a batch: the threads it may use now (set on the torch of the
        thread that computes when they change). Re-claimed per forward, so a worker that borrowed
        gives the cores back at its next forward once their owner computes again: the owner never
        waits, and runs beside the borrower's forward for at most one forward."""
        threads = lease_threads(self.share, self.cores, self._peers(), time.monotonic(), most=self.most)
        self.mine["used"] = threads
        self.borrowed += threads > self.share
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads
        return threads

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Compute one batch (its forwards ``claim``), and give the cores back after."""
        try:
            yield
        finally:
            self.mine["released"] = time.monotonic()
            self.mine["used"] = 0


def join_lease(path: str, slot: int, share: int, runners: list[Any], set_threads: Callable[[int], None]) -> CoreLease:
    """This worker's side of the lease, run on its compute thread: each of its model ``runners``
    claims threads before a forward (``ModelRunner.before_forward``). Where the worker's
    batch-invariant models would change a bit with the thread count it never borrows (they promise
    the same bits in every batch; a model that is not batch-invariant promises none)."""
    lease = CoreLease(path, slot, share, usable_cores(), set_threads)
    models = [r.model for r in runners]
    for runner in runners:
        if hasattr(runner, "before_forward"):  # (an n-gram drafter runs no forward)
            runner.before_forward = lease.claim
    if lease.cores > share:
        from nebula_flow.models.invariant import same_bits_across_threads

        invariant = [m for m in models if getattr(m, "batch_invariant", False)]
        # (ends at its share, as its torch started)
        if not all(same_bits_across_threads(m, m.cfg.vocab_size, [lease.cores, share]) for m in invariant):
            log.warning("batch-invariant logits change with the thread count on this CPU: computing on "
                        "%d thread(s) only, never on the cores idle workers could lend", share)
            lease.most = share
    return lease


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (someone else's process: alive)
        return True
    return True
