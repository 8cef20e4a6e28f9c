"""Speculative decoding math: determinism, greedy rules, and exactness of sampled output."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nebula_flow import specdec
from nebula_flow.models.config import ModelConfig
from nebula_flow.models.llama import CausalLM
from nebula_flow.params import SamplingParams
from nebula_flow.tiny import init_target, tiny_config
from nebula_flow.tree import TokenTree
from nebula_flow_workers.runner import ModelRunner, Task


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Chi-square quantile at p = 0.001 (Wilson-Hilferty). Seeds are fixed: no flakiness."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * a**0.5) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token the target gives probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_uniform_is_a_pure_function_in_range() -> None:
    a = [specdec.uniform(7, pos, s) for pos in range(200) for s in (1, 2, 3)]
    assert a == [specdec.uniform(7, pos, s) for pos in range(200) for s in (1, 2, 3)]
    assert all(0.0 <= u < 1.0 for u in a)
    assert len(set(a)) == len(a)
    assert specdec.uniform(8, 0, 1) != specdec.uniform(7, 0, 1)
    assert abs(np.mean(a) - 0.5) < 0.05


def test_target_probs_applies_temperature_top_k_top_p() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = specdec.target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p[0, :2].sum(), torch.tensor(1.0, dtype=torch.float64))
    p = specdec.target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits.double(), -1)[0]
    assert full[0] < 0.7 < full[0] + full[1]
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    cold = specdec.target_probs(logits, SamplingParams(temperature=0.1))
    assert cold[0, 0] > 0.99


def test_min_p_drops_what_is_less_likely_than_min_p_times_the_best_before_top_k_and_top_p() -> None:
    """vLLM's min-p: at the temperature, a token whose probability is below ``min_p`` times the most
    likely one's is dropped; then top-k and top-p see what is left (vLLM's order)."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)) * 1.5
    full = (logits.double() / 0.8).softmax(-1)
    got = specdec.target_probs(logits, SamplingParams(temperature=0.8, min_p=0.1))
    kept = full >= 0.1 * full.max(-1, keepdim=True).values
    assert torch.equal(got > 0, kept) and 1 < int(kept.sum(-1).min()) < 300
    assert torch.allclose(got, (full * kept) / (full * kept).sum(-1, keepdim=True))
    both = specdec.target_probs(logits, SamplingParams(temperature=0.8, min_p=0.1, top_p=0.8))
    renormed = (full * kept) / (full * kept).sum(-1, keepdim=True)  # (top-p over what min-p left)
    for r in range(5):
        order = torch.argsort(renormed[r], descending=True)
        need = int((renormed[r][order].cumsum(0) < 0.8).sum()) + 1
        assert set(torch.nonzero(both[r]).flatten().tolist()) == set(order[:need].tolist())
    assert torch.equal(specdec.target_probs(logits, SamplingParams(temperature=0.8, min_p=1.0)) > 0,
                       full == full.max(-1, keepdim=True).values)


@pytest.mark.parametrize("top_k", [0, 50])
def test_top_p_keeps_the_smallest_set_over_p_whichever_sort_runs(top_k: int) -> None:
    """On a CPU top-p sorts with numpy (faster there than torch): the rows are torch's sort's bit for bit."""
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=top_k)
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(1)) * 4
    got = specdec.target_probs(logits, params)
    scores = logits.double() / 0.7
    if top_k:
        scores = scores.masked_fill(scores < torch.topk(scores, top_k).values[..., -1:], float("-inf"))
    ordered, order = torch.sort(scores)
    drop = ordered.softmax(-1).cumsum(-1) <= 0.1
    drop[..., -1] = False
    assert torch.equal(got, scores.masked_fill(drop.scatter(-1, order, drop), float("-inf")).softmax(-1))
    kept = got > 0
    full = scores.softmax(-1)
    assert ((full * kept).sum(-1) > 0.9).all()  # the kept tokens hold at least p, the most likely of them
    assert all(full[r][kept[r]].min() >= full[r][~kept[r]].max() for r in range(6))


