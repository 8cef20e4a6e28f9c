"""Prompts that share their start, and the workers' prefix cache, on the simulated clock.

A simulated request's prompt is blanks unless its workload says what it shares: a Mooncake trace's
``hash_ids`` (``traces.py``: each id a block of ``HASH_BLOCK`` tokens, alike wherever the id is) or
the scenario's ``shared_prefix`` tokens of one of ``documents`` documents. Such a prompt gets token
ids (``prompt_of``): a block's tokens depend on its id alone, the rest of the prompt is the
request's own. The broker's policy then places by prefix and waits for a shared start as live
(``prefixes.py``; the scheduler is the live one), and each simulated worker keeps a prefix cache per
model (``SimPrefixCache``): a request whose KV it lacks starts from the longest prefix of its prompt
that a request held there holds (running, or finished and kept), or pulls it from the worker that
placement named (``prefix_pulls``) where that is quicker than computing it, as the live worker does.

What is simplified: a prefix counts in whole 16-token blocks (the live store copies to the token,
at most 15 more), a worker keeps the ``KEEP_FINISHED`` latest finished requests (the live store
also runs out of KV memory first where requests are long), and a copy costs no device time.
"""

from __future__ import annotations

from collections import OrderedDict

from nebula_flow.kv.store import KEEP_FINISHED
from nebula_flow.prefixes import BLOCK, chain
from nebula_flow.traces import HASH_BLOCK

OWN = -(1 << 40)  # a request's own tokens count down from here (block tokens are >= 0): never alike


def prompt_of(number: int, length: int, blocks: tuple[int, ...], shared: int) -> list[int]:
    """The token ids of request ``number``'s prompt of ``length`` tokens: its first ``shared`` are
    the tokens of ``blocks`` (``HASH_BLOCK`` each, a function of the block's id), the rest its own."""
    start = [b * HASH_BLOCK + j for b in blocks for j in range(HASH_BLOCK)][:min(shared, length)]
    own = OWN - number * (1 << 20)
    return start + [own - j for j in range(length - len(start))]


class SimPrefixCache:
    """One simulated worker's prefix cache for one model: the requests whose KV it holds (each as
    the keys of its whole blocks, ``prefixes.chain``), finished ones kept up to ``keep``, oldest
    dropped first, as ``kv/store.py`` keeps them."""

    def __init__(self, keep: int = KEEP_FINISHED) -> None:
        self.count: dict[int, int] = {}  # prefix key -> requests held here whose KV holds that prefix
        self.done: dict[int, int] = {}  # ... of them, finished ones (a pull's start copies only from these)
        self.live: dict[int, list[int]] = {}  # running request -> its keys
        self.finished: OrderedDict[int, list[int]] = OrderedDict()  # kept for prefixes, oldest first
        self.keep = keep

    def hold(self, rid: int, tokens: list[int], valid: int) -> None:
        """Request ``rid``'s KV here holds ``tokens[:valid]`` (what it held before is replaced)."""
        self._drop(self.live.pop(rid, ()))
        keys = self.live[rid] = chain(tokens, valid, None)
        for key in keys:
            self.count[key] = self.count.get(key, 0) + 1

    def finish(self, rid: int) -> None:
        """``rid`` ended: its KV is kept for prefixes; past ``keep`` finished, the oldest goes."""
        keys = self.live.pop(rid, None)
        if keys:
            self.finished[rid] = keys
            for key in keys:
                self.done[key] = self.done.get(key, 0) + 1
            while len(self.finished) > self.keep:
                gone = self.finished.popitem(last=False)[1]
                self._drop(gone)
                self._drop(gone, self.done)

    def held(self, prompt: list[int], finished_only: bool = False) -> int:
        """The positions of ``prompt`` (all but its last token, whose logits a task computes) that a
        request held here holds (``finished_only``: a finished one): whole blocks."""
        count = self.done if finished_only else self.count
        if not count:
            return 0
        keys = chain(prompt, len(prompt) - 1, None)
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in count:
                return (i + 1) * BLOCK
        return 0

    def _drop(self, keys: list[int] | tuple, count: dict[int, int] | None = None) -> None:
        count = self.count if count is None else count
        for key in keys:
            left = count[key] - 1
            if left:
                count[key] = left
            else:
                del count[key]


def report(workers: list, cached_prompt: int, prompt_tokens: int) -> dict[str, float | int | None]:
    """A result's prefix cache figures over its ``workers`` (``SimWorker``s): positions found in a
    prefix cache and pulled as a prompt's start, positions of KV that follows a request not pulled
    (a finished request's here held them), and the share of ``prompt_tokens`` cached (``cached_prompt``
    positions; None without prefix caches)."""
    return {"prefix_cached_positions": sum(w.prefix_cached for w in workers),
            "prefix_pulled_positions": sum(w.prefix_pulled for w in workers),
            "kv_pull_saved_positions": sum(w.pull_saved for w in workers),
            "prompt_cached": cached_prompt / max(1, prompt_tokens) if any(w.prefixes for w in workers) else None}
