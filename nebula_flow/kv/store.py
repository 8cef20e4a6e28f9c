"""A worker's KV caches for one model, by request id, with an LRU memory budget.

Three threads touch a store: the compute thread (``prepare``, ``evict``), the prefetch thread
(``fetch_many``: pulls a batch's missing KV while the previous batch computes) and the KV server
thread (``snapshot``: serves peers). A request is in at most one of a worker's batches at a
time, so they never work on the same cache; the lock only guards the dictionary, and
``pinned`` keeps a fetched cache from being evicted before its batch runs.

With ``prefix_cache`` a store also keeps finished requests' caches (least recently finished
dropped first, before any live cache) and gives a request that lacks positions the longest
prefix of its tokens another cache holds, copied (``prepare``): a shared system prompt, few-shot
examples, the earlier turns of a chat are computed once per worker, as vLLM's and SGLang's prefix
caches do. The copy is exact: KV at position i depends only on tokens 0..i, as pulls assume.
Only caches of requests with the same ``cache_salt`` share prefixes (none: those without one).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from nebula_flow.kv import device_copy
from nebula_flow.kv.cache import KVCache
from nebula_flow.kv.link_fit import PULL_TIMEOUT_S, LinkFit
from nebula_flow.models.llama import CausalLM

if TYPE_CHECKING:
    from nebula_flow.protocol import Holder

log = logging.getLogger("nebula_flow.kv")

# Exchanges are counted by size class (upper bounds, bytes): a bandwidth is only comparable
# with the raw transport's at the same size, and one exchange of a long prompt's whole KV moves
# as many bytes as hundreds of a round's few new positions.
SPARE_FORKS = 32  # finished requests' draft-ahead forks a store keeps for the next ones (``KVStore.branch``)
# The shortest prefix of another request's worth reusing: a chat template's few tokens are not.
MIN_SHARED = 16
# a pull: (request, its tokens, positions wanted, the request they are of there, its cache_salt)
Wanted = tuple[int, np.ndarray, int, int, str | None]
KEEP_FINISHED = 64  # finished requests' caches a prefix cache keeps at most (each is searched per new request)
PULL_SIZE_CLASSES = {"<64kB": 64 << 10, "64kB-1MB": 1 << 20, "1-16MB": 16 << 20, ">=16MB": 1 << 62}


def first_capacity(length_hint: int) -> int:
    """The positions a new cache for ``length_hint`` tokens is made with: room to grow by a quarter.
    Growing where the rows after it are taken means a new buffer and a copy of all of it (for a
    512-token prompt on the bundled target, ~25 ms in a shared file)."""
    return max(64, length_hint + length_hint // 4 + 16)


def size_class(nbytes: int) -> str:
    return next(name for name, bound in PULL_SIZE_CLASSES.items() if nbytes < bound)


def add_by_size(total: dict[str, list[float]], other: dict[str, list[float]], sign: int = 1) -> dict[str, list[float]]:
    """Add (``sign`` -1: subtract) ``KVStats.by_size`` counters ``other`` into ``total``."""
    for size, counts in other.items():
        total[size] = [a + sign * b for a, b in zip(total.get(size, [0, 0, 0.0]), counts)]
    return total


@dataclass
class KVStats:
    reused: int = 0  # positions a task found already held here
    computed: int = 0  # positions recomputed from tokens (prefill on a worker lacking them)
    pulled: int = 0  # positions received from a peer
    bytes_pulled: int = 0
    pulls: int = 0  # requests whose positions were received
    transfers: int = 0  # exchanges with holders (one per holder per batch)
    pull_failures: int = 0  # holder unreachable / evicted / mismatched: recomputed instead
    pulls_skipped: int = 0  # requests whose pull was predicted slower than recomputing (``kv/link_fit.py``): recomputed
    pull_s: float = 0.0  # time spent in pulls (prefetch thread; same-host reads at compute start)
    pull_cpu_s: float = 0.0  # CPU time of the pulling thread in them (the rest: waiting for a core, a peer, the wire)
    stall_s: float = 0.0  # time compute waited for pulls to finish
    served: int = 0  # pulls this worker answered for peers
    bytes_served: int = 0
    evicted: int = 0
    files_recycled: int = 0  # caches that got a finished request's shared file (pages already in)
    prefix_hits: int = 0  # requests given a prefix another request's cache held (prefix cache)
    prefix_reused: int = 0  # positions so copied instead of computed
    prefix_pulls: int = 0  # requests whose prompt's start was pulled from another request's KV on a peer
    prefix_pulled: int = 0  # positions so pulled instead of computed
    pull_saved: int = 0  # positions a pull did not move: a finished request's cache here held them (prefix cache)
    # size class -> [exchanges, bytes, seconds] (see PULL_SIZE_CLASSES)
    by_size: dict[str, list[float]] = field(default_factory=dict)

    def to_wire(self) -> dict:
        # (not ``asdict``: its deep copy of every field cost each RESULT tens of microseconds)
        d = dict(vars(self), by_size={size: list(counts) for size, counts in self.by_size.items()})
        d["overlap_s"] = max(0.0, self.pull_s - self.stall_s)  # pull time hidden behind compute
        return d


class KVStore:
    """Holds ``KVCache`` objects of one model; ``prepare`` rolls a cache back to what a task may reuse."""

    def __init__(self, model: CausalLM, max_bytes: int = 4 << 30, prefix_cache: bool = False) -> None:
        self.model, self.max_bytes, self.prefix_cache = model, max_bytes, prefix_cache
        model.make_kv_arena(max_bytes)  # (the caches of a batch share it: one attention call per layer)
        self.row_bytes = model.new_cache(capacity=1).row_bytes  # bytes of one position's KV
        self.caches: OrderedDict[int, KVCache] = OrderedDict()
        # draft-ahead: per request, private caches of pre-drafted outcomes (``branch``), by outcome
        self.branches: dict[int, dict[int, KVCache]] = {}
        # forks of finished requests, for the next ones: a new buffer's pages fault in as the fork's
        # rows are copied, which costs more than the copy (``SPARE_FORKS`` at most)
        self.spare: list[KVCache] = []
        self.finished: OrderedDict[int, KVCache] = OrderedDict()  # prefix cache: by when they finished
        self.finished_key: dict[int, int] = {}  # request -> its key in ``finished`` (a peer's prefix pull names it)
        self._finishes = 0
        self.copied: dict[int, int] = {}  # request -> positions copied into its cache from others' (``take_copied``)
        self.pinned: set[int] = set()
        self.lock = threading.Lock()
        self.stats = KVStats()
        self.share_folder: Path | None = None  # kv/shm.py: caches live in files peers map
        self.role = ""
        self.pool = None  # kv/shm.py FilePool: finished requests' files, for the next ones

    def share_into(self, folder: Path, role: str, pool_bytes: int | None = None) -> None:
        """Keep every cache of this store in ``folder`` for same-host peers (``kv_transport = "shm"``).
        Up to ``pool_bytes`` (default: an eighth of the budget; 0: none) of finished requests'
        files are kept for later requests (``FilePool``), beyond the caches' budget."""
        from nebula_flow.kv.shm import FilePool

        self.share_folder, self.role = Path(folder), role
        self.pool = FilePool(self.share_folder, role, max_bytes=self.max_bytes // 8 if pool_bytes is None else pool_bytes)

    def publish(self, rids: list[int]) -> None:
        """After a batch: peers reading shared caches see what these requests hold now."""
        if self.share_folder is None:
            return
        with self.lock:
            caches = [self.caches.get(rid) for rid in rids]
        for cache in caches:
            if cache is not None:
                cache.publish()

    def _get(self, rid: int, length_hint: int) -> KVCache:
        with self.lock:
            cache = self.caches.pop(rid, None)
            if cache is None:
                # A finished request's file with an eighth of room is taken first, though: it
                # has its pages in (a new file faults them in: 24 MB, ~7 ms here).
                cache = self.model.new_cache(capacity=first_capacity(length_hint))
                if self.share_folder is not None:
                    from nebula_flow.kv.shm import kv_path

                    cache.share(kv_path(self.share_folder, self.role, rid), rid, self.pool,
                                least=length_hint + length_hint // 8 + 16)
                    self.stats.files_recycled = self.pool.reused
            self.caches[rid] = cache
            return cache

    def held(self, rid: int, tokens: np.ndarray, salt: str | None = None, upto: int | None = None,
             prompt_len: int = 0) -> int:
        """How many positions of ``tokens`` ``prepare`` would keep for ``rid`` or copy from another
        request's cache of the same ``salt`` (changing nothing; pre-drafted outcomes aside)."""
        with self.lock:
            cache = self.caches.get(rid)
            keep = min(cache.common_prefix(tokens), len(tokens) - 1) if cache is not None else 0
            if upto is not None:
                return min(keep, upto)
            if self.prefix_cache and len(tokens) - 1 - keep >= MIN_SHARED:
                keep = self._longest_prefix(cache, tokens, keep, salt, prompt_len=prompt_len)[1]
            return keep

    def prepare(self, rid: int, tokens: np.ndarray, salt: str | None = None, upto: int | None = None,
                prompt_len: int = 0) -> KVCache:
        """The cache for ``rid`` (of ``cache_salt`` ``salt``, and a prompt of ``prompt_len`` tokens),
        cut to the longest prefix of ``tokens`` it holds, or that another request's cache of the same
        salt holds (the prefix cache). ``upto``: it keeps at most this many positions of its own and
        copies none (the rows after are computed again: a prompt's log-probabilities come from them).

        At least the last token is left to compute, because the step needs its logits.
        """
        cache = self._get(rid, len(tokens))
        cache.salt, cache.prompt_len = salt, prompt_len
        keep = min(cache.common_prefix(tokens), len(tokens) - 1, len(tokens) if upto is None else upto)
        cache.truncate(keep)
        copies = upto is None  # (from a pre-drafted outcome or another request: not where rows are scored again)
        for other in self.branches.get(rid, {}).values() if copies else ():  # (an outcome that happened holds more)
            keep = max(keep, _copy_rows(other, cache, tokens, keep))
        self.stats.reused += keep
        if copies and self.prefix_cache and len(tokens) - 1 - keep >= MIN_SHARED:
            start, keep = keep, self._copy_prefix(cache, tokens, keep)
            if keep > start:
                self.stats.prefix_hits += 1
                self.stats.prefix_reused += keep - start
                self._count_copied(rid, keep - start)
        self.stats.computed += len(tokens) - 1 - keep
        return cache

    @property
    def prompt_blocks(self) -> bool:
        """Whether its model computes prompt positions in blocks (``CausalLM.prompt_blocks``): then
        only positions of one form in two requests are the same bits (``same_form``)."""
        return getattr(self.model, "prompt_blocks", False)

    def prefix_valid(self, holder: Holder, prompt_len: int) -> int:
        """How many of the positions ``holder`` offers from another request's KV (a prefix pull) a
        request of prompt length ``prompt_len`` takes: with ``prompt_blocks``, those of one form in
        both (none where the source's prompt length is not known)."""
        if not self.prompt_blocks:
            return holder.valid
        return min(holder.valid, same_form(holder.source_prompt, prompt_len)) if holder.source_prompt else 0

    def _longest_prefix(self, cache: KVCache | None, tokens: np.ndarray, keep: int, salt: str | None,
                        finished_only: bool = False, prompt_len: int = 0) -> tuple[KVCache | None, int, object]:
        """The other cache of ``salt``, live or finished (``finished_only``: finished), holding the
        longest prefix of ``tokens`` beyond ``keep`` positions and of ``MIN_SHARED`` or more, how long
        that is (``keep`` where there is none), and its key (a live request's id, or ``(None, key)``
        of a finished one). Where this model computes prompts in blocks, only positions of the same
        form in both count (``same_form``; ``prompt_len``: the asking request's, where ``cache`` is
        None). Lock held."""
        asking = cache.prompt_len if cache is not None else prompt_len
        blocks = self.prompt_blocks
        head = tokens[:MIN_SHARED].tolist()
        best, most, key = None, max(keep, MIN_SHARED - 1), None
        live = () if finished_only else self.caches.items()
        # (a cache pinned now may be changing on the prefetch thread: not read)
        for rid, other in (*live, *(((None, k), c) for k, c in self.finished.items())):
            if other is cache or rid in self.pinned or other.length <= most or other.salt != salt \
                    or other.tokens[:MIN_SHARED] != head:
                continue
            n = min(other.common_prefix(tokens), len(tokens) - 1)
            if blocks:
                n = min(n, same_form(other.prompt_len, asking))
            if n > most:
                best, most, key = other, n, rid
        return best, most if best is not None else keep, key

    def _copy_prefix(self, cache: KVCache, tokens: np.ndarray, keep: int, finished_only: bool = False) -> int:
        """Copy into ``cache`` (holding ``keep`` positions of ``tokens``) the longest further prefix
        of ``tokens`` another request's cache holds (``_longest_prefix``); returns the positions
        ``cache`` holds now. ``finished_only``: from finished requests' caches alone, which nothing
        writes any more (the prefetch thread's copies: the compute thread may be writing a live one)."""
        # (held through the copy: the prefetch thread pins a cache, under this lock, before it changes it)
        with self.lock:
            best, most, key = self._longest_prefix(cache, tokens, keep, cache.salt, finished_only)
            if best is None:
                return keep
            if isinstance(key, tuple):  # (a finished request's cache that served is kept longest)
                self.finished.move_to_end(key[1])
            best.await_rows()
            return _copy_rows(best, cache, tokens, keep, most)

    def _count_copied(self, rid: int, positions: int) -> None:
        """``positions`` of ``rid``'s prompt came from other requests' KV (its usage's cached tokens)."""
        with self.lock:
            self.copied[rid] = self.copied.get(rid, 0) + positions

    def take_copied(self, rid: int) -> int:
        """The positions copied into ``rid``'s cache from other requests' since last asked."""
        with self.lock:
            return self.copied.pop(rid, 0)

    def branch(self, rid: int, outcome: int, tokens: np.ndarray) -> KVCache:
        """A private cache of ``rid`` for a pre-drafted outcome (draft-ahead), holding the longest
        prefix of ``tokens`` it or ``rid``'s own cache has (copied from there: a fork). Kept for the
        next round: ``prepare`` takes its rows when that outcome is what was committed."""
        with self.lock:
            own = self.caches[rid]
            cache = self.branches.setdefault(rid, {}).get(outcome)
            if cache is None:
                cache = self.spare.pop() if self.spare else self.model.new_cache(capacity=max(64, len(tokens) + 16))
                cache.truncate(0)
                self.branches[rid][outcome] = cache
        keep = min(cache.common_prefix(tokens), len(tokens) - 1)
        cache.truncate(keep)
        _copy_rows(own, cache, tokens, keep)
        return cache

    def make_room(self, wanted: list[Wanted]) -> None:
        """The caches a batch's pulls (``fetch_many``'s ``wanted``) go into that are not held
        yet, made now with the pages for the positions to come in: run on the prefetch thread
        while the previous batch computes, it leaves the pull at compute start only a copy.
        The caches are pinned until their batch has run (``unpin``)."""
        for rid, tokens, valid, _, _ in wanted:
            with self.lock:
                if rid in self.caches:
                    continue
                self.pinned.add(rid)
            self._get(rid, len(tokens)).prefault(min(valid, len(tokens) - 1))

    def fetch(self, rid: int, role: str, tokens: np.ndarray, valid: int, endpoint: str, transport) -> None:  # noqa: ANN001
        """``fetch_many`` for one request."""
        self.fetch_many(role, [(rid, tokens, valid, rid, None)], endpoint, transport)

    def fetch_many(self, role: str, wanted: list[Wanted], endpoint: str, transport,  # noqa: ANN001
                   link: LinkFit | None = None, recompute: Callable[[int], float | None] | None = None) -> None:
        """Pull the positions this store lacks, up to each ``valid``, of several requests held
        by the worker at ``endpoint``, in one exchange (each from the KV of its ``source`` there:
        itself, or another request's whose KV holds its prompt's start, a prefix pull).

        Only the missing suffix travels: a cache that holds a prefix keeps it, a longer stale
        suffix (rejected drafts) is rolled back first. On any failure the cache is left at what
        it verifiably holds and ``prepare`` recomputes the rest. With the holder's ``link`` (a
        network pull), a request whose pull it predicts slower than ``recompute`` (seconds to
        compute that many positions here) is recomputed instead, the pull is waited for as long
        as the link says, and its time is learned (``kv/link_fit.py``).
        """
        plan = []
        for rid, tokens, valid, source, salt in wanted:
            valid = min(valid, len(tokens) - 1)
            cache = self._get(rid, len(tokens))
            with self.lock:
                self.pinned.add(rid)
            cache.salt = salt
            have = min(cache.common_prefix(tokens), valid)
            cache.truncate(have)
            if self.prefix_cache and valid - have >= MIN_SHARED:  # (what a finished request here holds does not travel)
                start = have
                have = min(self._copy_prefix(cache, tokens, have, finished_only=True), valid)
                self.stats.pull_saved += have - start
                if source != rid:  # (a prompt's start: copied, not computed, as ``prepare`` counts it)
                    self._count_copied(rid, have - start)
            if have < valid:
                cache.reserve(valid)
                plan.append((source, tokens, have, valid, cache, rid if source != rid else None))
        timeout = PULL_TIMEOUT_S
        if link is not None and plan:
            now = time.monotonic()
            worth = link.worth([(valid - have) * cache.row_bytes for _, _, have, valid, cache, _ in plan],
                               [recompute(valid - have) if recompute else None for _, _, have, valid, _, _ in plan], now)
            self.stats.pulls_skipped += worth.count(False)
            plan = [p for p, w in zip(plan, worth) if w]
            timeout = link.deadline(sum((valid - have) * cache.row_bytes for _, _, have, valid, cache, _ in plan), now)
        if not plan:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        got = transport.pull_many(endpoint, [(source, role, have, valid, cache.buf[have:valid])
                                             for source, _, have, valid, cache, _ in plan], timeout)
        took = time.perf_counter() - t0
        device = plan[0][4].buf.device
        ready = device_copy.copied(device) if device.type == "cuda" else None  # (copies still landing)
        self.stats.pull_s += took
        self.stats.pull_cpu_s += time.thread_time() - c0
        self.stats.transfers += 1
        # (Python lists, not numpy, from here: between batches every numpy call costs tens of us)
        asked = pulled = failed = 0
        for (_, tokens, have, valid, cache, prefixed), received in zip(plan, got):
            asked += (valid - have) * cache.row_bytes
            cache.ready = ready  # (a copy that came with the wrong tokens may be landing too)
            expected = tokens[have:valid].tolist()
            if received is None or received.tolist() != expected:
                self.stats.pull_failures += 1
                failed += 1
                continue
            cache.tokens.extend(expected)
            self.stats.pulls += 1
            self.stats.pulled += valid - have
            if prefixed is not None:  # (from another request's KV: its prompt's start, as the prefix cache's copies)
                self.stats.prefix_pulls += 1
                self.stats.prefix_pulled += valid - have
                self._count_copied(prefixed, valid - have)
            pulled += (valid - have) * cache.row_bytes
        self.stats.bytes_pulled += pulled
        if failed:  # (recomputed, never silent: status counts them, the log says when and how long it was waited for)
            log.warning("KV pull from %s: %d of %d items not received (%d of %d bytes in %.2f s, waited at most "
                        "%.2f s); recomputed", endpoint, failed, len(plan), pulled, asked, took, timeout)
        if link is not None and (pulled or took >= timeout):  # (a pull given up at its deadline: a lower bound)
            link.observe(time.monotonic(), pulled or asked, took, finished=bool(pulled))
        counts = self.stats.by_size.setdefault(size_class(asked), [0, 0, 0.0])
        counts[0] += 1
        counts[1] += asked  # (an item that failed is counted: its time was spent)
        counts[2] += took

    def snapshot(self, rid: int, start: int, end: int) -> tuple[np.ndarray, torch.Tensor] | None:
        """Tokens and KV rows ``start..end`` of ``rid`` for a peer (running, or finished and kept for
        prefixes: a peer pulls a new request's prompt start from it), or None if not held."""
        with self.lock:
            cache = self.caches.get(rid)
            if cache is None and (key := self.finished_key.get(rid)) is not None:
                cache = self.finished.get(key)
        if cache is None or cache.length < end:
            return None
        cache.served_at = time.monotonic()  # (its rows are sent from its memory: see FilePool)
        self.stats.served += 1
        self.stats.bytes_served += (end - start) * cache.row_bytes
        return np.asarray(cache.tokens[start:end], dtype=np.int32), cache.export(start, end)

    def unpin(self, rids: list[int]) -> None:
        with self.lock:
            self.pinned.difference_update(rids)

    def free(self, rids: list[int], keep: bool = True) -> None:
        """These requests are done here. With a prefix cache (and ``keep``), their caches stay
        for later requests' prefixes, until memory or ``KEEP_FINISHED`` runs out."""
        with self.lock:
            for rid in rids:
                self._retire_forks(rid)
                self.copied.pop(rid, None)
                cache = self.caches.pop(rid, None)
                if cache is not None and keep and self.prefix_cache and cache.length >= MIN_SHARED:
                    self._finishes += 1
                    self.finished[self._finishes] = cache
                    self.finished_key[rid] = self._finishes
                    if len(self.finished_key) > 2 * KEEP_FINISHED:  # (those evicted since go)
                        self.finished_key = {r: k for r, k in self.finished_key.items() if k in self.finished}
                    if len(self.finished) > KEEP_FINISHED:
                        self.finished.popitem(last=False)[1].release()
                elif cache is not None:
                    cache.release()
                self.pinned.discard(rid)

    def _retire_forks(self, rid: int) -> None:
        """``rid`` is done: its forks become spares for later requests' (lock held)."""
        forks = self.branches.pop(rid, {}).values()
        self.spare = [*self.spare, *forks][-SPARE_FORKS:]

    def evict(self, protect: set[int]) -> None:
        """Drop least-recently used caches (never protected or pinned ones) until under budget."""
        with self.lock:
            def forks(rid: int) -> int:
                return sum(c.allocated_bytes for c in self.branches.get(rid, {}).values())

            held = sum(c.allocated_bytes + forks(rid) for rid, c in self.caches.items())
            held += sum(c.allocated_bytes for c in self.finished.values())
            while self.spare and held + sum(c.allocated_bytes for c in self.spare) > self.max_bytes:
                self.spare.pop(0)
            while self.finished and held > self.max_bytes:  # (finished requests' caches go first of all)
                cache = self.finished.popitem(last=False)[1]
                held -= cache.allocated_bytes
                cache.release()
            for rid in list(self.branches):  # (pre-drafted outcomes' forks go first: they only save a copy)
                if held > self.max_bytes and rid not in protect:
                    held -= forks(rid)
                    del self.branches[rid]
            for rid in list(self.caches):
                if held <= self.max_bytes:
                    return
                if rid not in protect and rid not in self.pinned:
                    cache = self.caches.pop(rid)
                    held -= cache.allocated_bytes + forks(rid)
                    self.branches.pop(rid, None)  # (not kept: memory is short)
                    cache.release()
                    self.stats.evicted += 1


def same_form(a: int, b: int) -> int:
    """How many leading positions two requests of prompt lengths ``a`` and ``b`` compute in the same
    form, where a model computes prompt positions in blocks and the rest alone (``models/rows.py``,
    ``BlockCall``): all of them for equal lengths, else those before the shorter prompt's end."""
    return sys.maxsize if a == b else min(a, b)


def _copy_rows(source: KVCache, dest: KVCache, tokens: np.ndarray, have: int, most: int = sys.maxsize) -> int:
    """Copy into ``dest`` (which holds ``have`` positions of ``tokens``) the further positions of
    ``tokens`` that ``source`` holds, all but the last and at most ``most``; returns the positions
    ``dest`` holds now."""
    upto = min(source.common_prefix(tokens), len(tokens) - 1, most)
    if upto <= have:
        return have
    dest.reserve(upto)
    dest.copy_rows(source, have, upto)
    dest.tokens.extend(tokens[have:upto].tolist())
    return upto