def test_a_sampled_verify_of_non_finite_logits_fails_with_a_clear_error() -> None:
    """No distribution, no output: a NaN or infinite target row fails its request (alone, in the
    worker) with what went wrong, not with an index error deep in the sampler."""
    params = SamplingParams(temperature=1.0)
    for bad in (math.nan, math.inf):
        logits = torch.zeros(2, 10)
        logits[0, 3] = bad
        with pytest.raises(ValueError, match="target model's probabilities are not finite"):
            specdec.verify(logits, [3], None, None, params, 0, 0)
    draft = np.full(4, np.nan, dtype=np.float32)
    with pytest.raises(ValueError, match="draft model's probabilities are not finite"):
        specdec.draw(np.arange(4, dtype=np.int32), draft, 0, 0)


def test_draws_of_many_rows_at_once_are_the_draws_one_by_one() -> None:
    """``draw_rows`` picks, bit for bit, the place ``draw`` picks for each row: proposals of every
    width, sharp and flat, cut short (a top-p's zeros last), without a distribution (NaN, all
    zeros: -1), and with zeros or NaN between positive entries (no top-k gives these)."""
    rng = np.random.default_rng(1)
    rows = 0
    for _ in range(300):
        n, width = int(rng.integers(1, 40)), int(rng.choice([1, 2, 5, 8, 16, 20, 33, 64]))
        q = np.sort(rng.random((n, width)).astype(np.float32) ** rng.integers(1, 20), -1)[:, ::-1].copy()
        q /= q.sum(-1, keepdims=True)
        for i in range(n):
            r = rng.random()
            if r < 0.3:
                q[i, rng.integers(1, width + 1):] = 0
            elif r < 0.45:
                q[i, rng.integers(0, width)] = (np.nan, 0)[int(r < 0.4)]
            elif r < 0.5:
                q[i] = (np.nan, 0)[int(r < 0.48)]
        seeds, positions = rng.integers(0, 2**62, n).tolist(), rng.integers(0, 5000, n).tolist()
        got = specdec.draw_rows(q, seeds, positions).tolist()
        want = [specdec.draw(np.arange(width), q[i], seeds[i], positions[i])[0] if (q[i] > 0).any() else -1
                for i in range(n)]
        assert got == want
        rows += n
    assert rows > 5000 and specdec.draw_rows(np.zeros((0, 4), np.float32), [], []).tolist() == []


def test_greedy_verify_accepts_the_matching_prefix_and_corrects() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 1.0
    greedy = SamplingParams()
    assert specdec.verify(logits, [3, 5, 7], None, None, greedy, 0, 0) == [3, 5, 7, 9]  # all + bonus
    assert specdec.verify(logits, [3, 6, 7], None, None, greedy, 0, 0) == [3, 5]  # correction
    assert specdec.verify(logits[:1], [], None, None, greedy, 0, 0) == [3]  # no draft: plain decode


def test_greedy_verify_with_alternatives_to_the_first_draft_token() -> None:
    """Rows 0..3 score the chain, rows 4 and 5 follow alternatives 8 and 3 to its first token."""
    logits = torch.full((6, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9, 1, 4]):
        logits[row, best] = 1.0
    greedy = SamplingParams()
    assert specdec.verify(logits, [3, 5, 6], None, None, greedy, 0, 0, [8, 2]) == [3, 5, 7]  # the chain wins
    assert specdec.verify(logits, [6, 5, 7], None, None, greedy, 0, 0, [8, 3]) == [3, 4]  # runner_ups 3, then row 5
    assert specdec.verify(logits, [6, 5, 7], None, None, greedy, 0, 0, [3, 8]) == [3, 1]  # runner_ups 3, then row 4
    assert specdec.verify(logits, [6, 5, 7], None, None, greedy, 0, 0, [8, 2]) == [3]  # no candidate: correction
    # Sampled: the target all but certain of 3 then 4, the draft sure of 6 (q a point): 6 is rejected,
    # the runner-up 3 accepted under the residual, and the bonus token follows it (row 2).
    peaked = torch.full((3, 10), -30.0)
    peaked[0, 3] = peaked[2, 4] = 30.0
    sampled = SamplingParams(temperature=1.0)
    for seed in range(20):
        assert specdec.verify(peaked, [6], [np.array([6])], [np.array([1.0])], sampled, seed, 0, [3]) == [3, 4]
        assert specdec.verify(peaked, [6], [np.array([6])], [np.array([1.0])], sampled, seed, 0) == [3]  # (no tree)


