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
8, ... blocks, at every ``EVERY``-th block (a shared start is known to within that many blocks:
a 1,500-token system prompt as 1,408 tokens, not 1,024) and at its last whole block (the next turn
of a chat continues all of it); least recently learnt keys go first. A request's ``cache_salt``
seeds its chain, so requests of different salts never look alike here, as workers never share
their KV (``kv/store.py``). A guess is never a
rule: a worker that left, or one that has since evicted the KV, costs only the prefill the placement
hoped to save.

A prompt is learnt only once its KV is held, so requests that arrive together (a burst of questions
on a new document, n choices of one long prompt) would each compute their shared start. So a new
request whose prompt shares enough of the prompt of a request still being computed waits for that
request's first tokens (``PrefixRoutes.leader``, the policy's ``wait_for_prefix``), then starts
where that KV is held, copying or pulling it (``learnt``). SGLang's in-batch prefix caching does
the same within one batch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nebula_flow.request import Request
    from nebula_flow.scheduler import Scheduler

BLOCK = 16  # tokens per key step: the shortest prefix a worker reuses (kv/store.py MIN_SHARED)
MAX_KEYS = 1 << 16  # (a few MB of the broker's memory)
EVERY = 8  # blocks between a request's keys past the first EVERY (besides those at 1, 2, 4, ... blocks)
MIN_WAIT = 4 * BLOCK  # the shortest shared start worth waiting for (computing fewer tokens costs next to nothing)
ROLES = ("target", "draft", "colocated")  # the holder keys placement looks at


def chain(tokens: Sequence[int], upto: int, salt: str | None) -> list[int]:
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
        self.where: OrderedDict[tuple[str, int], tuple[int, int, int]] = OrderedDict()  # -> (worker, request, its prompt's length)
        self.max_keys = max_keys
        # requests whose prompt is being computed: each whole block's key -> (the first such request, the
        # tokens it computes, its priority); and the requests waiting for each (``leader``): rid -> [(rid, shared tokens)]
        self.computing: dict[int, tuple[int, int, int]] = {}
        self.computing_keys: dict[int, list[int]] = {}
        self.followers: dict[int, list[tuple[int, int]]] = {}

    def place(self, req: Request, alive: Collection[int], share: float) -> bool:
        """A new request: where its prompt's start is likely held (``req.affinity``: ``find``), and the
        request whose prompt is being computed that it waits for (``req.waits_for``: ``leader``).
        Returns whether it waits."""
        keys = chain(req.prompt, len(req.prompt) - 1, req.params.cache_salt)
        req.affinity = self.find(req, alive, keys=keys)
        req.waits_for = self.leader(req, share, keys)
        return req.waits_for is not None

    def leader(self, req: Request, share: float, keys: list[int]) -> int | None:
        """The request whose prompt is being computed that new request ``req`` (its prompt's ``keys``)
        waits for: one whose prompt's start ``req``'s shares, beyond what ``req``'s placement found held
        already (``Request.affinity``), ``MIN_WAIT`` tokens and at least ``share`` of what that request
        computes, and that is at least as urgent (a lower ``priority`` number, or the same: an urgent
        request never waits behind a queued background one); None: ``req`` starts now (and its prompt
        is being computed, for requests that arrive after it)."""
        held = max((where[1] for where in req.affinity.values()), default=0)
        for i in range(len(keys) - 1, -1, -1) if share > 0 else ():
            if (found := self.computing.get(keys[i])) is not None:
                shared = (i + 1) * BLOCK
                if shared - held >= max(MIN_WAIT, share * found[1]) and found[2] <= req.params.priority:
                    self.followers.setdefault(found[0], []).append((req.rid, shared))
                    return found[0]
                break
        # (what it computes: its prompt less what is held; one that comes with output, resumed, is
        # learnt only as it ends: none waits for it)
        if len(keys) * BLOCK - held >= MIN_WAIT and not req.output:
            for key in keys:
                self.computing.setdefault(key, (req.rid, len(req.prompt) - held, req.params.priority))
            self.computing_keys[req.rid] = keys
        return None

    def waiting(self, pool: Collection[int]) -> int:
        """How many requests of ``pool`` (request ids) wait for another's first tokens (``leader``):
        counted over the waiting, not the pool (status and /metrics ask it every scrape)."""
        return sum(rid in pool for waiting in self.followers.values() for rid, _ in waiting)

    def learn(self, req: Request) -> None:
        """``req``'s holders (holder key -> (worker, positions held)) hold its tokens' KV: at its first
        tokens (its prompt's is held) and as it ends."""
        for key in self.computing_keys.pop(req.rid, ()):
            if self.computing.get(key, (None,))[0] == req.rid:
                del self.computing[key]
        tokens = req.prompt + req.output
        for role, (worker, valid) in req.holders.items():
            keys = chain(tokens, valid, req.params.cache_salt)
            marks = {len(keys) - 1, *(2 ** i - 1 for i in range(len(keys).bit_length())),
                     *range(EVERY - 1, len(keys), EVERY)}
            for i in sorted(m for m in marks if m >= 0):
                self.where[(role, keys[i])] = (worker, req.rid, len(req.prompt))
                self.where.move_to_end((role, keys[i]))
        while len(self.where) > self.max_keys:
            self.where.popitem(last=False)

    def find(self, req: Request, alive: Collection[int], roles: Sequence[str] = ROLES,
             keys: list[int] | None = None) -> dict[str, tuple[int, int, int, int]]:
        """Per holder key of ``roles``: the worker among ``alive`` whose KV likely holds the longest
        prefix of ``req``'s prompt (all but its last token, whose logits its first task computes),
        that prefix's length, the request whose KV it was and that request's prompt length (a worker
        that computes prompts in blocks pulls only positions of one form: ``kv/store.same_form``);
        keys with none known are left out
        (``Request.affinity``; ``keys``: its prompt's, where known)."""
        found: dict[str, tuple[int, int, int, int]] = {}
        if not self.where:
            return found
        keys = keys if keys is not None else chain(req.prompt, len(req.prompt) - 1, req.params.cache_salt)
        for role in roles:
            for i in range(len(keys) - 1, -1, -1):
                worker, rid, prompt_len = self.where.get((role, keys[i]), (None, 0, 0))
                if worker is not None and worker in alive:
                    found[role] = (worker, (i + 1) * BLOCK, rid, prompt_len)
                    break
        return found


def learnt(scheduler: Scheduler, req: Request) -> None:
    """``req``'s KV holds its prompt now (its first tokens, or it ended): the scheduler's ``prefixes``
    learns where, and the requests that waited for it (``PrefixRoutes.leader``) start, each placed where
    ``req``'s KV is (the shared start's positions, and ``req`` as the source a worker pulls it from)
    unless its own placement found as much held already."""
    if scheduler.prefixes is None:
        return
    scheduler.prefixes.learn(req)
    for rid, shared in scheduler.prefixes.followers.pop(req.rid, ()):
        if (follower := scheduler.requests.get(rid)) is None:  # (cancelled while it waited)
            continue
        for role, (worker, valid) in req.holders.items():
            if role in ROLES and min(shared, valid) > follower.affinity.get(role, (0, 0))[1]:
                follower.affinity[role] = (worker, min(shared, valid), req.rid, len(req.prompt))
        follower.waits_for = None
        scheduler.start(follower)
