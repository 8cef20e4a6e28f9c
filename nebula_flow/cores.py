"""Cores shared by the CPU workers of one host (``lend_cores``): a worker computes on its share of
the cores, and on the shares of workers that have sat idle a while.

Why: with one core per worker, a single stream computes on one core of two while the other
waits; with every worker on all cores, workers that compute at once oversubscribe them and
OpenMP's spinning threads collapse (docs/benchmarks.md, issue 23). A worker that claims the
idle workers' cores before each forward, and gives them back at its next forward once their
owner computes, gets all cores when it computes alone and its share when all compute.

The lease is a small file every worker of the deployment maps (one slot per worker, written
only by its owner: a slot read while its owner writes it misjudges one forward's thread count,
which costs time and never correctness), and one lock file per share. A borrower holds the lock
of each share it computes on for the forward (taken without waiting: a share it cannot lock it
does not use); an owner takes its own share's lock, waiting, for its whole batch. So an owner
that wants its share back waits out the borrower's forward (tens of milliseconds) instead of
computing beside it on oversubscribed cores, where OpenMP's spinning threads collapse (without
the wait, one measurement under load found ~11% more CPU per token; docs/benchmarks.md). A
borrower never waits while it holds a lock, so no two workers wait on each other; an owner
waits at most ``MOST_WAIT_S``, so a borrower stuck mid-forward stalls no one else. The locks are
``flock``s (per open file, so two leases of one process exclude each other too); a dead
worker's locks go with it.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# A worker idle this long lends its cores. Under load a worker's batches follow each other within
# a few milliseconds (a hop and the broker), so its cores stay its own. 0.1 s was too short: under
# 16 concurrent requests on two 1-core workers it let one borrow at times, and the requests then
# settled unevenly between the two (273 batches against 203, 0.87x the tokens/s; docs/benchmarks.md).
GRACE_S = 0.5

# The longest an owner waits for a borrower's forward on its share before it computes beside it: a
# forward takes tens of milliseconds; a borrower stuck mid-forward must not stall its lenders too.
MOST_WAIT_S = 2.0

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
    kept = sum(p.used or (0 if _lends(p, now, grace_s) else p.share) for p in peers)
    return max(share, min(most or cores, cores - kept))


def lenders(peers: list[Peer], now: float, grace_s: float = GRACE_S) -> list[int]:
    """The peers (by index) whose shares ``lease_threads`` counts as free."""
    return [i for i, p in enumerate(peers) if _lends(p, now, grace_s)]


def _lends(peer: Peer, now: float, grace_s: float) -> bool:
    """A peer lends its share when it computes nothing and has been idle ``grace_s`` or longer."""
    return not peer.used and now - peer.released >= grace_s


def make_lease_file(path: Path, slots: int) -> None:
    """The deployment's lease file: ``slots`` empty slots, one per CPU worker, and a lock file per slot."""
    path.write_bytes(bytes(SLOT.itemsize * slots))
    for slot in range(slots):
        _lock_path(str(path), slot).touch()


