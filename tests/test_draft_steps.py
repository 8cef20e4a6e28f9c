"""A batch's draft steps stay on the device (``workers/draft_steps.py``): the drafts are the ones
a step-by-step host loop makes, and the host reads the steps' choices once per batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nebula_flow import specdec
from nebula_flow.kv.cache import PENDING
from nebula_flow.models.config import ModelConfig
from nebula_flow.models.llama import CausalLM
from nebula_flow.params import SamplingParams
from nebula_flow.tiny import init_target, tiny_config
from nebula_flow_workers import draft_steps
from nebula_flow_workers.draft_steps import DraftSteps
from nebula_flow_workers.runner import ModelRunner, Task

GREEDY = SamplingParams(max_new_tokens=8)
WARM = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95)
SHARP = SamplingParams(max_new_tokens=8, temperature=0.6, top_k=5)


def _draft_model(head: int | None = None, seed: int = 5) -> CausalLM:
    """A tiny random draft; ``head``: its output head cut to that many token ids (a reduced head)."""
    cfg = dict(tiny_config(64, 2, 0), max_position_embeddings=128)
    if head:
        cfg["draft_head_size"] = head
    model = CausalLM(ModelConfig.from_dict(cfg))
    init_target(model, torch.Generator().manual_seed(seed))
    if head:
        model.head_token_ids = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:head].sort().values
    model.make_batch_invariant()  # (a row's logits the same alone and in a batch: drafts compare bit for bit)
    return model.eval()


def _alone(model: CausalLM, t: Task, top_k: int) -> tuple[list[int], list | None, list | None, list[int]]:
    """The reference: one sequence drafted step by step, each step's token read on the host and
    drawn by ``specdec.propose``, as every draft was made before the steps stayed on the device."""
    cache = model.new_cache()
    feed, tokens, q_idx, q_prob, alts = t.tokens.tolist(), [], [], [], []
    for step in range(t.k):
        row = model([cache], [feed], [1])[0][0]
        tok, idx, prob = specdec.propose(row, t.params, t.seed, len(t.tokens) + step, top_k)
        tok = int(model.token_ids(torch.tensor(tok)))
        if idx is not None:
            q_idx.append(model.token_ids(torch.from_numpy(idx)).to(torch.int32).numpy())
            q_prob.append(prob)
        if step == 0 and t.alts:
            alts = [x for x in model.token_ids(torch.topk(row, t.alts + 1).indices).tolist() if x != tok][:t.alts]
        tokens.append(tok)
        feed = [tok]
    return tokens, None if t.params.greedy else q_idx, None if t.params.greedy else q_prob, alts


def _tasks() -> list[Task]:
    g = torch.Generator().manual_seed(1)
    specs = [(GREEDY, 4, 0), (WARM, 4, 2), (SHARP, 2, 0), (GREEDY, 6, 1), (WARM, 0, 0), (SHARP, 5, 1), (WARM, 6, 0)]
    return [Task(rid, "draft", 1, 1, torch.randint(1, 64, (5 + 3 * rid,), generator=g).numpy(), k, params, 100 + rid,
                 alts=alts) for rid, (params, k, alts) in enumerate(specs)]


@pytest.mark.parametrize("head", [None, 40])
def test_a_mixed_batch_drafts_what_each_sequence_drafts_alone_step_by_step(head: int | None) -> None:
    """Greedy and sampled rows (two kinds of sampling), k from 0 to 6, runner-ups, a reduced
    head: token for token, proposal for proposal, the drafts of the host loop; and each cache
    then holds the tokens its KV was computed from (none left ``PENDING``)."""
    model = _draft_model(head)
    runner = ModelRunner(model, proposal_top_k=8)
    tasks = _tasks()
    drafts = runner.draft(tasks)
    for t, d in zip(tasks, drafts):
        tokens, q_idx, q_prob, alts = _alone(_draft_model(head), t, 8)
        assert d.tokens == tokens and d.runner_ups == alts, t.rid
        if q_idx is None:
            assert d.q_idx is None and d.q_prob is None
        else:
            assert len(d.q_idx) == len(q_idx) == t.k
            for a, b, c, e in zip(d.q_idx, q_idx, d.q_prob, q_prob):
                assert np.array_equal(a, b) and np.array_equal(c, e) and a.dtype == np.int32
        cache = runner.store.prepare(t.rid, np.concatenate([t.tokens, tokens]).astype(np.int64))
        assert PENDING not in cache.tokens
        assert cache.length == (len(t.tokens) + t.k - 1 if t.k else 0)  # (the last token's KV is not computed)


class Counted(torch.Tensor):
    """A tensor on an emulated device that counts the host's reads of it (each a synchronisation
    with a real device)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__int__,
                    torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.__array__):
            cls.reads += 1
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture
def device_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device's argmax, which stays on it (on a CPU ``specdec.argmax`` takes numpy's: a read of
    host memory, which waits for nothing)."""
    monkeypatch.setattr(specdec, "argmax", lambda logits: logits.argmax(-1))


@pytest.mark.usefixtures("device_argmax")
def test_the_host_reads_a_batchs_draft_once_whatever_its_k() -> None:
    """Logits on an emulated device: a batch's draft steps read nothing on the host until the
    last, and then once, for k = 1 and k = 6 alike (they read every step's token before: k
    synchronisations, and one more per sampled row per step)."""
    def reads(k: int) -> int:
        model = _draft_model(40)
        forward = model.forward
        model.forward = lambda *a, **kw: [x.as_subclass(Counted) for x in forward(*a, **kw)]
        tasks = _tasks()
        for t in tasks:  # (top-p sorts with numpy where scores live on the host, as an emulated device's do)
            t.k, t.alts, t.params = k, 1, SHARP if not t.params.greedy else t.params
        Counted.reads = 0
        drafts = ModelRunner(model, proposal_top_k=8).draft(tasks)
        assert all(len(d.tokens) == k for d in drafts)
        return Counted.reads

    assert reads(1) == reads(6) == 1


def test_a_draw_the_host_does_not_repeat_ends_the_draft_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a device's fp64 rounding drew another place than ``specdec.draw`` would, the draft
    keeps only the steps before it (a shorter draft verifies exactly); the KV's tokens stay the
    ones computed."""
    real = draft_steps.device_draw
    calls = []

    def off_at_third_step(q_prob: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        picks = real(q_prob, u)
        return (picks + 1) % (q_prob > 0).sum(-1) if len(calls) == 3 else picks

    monkeypatch.setattr(draft_steps, "device_draw", off_at_third_step)
    model = _draft_model()
    runner = ModelRunner(model, proposal_top_k=8)
    task = Task(0, "draft", 1, 1, np.arange(1, 9), 5, WARM, 7)
    (d,) = runner.draft([task])
    want = _alone(_draft_model(), task, 8)
    assert d.tokens == want[0][:2] and len(d.q_idx) == len(d.q_prob) == 2
    # the KV holds the committed tokens and the first two drafted; its third was computed from the
    # device's token, not the host's
    assert runner.store.held(0, np.concatenate([task.tokens, want[0]])) == 10


def test_a_step_without_a_distribution_ends_that_draft_alone() -> None:
    """A sampled row whose logits turn NaN (a model overflowing in its dtype) has no proposal: its
    draft ends before that step (the verify decides the round, as after any short draft), and the
    other sequences of the batch draft as they would alone."""
    steps = DraftSteps(lambda rows: rows, 8, [WARM, WARM], [1, 2], [3, 4])
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        logits = torch.randn(2, 16, generator=g)
        if step == 1:
            logits[0] = torch.nan
        steps.choose(logits, [0, 1])
    broken, fine = steps.settle()
    assert len(broken.tokens) == len(broken.q_idx) == 1 and broken.tokens == broken.fed[:1]
    assert len(fine.tokens) == len(fine.q_prob) == 3 and fine.tokens == fine.fed


def test_device_draw_is_the_hosts_draw() -> None:
    """The device's inverse-CDF draw picks the place ``specdec.draw`` picks, zeros and all."""
    g = torch.Generator().manual_seed(4)
    q_prob = torch.rand(200, 8, generator=g).sort(-1, descending=True).values
    q_prob[::3, 5:] = 0.0
    u = torch.tensor([specdec.uniform(9, i, specdec.STREAM_DRAFT) for i in range(200)], dtype=torch.float64)
    picks = draft_steps.device_draw(q_prob, u).tolist()
    ids = np.arange(8, dtype=np.int32)
    for i, pick in enumerate(picks):
        assert pick == specdec.draw(ids, q_prob[i].numpy(), 9, i)[0]


def test_draft_steps_of_no_rows_settle_to_empty_drafts() -> None:
    steps = DraftSteps(lambda rows: rows, 8, [GREEDY, WARM], [1, 2], [3, 4])
    assert [(d.tokens, d.q_idx) for d in steps.settle()] == [([], None), ([], [])]


@pytest.mark.usefixtures("device_argmax")
def test_draft_ahead_reads_its_guesses_and_its_drafts_once_each() -> None:
    """Pre-drafting (``ModelRunner.predraft``) on an emulated device: the guesses of every
    outcome come to the host in one read, the outcomes' drafts in one more, whatever k and however
    many outcomes (up to the draft's fourth guesses: 3k + 4)."""
    def reads(k: int, ahead: int = 6) -> int:
        model = _draft_model(40)
        runner = ModelRunner(model, proposal_top_k=8)
        tasks = [t for t in _tasks() if t.params.greedy]
        for t in tasks:
            t.k = k
        for t, d in zip(tasks, runner.draft(tasks)):
            t.draft, t.ahead = d.tokens, ahead
        forward = model.forward
        model.forward = lambda *a, **kw: [x.as_subclass(Counted) for x in forward(*a, **kw)]
        Counted.reads = 0
        outcomes = runner.predraft(tasks)
        assert all(len(o) == min(ahead, 3 * k + 4) and all(len(d.tokens) == k for _, d in o) for o in outcomes)
        return Counted.reads

    assert reads(2) == reads(5) == reads(4, 16) == reads(2, 16) == 2