def test_a_token_tree_merges_chains_that_share_a_prefix() -> None:
    tree = TokenTree([[3, 5, 6], [8], [3, 5, 7, 1], [3, 5, 6, 2], [9, 9]])
    assert tree.tokens == [3, 5, 6, 8, 7, 1, 2, 9, 9]
    assert tree.parents == [-1, 0, 1, -1, 1, 4, 2, -1, 7]
    assert tree.path([3, 5, 7, 1, 4]) == [0, 1, 4, 5] and tree.path([4]) == []
    assert TokenTree([[3, 5, 6], [3, 5]]).is_chain() and not tree.is_chain()


def test_greedy_verify_walks_a_fused_chain_as_far_as_the_target_agrees() -> None:
    """Draft [3, 5, 6] and a fused chain [3, 5, 7, 1] share 3, 5: tree rows follow the root, then
    nodes 3, 5, 6, 7, 1 (the fused chain's own nodes come after the draft's)."""
    logits = torch.full((6, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 0, 1, 4]):  # after root, 3, 5, 6, 7, 1
        logits[row, best] = 1.0
    greedy = SamplingParams()
    # the target picks 7 after 3, 5: the fused chain carries the round past the draft, and one more
    assert specdec.verify(logits, [3, 5, 6], None, None, greedy, 0, 0, (), [[3, 5, 7, 1]]) == [3, 5, 7, 1, 4]
    logits[2] = -1.0
    logits[2, 6] = 1.0  # now the target picks 6: the draft wins
    assert specdec.verify(logits, [3, 5, 6], None, None, greedy, 0, 0, (), [[3, 5, 7, 1]]) == [3, 5, 6, 0]


def test_rejection_sampling_with_truncated_proposal_follows_the_target() -> None:
    """One draft position, q cut to its top 3 of 6 tokens: the committed token follows p."""
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(2, 6, generator=g) * 1.5
    draft_logits = torch.randn(6, generator=g) * 1.5
    params = SamplingParams(temperature=1.0)
    p = specdec.target_probs(target_logits[:1], params)[0].numpy()
    counts = np.zeros(6)
    accepted = 0
    for seed in range(20000):
        tok, q_idx, q_prob = specdec.propose(draft_logits, params, seed, 10, proposal_top_k=3)
        assert tok in q_idx.tolist()
        out = specdec.verify(target_logits, [tok], [q_idx], [q_prob], params, seed, 10)
        counts[out[0]] += 1
        accepted += len(out) == 2
    assert 0 < accepted < 20000  # both paths ran
    assert chi_square(counts, p) < chi2_critical(5)


def _tiny_vocab_model(seed: int, layers: int) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(dict(tiny_config(8, layers, 0), max_position_embeddings=64)))
    init_target(model, torch.Generator().manual_seed(seed))
    return model.eval()


@pytest.mark.parametrize(("params", "fuse", "alts"), [
    (SamplingParams(temperature=0.8, max_new_tokens=2), 0, 0),
    (SamplingParams(temperature=1.0, top_p=0.9, top_k=6, max_new_tokens=2), 0, 0),
    (SamplingParams(temperature=0.8, max_new_tokens=2), 4, 0),
    (SamplingParams(temperature=1.0, top_p=0.9, top_k=6, max_new_tokens=2), 4, 0),
    (SamplingParams(temperature=1.0, top_p=0.9, top_k=6, max_new_tokens=2), 0, 2),
    (SamplingParams(temperature=1.0, min_p=0.2, max_new_tokens=2), 4, 2),
    (SamplingParams(temperature=0.8, max_new_tokens=2), 4, 2)])