def _lock_path(path: str, slot: int) -> Path:
    return Path(f"{path}.{slot}.lock")


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
        self.locks = [open(_lock_path(path, i), "a+b") for i in range(len(self.slots))]  # noqa: SIM115 (held for life)
        self.held: list[int] = []  # the slots whose shares it borrows for the forward computing now
        self.borrowed = 0  # forwards computed on more than the share
        self.waited_s = 0.0  # time its batches waited for a borrower's forward to end
        self.overruns = 0  # batches that gave up waiting (MOST_WAIT_S) and computed beside a borrower
        self.threads = share  # what the worker computes on now (its torch was started with its share)

    def _peers(self) -> tuple[list[int], list[Peer]]:
        slots, peers = [], []
        for i, s in enumerate(self.slots.tolist()):  # (pid, share, used, released)
            pid, share, used, released = s
            if i == self.slot or pid == 0 or not _alive(pid):  # (a dead worker's slot lends all it had)
                continue
            slots.append(i)
            peers.append(Peer(share, used, released))
        return slots, peers

    def _give_back(self) -> None:
        for slot in self.held:
            fcntl.flock(self.locks[slot], fcntl.LOCK_UN)
        self.held = []

    def claim(self) -> int:
        """Before each forward of a batch: the threads it may use now (set on the torch of the
        thread that computes when they change). Re-claimed per forward, so a worker that borrowed
        gives the cores back at its next forward: an owner whose batch waits for them waits one
        forward."""
        self._give_back()
        now = time.monotonic()
        slots, peers = self._peers()
        if lease_threads(self.share, self.cores, peers, now, most=self.most) > self.share:
            for i in lenders(peers, now):
                if self._lock(slots[i]):
                    self.held.append(slots[i])
                else:  # (its owner starts a batch, or another worker borrows it)
                    peers[i] = replace(peers[i], used=peers[i].share)
        threads = lease_threads(self.share, self.cores, peers, now, most=self.most)
        self.mine["used"] = threads
        self.borrowed += threads > self.share
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads
        return threads

    def status(self) -> dict[str, float]:
        """For the worker's status: threads now, forwards on borrowed cores, time waited for borrowers."""
        return {"threads": self.threads, "borrowed_forwards": self.borrowed, "lease_wait_s": round(self.waited_s, 3),
                "lease_overruns": self.overruns}

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Compute one batch (its forwards ``claim``) on its own share at least: it says it
        computes (so no one starts borrowing the share), waits out a borrower's forward on it,
        and gives everything back after."""
        self.mine["used"] = self.share
        locked = self._take_own_share()
        try:
            yield
        finally:
            self._give_back()
            self.mine["released"] = time.monotonic()
            self.mine["used"] = 0
            if locked:
                fcntl.flock(self.locks[self.slot], fcntl.LOCK_UN)

    @contextmanager
    def every_core(self) -> Iterator[None]:
        """Compute on all the host's cores for a while (a start-up check): every share's lock taken,
        waiting, in slot order (so two workers starting at once take turns instead of both computing
        on all cores, where OpenMP's spinning threads collapse: two workers checking at once took
        ~10 s instead of well under one)."""
        for slot in range(len(self.locks)):
            fcntl.flock(self.locks[slot], fcntl.LOCK_EX)
        self.mine["used"] = self.cores
        try:
            yield
        finally:
            self.mine["used"] = 0
            for slot in range(len(self.locks)):
                fcntl.flock(self.locks[slot], fcntl.LOCK_UN)

    def _take_own_share(self) -> bool:
        """Lock its own share, waiting out a borrower's forward on it for up to ``MOST_WAIT_S``
        (flock has no timeout: it polls each millisecond, and only while a borrower computes)."""
        if self._lock(self.slot):
            return True
        start = time.perf_counter()
        while not (locked := self._lock(self.slot)):  # (a worker computes a forward on our share)
            if time.perf_counter() - start >= MOST_WAIT_S:
                log.warning("another worker has computed on this worker's cores for %.1f s: computing beside it",
                            MOST_WAIT_S)
                self.overruns += 1
                break
            time.sleep(0.001)
        self.waited_s += time.perf_counter() - start
        return locked

    def _lock(self, slot: int) -> bool:
        try:
            fcntl.flock(self.locks[slot], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


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
        from nebula_flow.models import probe_cache
        from nebula_flow.models.invariant import same_bits_across_threads

        invariant = [m for m in models if getattr(m, "batch_invariant", False)]
        # (ends at its share, as its torch started; kept per model shape and kernels: ``probe_cache``)
        with lease.every_core():
            same = all(probe_cache.remember("same_bits_across_threads",
                                            {**probe_cache.model_kernels(m), "counts": [lease.cores, share]},
                                            m.lm_head.weight.device,
                                            lambda m=m: same_bits_across_threads(m, [lease.cores, share]))
                       for m in invariant)
        if not same:
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
