"""The model runner: runs a batch of draft, verify or whole-round tasks on one device.

No sockets here: the worker loop hands it decoded tasks and sends back what it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from nebula_flow import specdec
from nebula_flow.ahead import outcome_plan
from nebula_flow.budget import forward_budget, plan_forward
from nebula_flow.elastic import BatchCosts
from nebula_flow.kv import device_copy
from nebula_flow.kv.cache import KVCache
from nebula_flow.kv.store import KVStore
from nebula_flow.lookup import DEFAULT_MAX_N, DEFAULT_MIN_N, lookup_with
from nebula_flow.models import staging
from nebula_flow.models.llama import CausalLM
from nebula_flow.params import SamplingParams
from nebula_flow.penalties import Penalties
from nebula_flow.protocol import AHEAD_GUESSES, Holder
from nebula_flow.speclen import StepCosts
from nebula_flow.tree import TokenTree
from nebula_flow_workers.draft_rules import DraftRules
from nebula_flow_workers.draft_steps import DraftSteps
from nebula_flow_workers.forward_clock import ForwardClock
from nebula_flow_workers.guides import Guide, Guides
from nebula_flow_workers.logprobs import committed_logprobs, prompt_scores

log = logging.getLogger("nebula_flow.worker")


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
    target_holder: Holder | None = None  # an elastic round task: who has its target KV (``holder``: its draft KV)
    alts: int = 0  # draft / round tasks: alternatives to the first draft token wanted
    runner_ups: list[int] = field(default_factory=list)  # verify tasks: those alternatives (a two-level token tree)
    fuse: int = 0  # fuse an n-gram chain of up to this many tokens (looked up by the draft; without one, here)
    chains: list[list[int]] = field(default_factory=list)  # verify tasks: the fused chains (token tree)
    prefilled: int | None = None  # set by the runner: only a chunk of the prompt ran; the KV now held
    ahead: int = 0  # ahead tasks: the outcomes of the verify of ``draft`` to pre-draft the next round for
    logprobs: tuple[np.ndarray, np.ndarray] | None = None  # set by verify when asked: ``workers/logprobs.py``
    score_from: int = 0  # verify: the prompt's logprobs are wanted from this position on (0: none)
    # set by verify: the prompt's scored tokens' logprobs, top ids and ranks, and from where
    prompt_scores: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None
    prompt_len: int = 0  # its request's (penalties count the output apart; ``KVCache.prompt_len``)
    suppress: list[int] = field(default_factory=list)  # min_tokens: the ids it must not pick yet
    alone: bool = False  # no other stream of its broker's pool flowed when sent: it prefills whole
    steps: int = 1  # a draft-less verify: the tokens it decodes, one forward each (``nebula_flow/steps.py``)
    prediction: np.ndarray | None = None  # the client's prediction of the output: lookup chains are found in it too
    error: str | None = None  # set by the runner: this task alone failed, and why (its batch went on)

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
    steps and verify block cost on this device, for the policy's adaptive k). ``max_forward_tokens``:
    the policy's token budget of one forward (0: none); past it, prompts are prefilled in chunks
    (``max_burst_tokens``: that of a forward whose tasks all went out alone, ``budget.forward_budget``).
    ``model_dir``: the checkpoint's folder, whose tokenizer a verify of a structured output reads."""

    def __init__(self, model: CausalLM, *, proposal_top_k: int = 16, max_kv_bytes: int = 4 << 30,
                 model_dir: str | None = None, prefix_cache: bool = False) -> None:
        self.model = model
        self.store = KVStore(model, max_kv_bytes, prefix_cache)
        self.proposal_top_k = proposal_top_k
        self.busy_s = 0.0
        self.forwards = 0
        self.step_costs = StepCosts()
        self.batch_costs = BatchCosts()  # by the forward's rows in all: what an elastic worker's stages cost
        self.max_forward_tokens = self.max_burst_tokens = 0
        self.before_forward: Callable[[], object] | None = None  # (a worker's core lease claims its threads)
        self.clock = ForwardClock(model.lm_head.weight.device if isinstance(model, CausalLM) else torch.device("cpu"))
        # a target's grammar matchers for structured outputs (``workers/guides.py``), from its
        # checkpoint's tokenizer (None: it has none, or the model is emulated)
        self.guides = Guides.of(model_dir, model.cfg.vocab_size) if model_dir and isinstance(model, CausalLM) else None
        self.eos_ids = frozenset(getattr(model.cfg, "eos_token_ids", ()))  # (a multi-step decode stops there)

    def _forward(self, caches, new_tokens, rows, parents=None):  # noqa: ANN001, ANN202 - internal
        if self.before_forward is not None:
            self.before_forward()
        lengths = [1] * len(caches) if isinstance(new_tokens, torch.Tensor) else list(map(len, new_tokens))
        self.forwards += 1
        with self.clock.timing(lambda took: self._observe(took, lengths, rows)):
            return self.model(caches, new_tokens, rows, parents)

    def _observe(self, took: float, lengths: list[int], rows: list[int]) -> None:
        """A forward of ``lengths`` new tokens per sequence took ``took`` seconds on the device."""
        self.busy_s += took
        if len(lengths) == 1 and rows[0]:  # (a batch's time depends on its mix; speculation runs single-stream)
            self.step_costs.observe(lengths[0], took)
        self.batch_costs.observe(sum(lengths), took)

    def _finish(self, tasks: list[Task]) -> None:
        """After a batch's results reached the host: its forwards' times handed on, the end of its
        kernels marked for KV copies (``kv/device_copy.py``), its KV shown to peers, room made."""
        self.clock.settle()
        device_copy.batch_done(self.clock.device)
        self.store.publish([t.rid for t in tasks])
        self.store.evict(protect={t.rid for t in tasks})

    def forget_timings(self) -> None:
        """Drop the forward times measured so far (a warm-up's, ``workers/warmup.py``)."""
        self.busy_s, self.forwards = 0.0, 0
        self.step_costs, self.batch_costs = StepCosts(), BatchCosts()

    def chunk_ends(self, tasks: list[Task], held: list[int] | None = None) -> list[int | None]:
        """Under the token budget, where each task's forward stops this time: None where it runs
        whole, else the position its prompt's prefill reaches (``budget.plan_forward``). ``held``:
        the positions each task's cache keeps, where ``prepare`` has already cut them."""
        budget = forward_budget(self.max_forward_tokens, self.max_burst_tokens, [t.alone for t in tasks])
        if not budget:
            return [None] * len(tasks)
        held = held if held is not None else [self.store.held(t.rid, t.tokens, t.params.cache_salt, upto(t), t.prompt_len)
                                              for t in tasks]
        tails = [len(t.tokens) - h for t, h in zip(tasks, held)]
        plan = plan_forward(tails, [n - 1 for n in tails], budget)
        return [None if chunk is None else h + chunk for chunk, h in zip(plan, held)]

    def draft(self, tasks: list[Task], ends: list[int | None] | None = None) -> list[Draft]:
        """Propose ``task.k`` tokens per task, one forward per draft position for the batch. A task
        with an end (``chunk_ends``; by default this runner's budget) only prefills up to it, in
        the first forward, and proposes nothing (``task.prefilled``)."""
        caches = [self.store.prepare(t.rid, t.tokens, t.params.cache_salt, prompt_len=t.prompt_len) for t in tasks]
        ends = self.chunk_ends(tasks, [c.length for c in caches]) if ends is None else ends
        drafts = self._drafts(tasks, caches, ends)
        self._finish(tasks)
        return drafts

    def _drafts(self, tasks: list[Task], caches: list[KVCache], ends: list[int | None]) -> list[Draft]:
        """``draft``'s forwards, over caches already cut to what each task reuses. Each step's
        tokens feed the next forward on the device; the host reads them once, after the last
        (``DraftSteps``)."""
        new = [t.tokens[c.length:end].tolist() for t, c, end in zip(tasks, caches, ends)]
        active = [i for i, t in enumerate(tasks) if t.k > 0 and ends[i] is None]
        chunks = [i for i, end in enumerate(ends) if end is not None and new[i]]  # (in the first forward, no logits)
        steps = DraftSteps(self.model.token_ids, self.proposal_top_k, [t.params for t in tasks], [t.seed for t in tasks],
                           [len(t.tokens) for t in tasks])
        feed: list[list[int]] | torch.Tensor = [new[i] for i in active + chunks]
        rules = DraftRules.of(self.guides, tasks, self.model.head_token_ids, self.model.cfg.vocab_size) \
            if isinstance(self.model, CausalLM) else None  # (an emulated model's logits mean nothing)
        step = 0
        while active or chunks:
            logits = self._forward([caches[i] for i in active + chunks], feed, [1] * len(active) + [0] * len(chunks))
            chunks = []
            if not active:
                break
            rows = torch.cat(logits[:len(active)])
            if rules is not None:
                rules.apply(rows, active)
            if step == 0:
                steps.runner_ups(rows, active, [tasks[i].alts for i in active])
            picked = steps.choose(rows, active)
            if rules is not None:
                rules.picked(picked, active)
            step += 1
            going = [j for j, i in enumerate(active) if tasks[i].k > step and (rules is None or i not in rules.ends)]
            feed = picked if len(going) == len(active) else picked[staging.tensor(going, picked.device, torch.long)]
            active = [active[j] for j in going]
        drafts = []
        for i, (t, c, end, d) in enumerate(zip(tasks, caches, ends, steps.settle())):
            if c.length > len(t.tokens):  # (the drafted tokens fed from the device, after the committed ones)
                c.settle(len(t.tokens), d.fed[:c.length - len(t.tokens)])
            if rules is not None:
                d.tokens, d.q_idx, d.q_prob = rules.cut(i, d.tokens, d.q_idx, d.q_prob)
            drafts.append(Draft(d.tokens, d.q_idx, d.q_prob, d.runner_ups if d.tokens else []))
            if end is not None:
                t.prefilled = c.length
            elif t.fuse and (chain := fused_ngram(t.tokens, t.fuse, t.prediction)):
                drafts[-1].chains = [chain]
        return drafts

    def _drawn(self, row: torch.Tensor, t: Task, position: int) -> int:
        """The token id a sampled draft draws from ``row`` at ``position`` (``specdec.propose``)."""
        return int(self.model.token_ids(torch.tensor(specdec.propose(row, t.params, t.seed, position,
                                                                     self.proposal_top_k)[0])))

    def predraft(self, tasks: list[Task]) -> list[list[tuple[list[int], Draft]]]:
        """Draft-ahead (``nebula_flow/ahead.py``): each task carries committed tokens and the draft
        d1..dk being verified now; returns, for up to ``task.ahead`` outcomes of that verify, the
        tokens it assumes committed and the next round's draft after them, exactly the draft a
        round on those tokens makes. Outcomes, most likely first (``ahead.outcome_plan``): d1..dk
        plus this model's own next token (its guess of the bonus token), then d1..dj plus its best
        token other than d(j+1) (its guess of the target's correction) for j = 0, 1, ..., k - 1,
        then d1..dk plus its second guess of the bonus token, then its next guesses likewise. A
        first forward re-scores the draft (its rows give those guesses), then the outcomes draft
        side by side in one batch, the first in the request's cache, the others in caches forked
        from it (``KVStore.branch``). A task whose draft KV is not here is skipped (no outcomes)."""
        out: list[list[tuple[list[int], Draft]]] = [[] for _ in tasks]
        ready, caches, new = [], [], []
        for i, t in enumerate(tasks):
            full = np.concatenate([t.tokens, np.asarray(t.draft, dtype=t.tokens.dtype)])
            cache = self.store.prepare(t.rid, full, t.params.cache_salt, prompt_len=t.prompt_len)
            if cache.length + len(t.draft) + 1 < len(t.tokens):  # (the holder's KV did not come: not worth a prefill)
                continue
            cache.truncate(min(cache.length, len(t.tokens) - 1))  # (the last committed token's row scores d1)
            ready.append(i)
            caches.append(cache)
            new.append(full[cache.length:].tolist())
        if not ready:
            return out
        rows = self._forward(caches, new, [len(tasks[i].draft) + 1 for i in ready])
        # every row's most likely token ids, read on the host once for the batch
        best = torch.topk(torch.cat(rows), min(AHEAD_GUESSES, rows[0].shape[-1])).indices
        best = self.model.token_ids(best).tolist()
        subtasks, subcaches, owners, at = [], [], [], 0
        for i, cache, scores in zip(ready, caches, rows):
            t, d = tasks[i], list(tasks[i].draft)
            mine, at = best[at:at + len(d) + 1], at + len(d) + 1
            guess = mine[len(d)][0] if t.params.greedy else self._drawn(scores[len(d)], t, len(t.tokens) + len(d))
            # the draft's guesses of the target's token after j accepted: after a rejection its best
            # tokens other than the rejected d(j+1); after the whole draft, its own next token first
            guesses = [[x for x in mine[j] if x != d[j]] for j in range(len(d))]
            guesses.append([guess, *(x for x in mine[len(d)] if x != guess)])
            outcomes = [d[:j] + [guesses[j][r - 1]] for j, r in outcome_plan(len(d), t.ahead) if r <= len(guesses[j])]
            for b, assumed in enumerate(outcomes):
                tokens = np.concatenate([t.tokens, np.asarray(assumed, dtype=t.tokens.dtype)])
                subtasks.append(Task(t.rid, "draft", t.round, t.attempt, tokens, t.k, t.params, t.seed,
                                     alts=t.alts, fuse=t.fuse, prompt_len=t.prompt_len, suppress=t.suppress))
                subcaches.append(cache if b == 0 else self.store.branch(t.rid, b, tokens))
                owners.append((i, assumed))
        for (i, assumed), d in zip(owners, self._drafts(subtasks, subcaches, [None] * len(subtasks))):
            out[i].append((assumed, d))
        self._finish(tasks)
        return out

    def verify(self, tasks: list[Task], ends: list[int | None] | None = None) -> list[list[int] | None]:
        """Score each task's drafts (a chain, or a token tree: alternatives, fused chains) in one
        forward; returns the committed tokens per task. A task with an end (``chunk_ends``; by
        default this runner's budget) only prefills up to it, in the same forward: None for it
        (``task.prefilled``). A draft-less task of several ``steps`` then decodes on, a forward
        of its batch's such tasks at a time, each pick the next forward's input, until it has
        that many tokens or picked an id that ends its output (``nebula_flow/steps.py``)."""
        out = self._verify(tasks, ends)
        going = [i for i, (t, c) in enumerate(zip(tasks, out)) if c is not None and t.steps > 1 and not self._ends(t, c)]
        while going:
            steps = [replace(tasks[i], tokens=np.concatenate([tasks[i].tokens, np.asarray(out[i], dtype=np.int64)]),
                             steps=1, score_from=0) for i in going]
            failed = set()
            for i, c in zip(going, self._verify(steps)):
                if c is None:  # (that step failed alone: it stops there, the tokens before it stand)
                    failed.add(i)
                else:
                    out[i] += c
            going = [i for i in going if i not in failed and len(out[i]) < tasks[i].steps
                     and not self._ends(tasks[i], out[i])]
        return out

    def _ends(self, t: Task, committed: list[int]) -> bool:
        """Whether ``committed``'s last token ends ``t``'s output (an EOS id of the model's
        config, unless ignored, or a stop token id): the broker cuts there anyway."""
        last = committed[-1]
        return last in t.params.stop_token_ids or (not t.params.ignore_eos and last in self.eos_ids)

    def _verify(self, tasks: list[Task], ends: list[int | None] | None = None) -> list[list[int] | None]:
        """One forward of ``verify``'s."""
        caches = [self.store.prepare(t.rid, t.tokens, t.params.cache_salt, upto(t), t.prompt_len) for t in tasks]
        for t in tasks:  # a round without a draft: the chain is looked up here
            if t.fuse and not t.draft and not t.chains and (chain := fused_ngram(t.tokens, t.fuse, t.prediction)):
                t.chains = [chain]
        trees = [t.tree() for t in tasks]
        ends = self.chunk_ends(tasks, [c.length for c in caches]) if ends is None else ends
        new = [t.tokens[c.length:].tolist() + tree.tokens if end is None else t.tokens[c.length:end].tolist()
               for t, c, tree, end in zip(tasks, caches, trees, ends)]
        # a tree's rows follow the uncommitted tail; node p's parent row is the tail's length plus p
        # (the root, -1, is the last committed token's row)
        parents = [None if tree.is_chain() or end is not None else
                   [*range(-1, len(n) - len(tree) - 1), *(len(n) - len(tree) + p for p in tree.parents)]
                   for tree, n, end in zip(trees, new, ends)]
        ran = [i for i, n in enumerate(new) if n]  # (a prompt whose chunk waits this time: not in the forward)
        # the prompt's tokens to score (``prompt_logprobs``): from the one after the cached, the first rows
        scoring = {i: (caches[i].length + 1, n) for i in ran
                   if (n := prompt_rows(tasks[i], caches[i].length, ends[i])) > 0}
        logits = dict(zip(ran, self._forward([caches[i] for i in ran], [new[i] for i in ran],
                                             [len(new[i]) if i in scoring else 0 if ends[i] is not None
                                              else 1 + len(trees[i]) for i in ran],
                                             [parents[i] for i in ran]))) if ran else {}
        for i, (at, n) in scoring.items():
            t = tasks[i]
            t.prompt_scores = (*prompt_scores(logits[i][:n], t.tokens[at:at + n], t.params.prompt_logprobs), at)
            if ends[i] is None:
                logits[i] = logits[i][len(new[i]) - 1 - len(trees[i]):]  # (the verify's rows)
        best = dict(zip(ran, greedy_picks([logits[i] for i in ran], [ends[i] is None and tasks[i].params.greedy
                                                                      and not tasks[i].params.penalized for i in ran])))
        out: list[list[int] | None] = []
        for i, (t, c, tree) in enumerate(zip(tasks, caches, trees)):
            if ends[i] is not None:
                t.prefilled = c.length
                out.append(None)
                continue
            try:
                out.append(self._commit(t, c, tree, logits[i], best.get(i)))
            except Exception as exc:  # noqa: BLE001 - one request's failure (its grammar, say) fails it alone
                log.warning("request %d's verify failed: %s", t.rid, exc, exc_info=not isinstance(exc, ValueError))
                t.error = f"{type(exc).__name__}: {exc}"
                c.truncate(len(t.tokens))  # (its scored rows dropped: the cache holds what it committed before)
                out.append(None)
        self._finish(tasks)
        return out

    def _commit(self, t: Task, c: KVCache, tree: TokenTree, logits: torch.Tensor, best: list[int] | None) -> list[int]:
        """What ``t``'s verify commits from its rows' ``logits``, the accepted path's KV kept."""
        guide = None if t.params.structured is None else self._guide(t)
        committed = specdec.verify(logits, t.draft, t.q_idx, t.q_prob, t.params, t.seed, len(t.tokens),
                                   t.runner_ups, t.chains, best=best,
                                   penalties=Penalties.of(t.params, t.tokens, t.prompt_len, t.suppress, guide))
        position, path = len(t.tokens), tree.path(committed[:-1])
        if t.params.logprobs is not None:
            t.logprobs = committed_logprobs(logits, path, committed, t.params.logprobs)
        # keep the KV of the accepted path (moved into place when it is not the first chain's)
        c.adopt([position + node for node in path], position)
        return committed

    def _guide(self, t: Task) -> Guide:
        if self.guides is None:  # (``tasks.runnable`` refuses such a task first)
            raise ValueError("this worker's model has no tokenizer.json: it cannot follow a grammar")
        return self.guides.guide(t.rid, t.params, t.tokens[t.prompt_len:].tolist(), prompt=t.tokens[:t.prompt_len])


