"""Prompts in aligned blocks: where a CPU's attention kernel gives no run of rows the bits of each
row alone (``rows.run_block`` None, as on the 2-core AMD EPYC hosts), a batch-invariant model
computes a request's prompt positions in blocks of ``BUCKET`` positions (``rows.BlockCall``) and
every other position alone. A prompt position then has the same bits whole, in chunks, beside
other sequences and at any thread count, and the positions after the prompt keep decoding's bits.
The runs are turned off here by hand, so this holds on hosts whose kernels allow runs too."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from nebula_flow.client import Client
from nebula_flow.deploy import Deployment
from nebula_flow.kv.store import KVStore, same_form
from nebula_flow.models.loader import load_model
from nebula_flow.models.rows import BUCKET, RowPlan
from nebula_flow.params import SamplingParams
from nebula_flow.prefixes import PrefixRoutes
from nebula_flow.protocol import Holder
from nebula_flow.request import Request
from tests.conftest import deploy_config
from tests.test_chunked_prefill import _generate, long_prompts


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def model(request, tiny_pair):  # noqa: ANN001, ANN201
    m = load_model(tiny_pair / "target", dtype=request.param, batch_invariant=True)
    m.run_block = None  # (no runs: prompts in blocks, whatever this host's kernels allow)
    assert m.prompt_blocks
    return m


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT, EXTRA = _ids(2 * BUCKET + 11, 1), _ids(5, 2)  # (two whole blocks and part of a third)


def _prefill(model, chunks: list[int], beside: bool = False, threads: int | None = None):  # noqa: ANN001, ANN202
    """The prompt's KV and its last logits, computed in ``chunks`` (then decoding ``EXTRA``'s logits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        cache = model.new_cache()
        cache.prompt_len = len(PROMPT)
        at = 0
        for n in chunks:
            if beside:  # (a ragged batch: another request's prompt in the same forward)
                other = model.new_cache()
                other.prompt_len = 9
                last = model([other, cache], [_ids(9, 5), PROMPT[at:at + n]], [1, 1])[1]
            else:
                last = model([cache], [PROMPT[at:at + n]], [1])[0]
            at += n
        kv = cache.buf[:len(PROMPT)].clone()
        decoded = torch.cat([model([cache], [[t]], [1])[0] for t in EXTRA])
        return kv, last, decoded
    finally:
        torch.set_num_threads(before)