def test_speculative_sampling_with_real_models_follows_the_target(params: SamplingParams, fuse: int,
                                                                  alts: int) -> None:
    """A tiny-vocabulary pair (independent random draft): the first two committed tokens of
    many seeded requests follow the target's exact two-token distribution (chi-square). With
    ``fuse``, a prompt-lookup chain is verified beside each draft (a token tree sampled by
    recursive rejection), and some rounds commit tokens only the chain had. With ``alts``, the
    draft's runner-ups to the token it drew are verified beside it, and some rounds commit one."""
    target, draft = _tiny_vocab_model(1, 2), _tiny_vocab_model(2, 1)
    # (a repeat: a chain to look up; there the target also often picks the draft's second runner-up)
    prompt = np.array([1, 2, 3] if not (fuse or alts) else [1, 2, 3, 1, 2], dtype=np.int64)
    with torch.no_grad():
        cache = target.new_cache()
        first = specdec.target_probs(target([cache], [prompt.tolist()], [1])[0], params)[0]
        exact = np.zeros((8, 8))
        for a in range(8):
            c = target.new_cache()
            row = target([c], [prompt.tolist() + [a]], [1])[0]
            exact[a] = first[a].item() * specdec.target_probs(row, params)[0].numpy()
    t_run, d_run = ModelRunner(target, proposal_top_k=4), ModelRunner(draft, proposal_top_k=4)
    n = 6000
    outputs: dict[int, list[int]] = {rid: [] for rid in range(n)}
    by_chain = by_alt = 0  # rounds whose committed path went through the chain's own nodes, a runner-up
    for _ in range(2):  # at most two rounds are needed for two tokens
        tasks = [Task(rid, "draft", 1, 1, np.concatenate([prompt, outputs[rid]]).astype(np.int64), 3, params, rid,
                      fuse=fuse, alts=alts) for rid in range(n) if len(outputs[rid]) < 2]
        if not tasks:
            break
        for start in range(0, len(tasks), 500):
            batch = tasks[start:start + 500]
            for t, d in zip(batch, d_run.draft(batch)):
                t.draft, t.q_idx, t.q_prob, t.chains, t.runner_ups = d.tokens, d.q_idx, d.q_prob, d.chains, d.runner_ups
                assert len(t.runner_ups) == alts and t.draft[0] not in t.runner_ups
            for t, committed in zip(batch, t_run.verify(batch)):
                outputs[t.rid].extend(committed)
                path = t.tree().path(committed[:-1])
                by_alt += len(path) > 0 and committed[0] in t.runner_ups
                by_chain += any(node >= len(t.draft) for node in path) and committed[0] not in t.runner_ups
    assert (by_chain > 100) == bool(fuse), by_chain
    assert (by_alt > 100) == bool(alts), by_alt
    counts = np.zeros((8, 8))
    for toks in outputs.values():
        counts[toks[0], toks[1]] += 1
    df = int((exact > 0).sum()) - 1
    assert chi_square(counts.flatten(), exact.flatten() / exact.sum()) < chi2_critical(df)


def test_rounds_with_a_fused_ngram_chain_give_the_targets_greedy_output() -> None:
    """A draft and a target runner run whole greedy rounds with runner-ups and a fused n-gram
    chain (an 8-token vocabulary repeats itself, so the chain often matches): the output is the
    target's own greedy output, and some rounds commit more than the draft had (the fused chain
    won, its KV moved into place for the next rounds)."""
    target, draft = _tiny_vocab_model(1, 2), _tiny_vocab_model(2, 1)
    t_run, d_run = ModelRunner(target), ModelRunner(draft)
    greedy = SamplingParams(max_new_tokens=60)
    for rid, prompt in enumerate(([1, 2, 3, 1, 2], [5, 5, 6, 7, 0, 5])):
        with torch.no_grad():
            cache, ref = target.new_cache(), list(prompt)
            logits = target([cache], [ref], [1])[0]
            for _ in range(60):
                ref.append(int(torch.argmax(logits[0])))
                logits = target([cache], [[ref[-1]]], [1])[0]
        out, fused_won = list(prompt), 0
        while len(out) < len(prompt) + 60:
            task = Task(rid, "draft", 1, 1, np.array(out, dtype=np.int64), 3, greedy, 0, alts=1, fuse=8)
            [d] = d_run.draft([task])
            task.draft, task.runner_ups, task.chains = d.tokens, d.runner_ups, d.chains
            [committed] = t_run.verify([task])
            chain = next((i for i, (a, b) in enumerate(zip(d.tokens, committed)) if a != b), len(d.tokens))
            fused_won += len(committed) - 1 > chain and committed[0] not in d.runner_ups
            out.extend(committed)
        assert out[:len(ref)] == ref[:len(out)]
        assert fused_won > 0


