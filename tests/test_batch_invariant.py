"""Batch-invariant numerics: a position's logits have the same bits in a decode step, a verify
block, a ragged batch and a prefill, in bf16 and fp32; and they still equal HF's logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from nebula_flow.models import invariant, packed
from nebula_flow.models.llama import Linear
from nebula_flow.models.loader import load_model
from nebula_flow.tree import TokenTree
from tests.test_models import FAMILIES

WIDE_MLP = "llama-wide-mlp"  # 1536-wide MLP: bf16 CPU kernels round its down projection by call size


@pytest.fixture(scope="module", params=["llama2", "qwen3", "mistral-sliding", WIDE_MLP])
def checkpoint(request, tmp_path_factory):  # noqa: ANN001, ANN201
    torch.manual_seed(0)
    make = FAMILIES["llama2"] if request.param == WIDE_MLP else FAMILIES[request.param]
    cfg = make()
    if request.param == WIDE_MLP:
        cfg.intermediate_size = 1536
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_logits_have_the_same_bits_however_a_position_is_batched(checkpoint, dtype: str) -> None:  # noqa: ANN001
    _, path = checkpoint
    model = load_model(path, dtype=dtype, batch_invariant=True)
    assert model.batch_invariant
    prompt, extra, other = _ids(11, 1), _ids(5, 2), _ids(7, 3)

    cache = model.new_cache()  # plain decoding: one token per step
    model([cache], [prompt], [1])
    decoded = torch.cat([model([cache], [[t]], [1])[0] for t in extra])

    cache = model.new_cache()  # a verify block of five rows
    model([cache], [prompt], [1])
    verified = model([cache], [extra], [5])[0]

    a, b = model.new_cache(), model.new_cache()  # ragged batch beside another sequence
    model([a, b], [prompt, other], [1, 1])
    batched = model([b, a], [extra[:3], extra], [3, 5])[1]

    prefilled = model([model.new_cache()], [prompt + extra], [5])[0]  # one prefill
    for name, got in (("verify", verified), ("ragged batch", batched), ("prefill", prefilled)):
        assert torch.equal(got, decoded), f"{name} logits differ from decode logits in {dtype}"


@pytest.mark.parametrize("large", [False, True], ids=["probe-all-sizes", "probe-as-for-large-weights"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_long_prefills_and_blocks_keep_the_bits_of_decoding(checkpoint, dtype: str, large: bool,  # noqa: ANN001
                                                            monkeypatch) -> None:  # noqa: ANN001
    """Calls of more than ``ROW_CHUNK`` and more than ``MAX_CHUNK`` rows (a prefill, a wide
    verify) give the positions the bits plain decoding gives them, with either probe."""
    _, path = checkpoint
    if large:  # every weight gets the output heads' cheaper probe (and padded plans)
        monkeypatch.setattr(invariant, "LARGE", 0)
    model = load_model(path, dtype=dtype, batch_invariant=True)
    ids = _ids(140, 7)
    cache = model.new_cache()
    model([cache], [ids[:135]], [1])
    decoded = torch.cat([model([cache], [[t]], [1])[0] for t in ids[135:]])
    prefilled = model([model.new_cache()], [ids], [5])[0]  # 140 rows: 3 calls of up to 64
    cache = model.new_cache()
    model([cache], [ids[:123]], [1])
    block = model([cache], [ids[123:]], [17])[0][-5:]  # a 17-row block, all rows through the head
    assert torch.equal(prefilled, decoded) and torch.equal(block, decoded)


def test_batch_invariant_logits_still_match_hf(checkpoint) -> None:  # noqa: ANN001
    hf, path = checkpoint
    model = load_model(path, batch_invariant=True)
    ids = _ids(19, 4)
    cache = model.new_cache()
    got = torch.cat([model([cache], [ids[:12]], [12])[0], model([cache], [ids[12:]], [7])[0]])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_auto_setting_is_on_for_reduced_precision_on_cpu(checkpoint) -> None:  # noqa: ANN001
    _, path = checkpoint
    assert load_model(path, dtype="bfloat16").batch_invariant
    assert not load_model(path).batch_invariant  # fp32: the fast batched path
    assert not load_model(path, dtype="bfloat16", batch_invariant=False).batch_invariant


def test_bf16_inference_models_run_on_packed_weights_with_the_same_logits(checkpoint) -> None:  # noqa: ANN001
    """Packed weights (where this CPU's PyTorch has the kernel) change speed, not bits; a packed
    model refuses to hand out its released weights."""
    _, path = checkpoint
    model = load_model(path, dtype="bfloat16")
    plain = load_model(path, dtype="bfloat16", inference=False)
    linears = sum(isinstance(m, Linear) for m in model.modules())
    w = torch.randn(16, 8).to(torch.bfloat16)
    assert model.packed_layers == (linears if packed.pack(w) is not None else 0) and plain.packed_layers == 0
    ids = list(range(3, 20))
    got = model([model.new_cache()], [ids], [len(ids)])[0]
    ref = plain([plain.new_cache()], [ids], [len(ids)])[0]
    assert torch.equal(got, ref)
    if model.packed_layers:
        with pytest.raises(RuntimeError, match="packed for inference"):
            model.state_dict()
    assert plain.state_dict()


def test_the_packed_kernel_is_chosen_from_the_rows_where_it_is_faster_whatever_a_tie_at_more_rows() -> None:
    """Measured ratios (packed over plain) of a 2-core AVX2 VM's 576 -> 1536 projection: 0.93 at 16
    rows is a tie, not a reason to run 2-8 rows on the kernel that takes 1.2-1.6x as long."""
    measured = {1: 1.40, 2: 0.81, 3: 0.60, 4: 0.78, 6: 0.65, 8: 0.81, 16: 0.93}
    assert packed.from_ratios(measured) == 2
    assert packed.from_ratios({**measured, 2: 0.95}) == 3  # not clearly faster at 2 rows: from 3
    assert packed.from_ratios({**measured, 16: 1.3}) is None  # clearly slower at many rows: never
    assert packed.from_ratios({**measured, 8: 1.3, 16: 0.7}) == 16  # clearly slower at 8 rows: from the rows past it
    assert packed.from_ratios({1: 1.0, 2: 0.95, 16: 1.0}) is None  # never clearly faster


def test_fp32_layers_switch_to_the_packed_kernel_from_the_rows_where_it_is_faster(checkpoint, monkeypatch) -> None:  # noqa: ANN001
    """An fp32 layer keeps its plain weight (fewer rows run on it: MKL is fastest there) and runs
    the packed one from ``packed_from_rows`` on, with values within fp32 rounding either way."""
    _, path = checkpoint
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))
    pw = packed.pack(w)
    if pw is None:
        pytest.skip("this PyTorch build or CPU has no packed fp32 kernel")
    assert packed.first_faster_rows(w.to(torch.bfloat16), pw) == 1  # bf16: always (no timing)
    assert packed.first_faster_rows(w, pw) in (*packed.PROBE_ROWS, None)  # fp32: timed here
    layer = Linear(64, 96, bias=False)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.packed, layer.packed_from_rows = pw, 4
    calls, real = [], packed.linear
    monkeypatch.setattr(packed, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))  # (a spy)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    assert calls == [4, 9]  # 1 and 3 rows ran on the plain weight
    model = load_model(path)  # fp32 inference: whatever this CPU's timings packed
    plain = load_model(path, inference=False)
    ids = list(range(3, 20))
    torch.testing.assert_close(model([model.new_cache()], [ids], [len(ids)])[0],
                               plain([plain.new_cache()], [ids], [len(ids)])[0], rtol=1e-4, atol=1e-4)
    assert not model.weights_released and model.state_dict()  # the plain copies stay in fp32


def test_padded_chunks_give_each_row_the_full_chunk_kernel() -> None:
    w = torch.randn(24, 40)
    x = torch.randn(13, 40)
    def product(v: torch.Tensor) -> torch.Tensor:
        return F.linear(v, w)

    for plan in (invariant.RowPlan(8, 8), invariant.RowPlan(8, 0, 8), invariant.RowPlan(64, 0, 8),
                 invariant.RowPlan(64, 8, 8)):
        got = invariant.chunked_linear(x, product, plan)
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    # With padding, rows of a short call take their bits from a full-size call.
    full = F.linear(torch.cat([x[:3], x.new_zeros(invariant.ROW_CHUNK - 3, 40)]), w)[:3]
    assert torch.equal(invariant.chunked_linear(x[:3], product, invariant.RowPlan(8, 0, 8)), full)
    # Above ``exact`` rows, calls are padded to a multiple: 13 rows run as one 16-row call.
    full = F.linear(torch.cat([x, x.new_zeros(3, 40)]), w)[:13]
    assert torch.equal(invariant.chunked_linear(x, product, invariant.RowPlan(64, 8, 8)), full)


def test_the_probe_finds_where_call_size_changes_a_rows_bits() -> None:
    """bf16 with 1536 inputs per row rounds differently in 1-row and 8-row calls on this kind of
    CPU; the plan pads such calls. Whatever the plan, its call sizes give a row the same bits."""
    w = (torch.randn(96, 1536, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    x = (3 * torch.randn(70, 1536, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    products = {"F.linear": lambda v: F.linear(v, w)}
    if (pw := packed.pack(w)) is not None:  # and the packed kernel workers run where it exists
        products["packed"] = lambda v: packed.linear(v, pw, None)
    for name, product in products.items():
        plan = invariant.row_plan(w, product)
        whole = invariant.chunked_linear(x, product, plan)
        for n in (1, 3, 8, 13, 64):
            assert torch.equal(invariant.chunked_linear(x[:n], product, plan), whole[:n]), f"{name}: {n} rows in {plan}"


def test_the_probe_keeps_the_widest_call_that_keeps_a_rows_bits() -> None:
    """A kernel that changes its blocking above 32 rows (as oneDNN's AMX bf16 kernel does for the
    bundled target's layers) still gets calls of up to 32 rows, not of 8: a 20-row verify is one
    call. Here the wide calls compute in float64, so they round their rows differently."""
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(3))

    def rowwise(v: torch.Tensor) -> torch.Tensor:  # (a row's bits never depend on the call's size)
        return (v.unsqueeze(1) * w).sum(-1)

    def wide(v: torch.Tensor) -> torch.Tensor:
        return (v.double().unsqueeze(1) * w.double()).sum(-1).float()

    def product(v: torch.Tensor) -> torch.Tensor:
        return rowwise(v) if v.shape[0] <= 32 else wide(v)

    plan = invariant.row_plan(w, product)
    assert plan == invariant.RowPlan(32, 32)
    x = torch.randn(70, 40, generator=torch.Generator().manual_seed(4))
    whole = invariant.chunked_linear(x, product, plan)
    for n in (1, 7, 20, 32, 33):
        assert torch.equal(invariant.chunked_linear(x[:n], product, plan), whole[:n]), n

    def padded(v: torch.Tensor) -> torch.Tensor:  # small calls round apart too: padded calls, up to 16 rows
        rows = v.shape[0]
        return wide(v) if rows > 16 else rowwise(v) * (1 + 2 ** -10) if rows < invariant.ROW_CHUNK else rowwise(v)

    assert invariant.row_plan(w, padded) == invariant.RowPlan(16, 0, invariant.ROW_CHUNK)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_token_tree_alternatives_score_like_decoding_them(checkpoint, dtype: str) -> None:  # noqa: ANN001
    """A verify with alternatives to its first draft token (a two-level token tree): each
    alternative's row has the bits of decoding that token in its place, the chain rows are
    unchanged by them, and adopting one leaves the cache as if it had been decoded."""
    _, path = checkpoint
    model = load_model(path, dtype=dtype, batch_invariant=True)
    prompt, last, chain, alts = _ids(11, 5), 7, [11, 12, 13], [21, 22]

    def decoded(tokens: list[int]) -> torch.Tensor:
        cache = model.new_cache()
        model([cache], [prompt], [1])
        return torch.cat([model([cache], [[t]], [1])[0] for t in tokens])

    cache = model.new_cache(capacity=8)  # grown inside the forward, as a worker's caches are
    model([cache], [prompt], [1])
    rows = model([cache], [[last, *chain, *alts]], [6], [[-1, 0, 1, 2, 0, 0]])[0]
    assert torch.equal(rows[:4], decoded([last, *chain]))
    for j, a in enumerate(alts):
        assert torch.equal(rows[4 + j], decoded([last, a])[1]), f"alternative {j}"
    position = len(prompt) + 1
    cache.adopt([position + len(chain) + 1], position)  # keep alts[1]
    assert cache.tokens[-2:] == [last, alts[1]]
    assert torch.equal(model([cache], [[5]], [1])[0][0], decoded([last, alts[1], 5])[2])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_fused_chain_forking_mid_chain_scores_like_decoding_its_path(checkpoint, dtype: str) -> None:  # noqa: ANN001
    """A deeper token tree (a second drafter's chain that shares the first two draft tokens, then
    differs): each of its rows has the bits of decoding its own path, and adopting that path (KV
    moved from after the first chain into place) leaves the cache as if it had been decoded."""
    _, path = checkpoint
    model = load_model(path, dtype=dtype, batch_invariant=True)
    prompt, last, chain, fused = _ids(11, 5), 7, [11, 12, 13, 14], [11, 12, 31, 32]
    tree = TokenTree([chain, fused])
    assert tree.tokens == [11, 12, 13, 14, 31, 32] and tree.parents == [-1, 0, 1, 2, 1, 4]

    def decoded(tokens: list[int]) -> torch.Tensor:
        cache = model.new_cache()
        model([cache], [prompt], [1])
        return torch.cat([model([cache], [[t]], [1])[0] for t in tokens])

    cache = model.new_cache(capacity=8)
    model([cache], [prompt], [1])
    rows = model([cache], [[last, *tree.tokens]], [7], [[-1, *(1 + p for p in tree.parents)]])[0]
    assert torch.equal(rows[:5], decoded([last, *chain]))
    assert torch.equal(rows[[0, 1, 2, 5, 6]], decoded([last, *fused]))
    position = len(prompt) + 1
    cache.adopt([position + n for n in tree.path(fused[:3])], position)  # keep 11, 12, 31
    assert cache.tokens[-4:] == [last, 11, 12, 31]
    assert torch.equal(model([cache], [[5]], [1])[0][0], decoded([last, 11, 12, 31, 5])[4])


def test_token_tree_with_the_batched_kernels_stays_close_to_decoding(checkpoint) -> None:  # noqa: ANN001
    """The fast (not batch-invariant) path masks the same tree; sliding windows included."""
    _, path = checkpoint
    model = load_model(path)
    assert not model.batch_invariant
    prompt = _ids(40, 6)  # longer than the test families' sliding window
    cache = model.new_cache()
    model([cache], [prompt], [1])
    rows = model([cache], [[7, 11, 12, 21, 22]], [5], [[-1, 0, 1, 0, 0]])[0]
    for j, a in enumerate((21, 22)):
        ref = model.new_cache()
        model([ref], [prompt + [7]], [1])
        torch.testing.assert_close(rows[3 + j], model([ref], [[a]], [1])[0][0], rtol=1e-4, atol=1e-4)
    cache.adopt([len(prompt) + 3], len(prompt) + 1)  # keep 21
    # a deeper fork: 31, 32 follow 11, 12 of the chain 11, 12, 13
    rows = model([cache], [[11, 12, 13, 31, 32]], [5], [[-1, 0, 1, 1, 3]])[0]
    ref = model.new_cache()
    model([ref], [prompt + [7, 21, 11, 12]], [1])
    torch.testing.assert_close(rows[3:], model([ref], [[31, 32]], [2])[0], rtol=1e-4, atol=1e-4)