def test_a_prompt_has_the_same_bits_whole_in_chunks_beside_others_and_at_any_thread_count(model) -> None:  # noqa: ANN001
    whole = _prefill(model, [len(PROMPT)])
    n = len(PROMPT)
    for name, got in (("chunks of 16", _prefill(model, [16] * (n // 16) + [n % 16])),
                      ("chunks across blocks", _prefill(model, [5, 30, n - 35])),
                      ("beside another sequence", _prefill(model, [n], beside=True)),
                      ("one thread", _prefill(model, [n], threads=1)),
                      ("two threads", _prefill(model, [n], threads=2))):
        for part, a, b in zip(("prompt KV", "last logits", "decoded logits"), whole, got):
            assert torch.equal(a, b), f"{part} differ {name}"


def test_positions_after_the_prompt_keep_decodings_bits(model) -> None:  # noqa: ANN001
    """A verify block, and a prefill of prompt and output together (a request whose KV was lost),
    score the output's positions as decoding them does: alone, not in blocks."""
    _, _, decoded = _prefill(model, [len(PROMPT)])
    cache = model.new_cache()
    cache.prompt_len = len(PROMPT)
    model([cache], [PROMPT], [1])
    verified = model([cache], [EXTRA], [len(EXTRA)])[0]
    again = model.new_cache()
    again.prompt_len = len(PROMPT)
    recomputed = model([again], [PROMPT + EXTRA], [len(EXTRA)])[0]
    assert torch.equal(verified, decoded) and torch.equal(recomputed, decoded)


def test_prefix_copies_keep_to_positions_of_the_same_form(model) -> None:  # noqa: ANN001
    """A request copies another's KV only where both computed it in the same form: before the
    shorter prompt's end, or all of it where the prompts are as long. A chat's next turn (the last
    turn's prompt and output, then more) then gets the bits of its own prefill."""
    assert same_form(40, 40) > 10**9 and same_form(40, 70) == same_form(70, 40) == 40
    turn = PROMPT + EXTRA  # (the first turn's prompt and its output)
    store = KVStore(model, prefix_cache=True)
    first = store.prepare(1, np.array(PROMPT), prompt_len=len(PROMPT))
    model([first], [PROMPT], [1])
    model([first], [EXTRA], [1])
    nxt = np.array(turn + _ids(40, 9))  # the next turn's prompt
    copied = store.prepare(2, nxt, prompt_len=len(nxt))
    assert copied.length == len(PROMPT)  # (not the first turn's output: computed alone there)
    got = model([copied], [nxt[copied.length:].tolist()], [1])[0]
    fresh = KVStore(model).prepare(3, nxt, prompt_len=len(nxt))
    want = model([fresh], [nxt.tolist()], [1])[0]
    assert torch.equal(got, want) and torch.equal(copied.buf[:len(nxt)], fresh.buf[:len(nxt)])
    same = store.prepare(4, np.array(turn + _ids(3, 11)), prompt_len=len(PROMPT))  # (another sample of turn 1)
    assert same.length == len(turn)


def test_a_prompts_rows_attend_in_blocks_and_the_rest_alone(model) -> None:  # noqa: ANN001
    """The plan of a forward: a prompt of two blocks and part of a third in three block calls (a
    chunk that starts mid-block too), the output's rows in groups of rows alone."""
    def kinds(prompt_len: int, past: int, n: int) -> list[str]:
        cache = model.new_cache()
        cache.prompt_len = prompt_len
        if past:
            model([cache], [PROMPT[:past]], [1])
        plan = RowPlan([cache], [n], [None], [0], {None}, torch.device("cpu"), None, model.attention_dtype)
        return [type(g).__name__ for g in plan.groups[None]]

    n = len(PROMPT)
    assert kinds(n, 0, n) == ["BlockCall"] * 3
    assert kinds(n, 40, n - 40) == ["BlockCall"] * 2  # (positions 40..63, then 64..74)
    assert set(kinds(0, 0, n)) == {"RowGroup"}  # (no prompt length known: every row alone)
    assert kinds(n - 5, 0, n)[:3] == ["BlockCall"] * 3 and set(kinds(n - 5, 0, n)[3:]) == {"RowGroup"}


def test_bf16_prompts_chunked_beside_a_stream_give_the_targets_own_output(tiny_pair) -> None:  # noqa: ANN001
    """End to end in bf16 (batch-invariant: prompts in blocks on hosts without runs, as this one
    may be): long prompts prefilled speculatively in chunks of 16 beside a flowing stream give the
    bf16 target's own greedy output, its prompts computed whole."""
    reqs = [{"token_ids": p, "max_new_tokens": 12} for p in long_prompts()]
    outs, chunks = {}, 0
    for mode, budget in (("autoregressive", 0), ("pooled", 16)):
        cfg = deploy_config(tiny_pair, mode, 1, 1, max_batch=4)
        cfg.target.dtype = "bfloat16"
        cfg.broker.policy = cfg.broker.policy.replace(max_forward_tokens=budget)
        with Deployment(cfg) as dep:
            outs[mode] = asyncio.run(_generate(dep.address, reqs, beside_a_stream=budget > 0))
            with Client(dep.address) as client:
                chunks = client.status()["counters"].get("prefill_chunks", 0)
    assert chunks >= 149 // 16  # (the 150-token prompt really went in chunks)
    for i, (spec, alone) in enumerate(zip(outs["pooled"], outs["autoregressive"])):
        assert spec.token_ids == alone.token_ids, f"request {i} differs"


def test_another_requests_prefix_is_pulled_only_where_both_computed_it_in_one_form(model, tiny_pair) -> None:  # noqa: ANN001
    """A peer's KV of another request holds positions past that request's prompt computed alone: a
    prefix pull takes the positions of one form in both (the source's prompt length comes with its
    holder; unknown, none), where the model computes prompts in blocks, and all of them elsewhere."""
    offer = Holder(3, 60, "tcp://peer", source=7)
    store = KVStore(model)
    for source_prompt, prompt_len, want in ((75, 75, 60), (40, 75, 40), (75, 50, 50), (0, 75, 0)):
        offer.source_prompt = source_prompt
        assert store.prefix_valid(offer, prompt_len) == want
    assert KVStore(load_model(tiny_pair / "target")).prefix_valid(offer, 75) == 60  # (fp32: no blocks)
    routes = PrefixRoutes()
    req = Request(1, "1", list(range(40, 140)), SamplingParams(max_new_tokens=4), seed=1)
    req.output, req.holders = [5, 6], {"target": (3, 101)}
    routes.learn(req)
    later = Request(2, "2", list(range(40, 140)) + [5, 6, 7, 8], SamplingParams(max_new_tokens=4), seed=2)
    assert routes.find(later, {3})["target"][2:] == (1, 100)  # (the source, and its prompt's length)