class OnDevice(torch.Tensor):
    """A tensor that behaves at the host boundary as one on an accelerator does: ``.numpy()``
    (and numpy's ``__array__``) raise unless ``.cpu()`` brought it to the host first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func in (torch.Tensor.numpy, torch.Tensor.__array__):
            raise RuntimeError("can't convert a device tensor to numpy; use .cpu() first")
        if func is torch.Tensor.cpu:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {})).as_subclass(torch.Tensor)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_host_contract_nothing_reads_device_logits_as_numpy() -> None:
    """Sampled drafts, verifies (with runner-ups and a fused chain) and pre-drafts run on logits
    that live on a device (emulated: ``OnDevice``) and give what they give on host logits."""
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95)
    row = torch.randn(64, generator=torch.Generator().manual_seed(0))
    assert specdec.propose(row.as_subclass(OnDevice), sampled, 7, 3, 8)[0] == specdec.propose(row, sampled, 7, 3, 8)[0]
    with pytest.raises(RuntimeError, match="device tensor"):
        row.as_subclass(OnDevice).numpy()  # (the guard guards)

    def rounds(on_device: bool) -> list[list[int]]:
        target, draft = _tiny_vocab_model(1, 2), _tiny_vocab_model(2, 1)
        for model in (target, draft) if on_device else ():
            forward = model.forward
            model.forward = lambda *a, _f=forward, **k: [x.as_subclass(OnDevice) for x in _f(*a, **k)]
        t_run, d_run = ModelRunner(target, proposal_top_k=4), ModelRunner(draft, proposal_top_k=4)
        tasks = [Task(rid, "draft", 1, 1, np.array([1, 2, 3, 1, 2], dtype=np.int64), 3, sampled, rid, fuse=4, alts=1)
                 for rid in range(8)]
        for t, d in zip(tasks, d_run.draft(tasks)):
            t.draft, t.q_idx, t.q_prob, t.chains, t.runner_ups = d.tokens, d.q_idx, d.q_prob, d.chains, d.runner_ups
        return t_run.verify(tasks)

    assert rounds(on_device=True) == rounds(on_device=False)


def test_greedy_picks_take_every_greedy_rows_argmax_at_once() -> None:
    from nebula_flow_workers.runner import greedy_picks

    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(n, 50, generator=g) for n in (1, 5, 3, 2)]
    picks = greedy_picks(logits, [True, False, True, True])
    assert picks[1] is None
    for x, pick in zip(logits, picks):
        if pick is not None:
            assert pick == [int(torch.argmax(row)) for row in x]
    assert greedy_picks(logits, [False] * 4) == [None] * 4


def test_the_host_contract_a_forwards_host_made_tensors_reach_the_device_without_waiting() -> None:
    """``torch.tensor(..., device=d)`` and ``.to(d)`` copy from pageable memory, which on a GPU
    waits for every queued kernel: the forward's and the draft steps' code stages its host-made
    tensors through ``models.staging`` instead."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = [root / "nebula_flow" / "models" / f for f in ("batch.py", "rows.py", "llama.py", "graphs.py")]
    files += [root / "workers" / f for f in ("draft_steps.py", "runner.py")]
    waits = re.compile(r"torch\.tensor\([^\n]*device=|\.to\((self\.)?device\)|\.copy_\(torch\.tensor")
    offenders = [f"{f.name}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
                 if waits.search(line)]
    assert not offenders, offenders


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_is_torch_s_first_of_equal_maxima_in_every_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=g).to(dtype)
    logits[1, 17] = logits[1, 400] = logits[1].max() + 1  # ties: the first wins
    logits[2] = 0.0  # a flat row: index 0
    logits[3, 250] = float("inf")
    logits[4, 9] = float("nan")  # (a NaN row: torch's argmax takes the NaN)
    for rows in (logits, logits[::2], logits[:, 100:], logits[5]):  # strided views and one row
        got = specdec.argmax(rows)
        assert got.dtype == torch.long and torch.equal(got, rows.argmax(-1))
    assert specdec.argmax(logits)[1] == 17
