"""Which worker's prefix cache likely holds the start of a new request's tokens: cache-aware placement.

A worker keeps finished requests' KV and starts a request from the longest prefix of its tokens
it holds (``kv/store.py``), so a chat's next turn or another question about the same document
costs a prefill only where it lands on the worker that computed the prefix. The scheduler learns,
as each request's first tokens are committed (its prompt's KV is held: requests that start alike
while it runs find it) and as it ends, which worker holds its tokens' KV for each model, and
asks, as each request arrives, where the longest prefix of its prompt is held: paired, colocated
and elastic binding weigh the prefill that worker would save (``roles.Binder``), and a pooled request's first tasks
stay with that worker while it is busy, as with any holder (``locality``), taken by any idle one.
SGLang's router and vLLM's prefix-aware routing do the same across instances.

Pure (no sockets, no clock). Tokens are hashed a block at a time, each block's hash chained to
the one before it, so a key stands for a whole prefix. A finished request leaves keys at 1, 2, 4,
8, ... blocks and at its last whole block (the next turn of a chat continues all of it); least
recently learnt keys go first. A request's ``cache_salt`` seeds its chain, so requests of different
salts never look alike here, as workers never share their KV (``kv/store.py``). A guess is never a
rule: a worker that left, or one that has since evicted the KV, costs only the prefill the placement
hoped to save.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nebula_flow.request import Request

BLOCK = 16  # tokens per key step: the shortest prefix a worker reuses (kv/store.py MIN_SHARED)
MAX_KEYS = 1 << 16  # (a few MB of the broker's memory)


def _chain(tokens: Sequence[int], upto: int, salt: str | None) -> list[int]:
    """The key of each whole block of ``tokens[:upto]``: key i stands for the first (i + 1) blocks
    (and ``salt``, the request's ``cache_salt``)."""
    keys, key = [], 0 if salt is None else hash(salt)
    for start in range(0, upto - BLOCK + 1, BLOCK):
        key = hash((key, *tokens[start:start + BLOCK]))
        keys.append(key)
    return keys


class PrefixRoutes:
    """(holder key, prefix key) -> the worker that last held that prefix of that model's KV, and the
    request whose KV it was (a worker that lacks it pulls it from there: ``broker/tasks.py``)."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.where: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()
        self.max_keys = max_keys

    def learn(self, req: Request) -> None:
        """``req`` ended: its holders (holder key -> (worker, positions held)) hold its tokens' KV."""
        tokens = req.prompt + req.output
        for role, (worker, valid) in req.holders.items():
            keys = _chain(tokens, valid, req.params.cache_salt)
            marks = {len(keys) - 1, *(2 ** i - 1 for i in range(len(keys).bit_length()))}
            for i in sorted(m for m in marks if m >= 0):
                self.where[(role, keys[i])] = (worker, req.rid)
                self.where.move_to_end((role, keys[i]))
        while len(self.where) > self.max_keys:
            self.where.popitem(last=False)

    def find(self, req: Request, alive: Collection[int],
             roles: Sequence[str] = ("target", "draft", "colocated")) -> dict[str, tuple[int, int, int]]:
        """Per holder key of ``roles``: the worker among ``alive`` whose KV likely holds the longest
        prefix of ``req``'s prompt (all but its last token, whose logits its first task computes),
        that prefix's length and the request whose KV it was; keys with none known are left out
        (``Request.affinity``)."""
        found: dict[str, tuple[int, int, int]] = {}
        if not self.where:
            return found
        keys = _chain(req.prompt, len(req.prompt) - 1, req.params.cache_salt)
        for role in roles:
            for i in range(len(keys) - 1, -1, -1):
                worker, rid = self.where.get((role, keys[i]), (None, 0))
                if worker is not None and worker in alive:
                    found[role] = (worker, (i + 1) * BLOCK, rid)
                    break
        return found