def prompt_rows(t: Task, cached: int, end: int | None) -> int:
    """How many of ``t``'s prompt tokens a forward from position ``cached`` (to ``end``; None: all
    its tokens) scores: row j of it predicts position ``cached + j + 1``, and a prompt's last row
    predicts the output's first token. 0 unless the broker asks (``score_from``)."""
    if not t.score_from:
        return 0
    return min(len(t.tokens) if end is None else end, t.prompt_len - 1) - cached


def upto(t: Task) -> int | None:
    """The positions of ``t``'s KV a forward may start from: those before the first prompt row it
    must score (``KVStore.prepare``), or any (None)."""
    return t.score_from - 1 if t.score_from else None


def greedy_picks(logits: list[torch.Tensor], greedy: list[bool]) -> list[list[int] | None]:
    """Each greedy sequence's rows' argmax, taken for all of them in one call and brought to the
    host once (on a GPU one sync per forward, not one per sequence); None for the others. On a
    CPU each sequence's rows where they lie: joining them copied every row's logits (a 19-row
    token tree's 3.7 MB of a 49,152-token vocabulary: ~1 ms, most of a verify's host work)."""
    rows = [x for x, g in zip(logits, greedy) if g]
    if not rows:
        return [None] * len(logits)
    if rows[0].device.type == "cpu":
        flat = [pick for x in rows for pick in specdec.argmax_ids(x)]
    else:
        flat = specdec.argmax_ids(torch.cat(rows))
    picks, start = [], 0
    for x, g in zip(logits, greedy):
        picks.append(flat[start:start + len(x)] if g else None)
        start += len(x) if g else 0
    return picks


def fused_ngram(tokens: np.ndarray, k: int, prediction: np.ndarray | None = None) -> list[int]:
    """An n-gram chain of up to k tokens to verify beside a round's draft (a token tree), or []
    when the context has no match (``lookup.lookup_with``: in the client's ``prediction`` too, where
    it gave one). It depends on the committed tokens alone, never on the draft:
    a chain dropped for being a prefix of the draft (rejected tokens included) made the policy's
    next plan depend on draft draws the output never showed, and those draws come again at the
    same positions next round, which biases sampling. (A chain that is a prefix of the draft adds
    no row: the tree shares its nodes.)"""
    return lookup_with(np.asarray(tokens), prediction, k, DEFAULT_MIN_N, DEFAULT_MAX_N)[0]
