"""The model runner: runs a batch of draft, verify or whole-round tasks on one device.

No sockets here: the worker loop hands it decoded tasks and sends back what it returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from nebula_flow import specdec
from nebula_flow.kv.store import KVStore
from nebula_flow.lookup import DEFAULT_MAX_N, DEFAULT_MIN_N, lookup
from nebula_flow.models.llama import CausalLM
from nebula_flow.params import SamplingParams
from nebula_flow.protocol import Holder
from nebula_flow.speclen import StepCosts
from nebula_flow.tree import TokenTree


@dataclass
class Task:
    """A task ready to run: a ``protocol.TaskSpec`` checked against this worker's model."""

    rid: int
    kind: str
    round: int
    attempt: int
    tokens: np.ndarray
    k: int
    params: SamplingParams
    seed: int
    draft: list[int] = field(default_factory=list)
    q_idx: list[np.ndarray] | None = None
    q_prob: list[np.ndarray] | None = None
    holder: Holder | None = None  # who has this role's KV (None: nobody; a local evaluation)
    alts: int = 0  # draft / round tasks: alternatives to the first draft token wanted
    runner_ups: list[int] = field(default_factory=list)  # verify tasks: those alternatives (a two-level token tree)
    fuse: int = 0  # fuse an n-gram chain of up to this many tokens (looked up by the draft; without one, here)
    chains: list[list[int]] = field(default_factory=list)  # verify tasks: the fused chains (token tree)

    def tree(self) -> TokenTree:
        """The token tree this verify scores: the draft, the alternatives and the fused chains."""
        return TokenTree([self.draft, *([a] for a in self.runner_ups), *self.chains])


@dataclass
class Draft:
    tokens: list[int]
    q_idx: list[np.ndarray] | None
    q_prob: list[np.ndarray] | None
    runner_ups: list[int] = field(default_factory=list)  # the draft's next choices for the first token
    chains: list[list[int]] = field(default_factory=list)  # other drafters' chains fused in (token tree)


class ModelRunner:
    """One model plus its KV store. ``busy_s`` accumulates time spent in forward passes;
    ``step_costs`` times its forwards of one sequence by their new rows (what a round's draft
    steps and verify block cost on this device, for the policy's adaptive k)."""

    def __init__(self, model: CausalLM, *, proposal_top_k: int = 16, max_kv_bytes: int = 4 << 30) -> None:
        self.model = model
        self.store = KVStore(model, max_kv_bytes)
        self.proposal_top_k = proposal_top_k
        self.busy_s = 0.0
        self.forwards = 0
        self.step_costs = StepCosts()

    def _forward(self, caches, new_tokens, rows, parents=None):  # noqa: ANN001, ANN202 - internal
        t0 = time.perf_counter()
        out = self.model(caches, new_tokens, rows, parents)
        took = time.perf_counter() - t0
        self.busy_s += took
        self.forwards += 1
        if len(caches) == 1:  # (a batch's time depends on its mix; speculation runs single-stream)
            self.step_costs.observe(len(new_tokens[0]), took)
        return out

    def draft(self, tasks: list[Task]) -> list[Draft]:
        """Propose ``task.k`` tokens per task, one forward per draft position for the batch."""
        caches = [self.store.prepare(t.rid, t.tokens) for t in tasks]
        drafts = [Draft([], None if t.params.greedy else [], None if t.params.greedy else []) for t in tasks]
        new = [t.tokens[c.length:].tolist() for t, c in zip(tasks, caches)]
        active = [i for i, t in enumerate(tasks) if t.k > 0]
        step = 0
        while active:
            logits = self._forward([caches[i] for i in active], [new[i] for i in active], [1] * len(active))
            for i, row in zip(active, logits):
                t = tasks[i]
                tok, q_idx, q_prob = specdec.propose(row[0], t.params, t.seed, len(t.tokens) + step, self.proposal_top_k)
                if self.model.head_token_ids is not None:  # a reduced draft head: rows -> token ids
                    tok = int(self.model.head_token_ids[tok])
                    if q_idx is not None:
                        q_idx = self.model.token_ids(torch.from_numpy(q_idx)).to(torch.int32).numpy()
                if step == 0 and t.alts:  # runner-ups to the first token (token tree): to the token drawn, if sampled
                    ranked = torch.topk(row[0], min(t.alts + 1, row.shape[-1])).indices
                    if self.model.head_token_ids is not None:
                        ranked = self.model.token_ids(ranked)
                    drafts[i].runner_ups = [x for x in ranked.tolist() if x != tok][: t.alts]
                drafts[i].tokens.append(tok)
                if q_idx is not None:
                    drafts[i].q_idx.append(q_idx)
                    drafts[i].q_prob.append(q_prob)
                new[i] = [tok]
            step += 1
            active = [i for i in active if tasks[i].k > step]
        for t, d in zip(tasks, drafts):
            if t.fuse and (chain := fused_ngram(t.tokens, t.fuse, d.tokens)):
                d.chains = [chain]
        self.store.publish([t.rid for t in tasks])
        self.store.evict(protect={t.rid for t in tasks})
        return drafts

    def verify(self, tasks: list[Task]) -> list[list[int]]:
        """Score each task's drafts (a chain, or a token tree: alternatives, fused chains) in one
        forward; returns the committed tokens per task."""
        caches = [self.store.prepare(t.rid, t.tokens) for t in tasks]
        for t in tasks:  # a round without a draft: the chain is looked up here
            if t.fuse and not t.draft and not t.chains and (chain := fused_ngram(t.tokens, t.fuse, [])):
                t.chains = [chain]
        trees = [t.tree() for t in tasks]
        new = [t.tokens[c.length:].tolist() + tree.tokens for t, c, tree in zip(tasks, caches, trees)]
        # a tree's rows follow the uncommitted tail; node p's parent row is the tail's length plus p
        # (the root, -1, is the last committed token's row)
        parents = [None if tree.is_chain() else [*range(-1, len(n) - len(tree) - 1),
                                                 *(len(n) - len(tree) + p for p in tree.parents)]
                   for tree, n in zip(trees, new)]
        logits = self._forward(caches, new, [1 + len(tree) for tree in trees], parents)
        out = []
        for t, c, rows, tree in zip(tasks, caches, logits, trees):
            committed = specdec.verify(rows, t.draft, t.q_idx, t.q_prob, t.params, t.seed, len(t.tokens), t.runner_ups, t.chains)
            position = len(t.tokens)
            # keep the KV of the accepted path (moved into place when it is not the first chain's)
            c.adopt([position + node for node in tree.path(committed[:-1])], position)
            out.append(committed)
        self.store.publish([t.rid for t in tasks])
        self.store.evict(protect={t.rid for t in tasks})
        return out


def fused_ngram(tokens: np.ndarray, k: int, draft: list[int]) -> list[int]:
    """An n-gram chain of up to k tokens to verify beside ``draft`` (a round's token tree),
    or [] when the context has no match or the match adds nothing (it is a prefix of the draft)."""
    chain, _ = lookup(np.asarray(tokens), k, DEFAULT_MIN_N, DEFAULT_MAX_N)
    return [] if chain == draft[:len(chain)] else chain
