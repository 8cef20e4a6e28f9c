"""A worker's KV caches for one model, by request id, with an LRU token budget."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from nebula_flow.kv.cache import KVCache
from nebula_flow.models.llama import CausalLM


@dataclass
class KVStats:
    reused: int = 0  # positions a task found already held
    computed: int = 0  # positions recomputed from tokens (prefill on a non-holder)
    evicted: int = 0  # caches dropped for the budget


class KVStore:
    """Holds ``KVCache`` objects of one model; ``prepare`` rolls a cache back to what a task may reuse."""

    def __init__(self, model: CausalLM, max_tokens: int = 1 << 20) -> None:
        self.model, self.max_tokens = model, max_tokens
        self.caches: OrderedDict[int, KVCache] = OrderedDict()
        self.stats = KVStats()

    def prepare(self, rid: int, tokens: np.ndarray) -> KVCache:
        """The cache for ``rid``, cut to the longest prefix of ``tokens`` it holds.

        At least the last token is left to compute, because the step needs its logits.
        """
        cache = self.caches.pop(rid, None) or self.model.new_cache(capacity=max(64, len(tokens) + 16))
        keep = min(cache.common_prefix(tokens), len(tokens) - 1)
        cache.truncate(keep)
        self.caches[rid] = cache
        self.stats.reused += keep
        self.stats.computed += len(tokens) - 1 - keep
        return cache

    def free(self, rids: list[int]) -> None:
        for rid in rids:
            self.caches.pop(rid, None)

    def held_tokens(self) -> int:
        return sum(c.length for c in self.caches.values())

    def evict(self, protect: set[int]) -> None:
        """Drop least-recently used caches (never those in ``protect``) until under budget."""
        for rid in list(self.caches):
            if self.held_tokens() <= self.max_tokens:
                return
            if rid not in protect:
                del self.caches[rid]
                self.stats.evicted += 1
