"""Batch-invariant runs: a long prefill's and a verify block's rows attend as matrix products
(``models.rows``), and every position keeps the bits plain decoding gives it, however the prompt
is chunked, across the kernel's 256-key halves and 512-key blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from nebula_flow.models import rows
from nebula_flow.models.batch import Batch
from nebula_flow.models.loader import load_model


@pytest.fixture(scope="module", params=[64, 128], ids=["64-wide-heads", "128-wide-heads"])
def long_checkpoint(request, tmp_path_factory):  # noqa: ANN001, ANN201
    """Random weights with head sizes whose kernels need query blocks of 3 and of 6 rows."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=256 // request.param, num_key_value_heads=1, max_position_embeddings=2048)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp(f"long{request.param}")
    hf.save_pretrained(path)
    return path


def _ids(n: int) -> list[int]:
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_long_prompts_positions_keep_their_bits_however_it_is_computed(long_checkpoint, dtype: str) -> None:  # noqa: ANN001
    model = load_model(long_checkpoint, dtype=dtype, batch_invariant=True)
    ids = _ids(1100)  # (calls of 256 rows, calls cut at 384 keys and each 32 after, keys past 512)
    whole = model([model.new_cache()], [ids], [len(ids)])[0]

    cache, at, chunks = model.new_cache(), 0, []
    for n in (1, 2, 250, 9, 258, 33, 1, 300, 246):  # awkward chunks: 1- and 2-row blocks, calls crossing 512 keys
        chunks.append(model([cache], [ids[at:at + n]], [n])[0])
        at += n
    assert at == len(ids)
    assert torch.equal(torch.cat(chunks), whole), f"a chunked prefill's logits differ from one prefill's in {dtype}"

    for first in (250, 505, 770):  # decoding across 256 (a half), 512 (a block) and 768 keys
        cache = model.new_cache()
        model([cache], [ids[:first]], [1])
        decoded = torch.cat([model([cache], [[t]], [1])[0] for t in ids[first:first + 12]])
        assert torch.equal(decoded, whole[first:first + 12]), f"decoding from {first} differs from the prefill in {dtype}"

    cache, other = model.new_cache(), model.new_cache()  # a verify block beside another sequence's decode
    model([cache, other], [ids[:1020], ids[:300]], [1, 1])
    block = model([other, cache], [ids[300:301], ids[1020:1026]], [1, 6])[1]
    assert torch.equal(block, whole[1020:1026]), f"a verify block in a batch differs from the prefill in {dtype}"


def test_runs_attend_as_matrix_products_here_and_row_by_row_when_the_probe_refuses(long_checkpoint) -> None:  # noqa: ANN001
    """The model reports how it attends; the bits hold whichever it is."""
    model = load_model(long_checkpoint, dtype="bfloat16", batch_invariant=True)
    assert model.invariance["attention"] == ("row by row" if model.run_block is None else
                                             f"prefills and verify blocks as matrix products, query blocks of >= "
                                             f"{model.run_block} rows") + f", in {str(model.attention_dtype)[6:]}"
    model.run_block = None  # (as where no block size keeps the bits)
    ids = _ids(300)
    row_by_row = model([model.new_cache()], [ids], [300])[0]
    cache = model.new_cache()
    model([cache], [ids[:290]], [1])
    assert torch.equal(torch.cat([model([cache], [[t]], [1])[0] for t in ids[290:]]), row_by_row[290:])


def _runs_keep_bits_here(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> None:
    """Skip where this CPU's own kernel keeps no row's bits in runs of any block size (the probe says
    None: measured on a 2-core AMD EPYC with AVX2 and no AVX-512, in fp32 and bf16; its prefills then
    attend row by row), since a kernel built on it cannot show the block the probe would find."""
    if rows.run_block.__wrapped__(heads, kv_heads, head_dim, "cpu", dtype) is None:
        pytest.skip(f"this CPU's attention kernel keeps no row's bits in runs of any block size in {dtype}")


def test_the_probe_finds_the_fewest_rows_a_query_block_needs(monkeypatch) -> None:
    """A kernel that rounds blocks of fewer than 4 query rows another way gets blocks of 4; one
    that rounds calls of many rows another way gets no runs at all."""
    kernel = F.scaled_dot_product_attention

    def small_blocks_round_apart(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        out = kernel(q, *args, **kwargs)
        return out * (1 + 2 ** -20) if q.shape[-2] % rows.BUCKET in (1, 2, 3) else out

    def long_calls_round_apart(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        out = kernel(q, *args, **kwargs)
        return out * (1 + 2 ** -20) if q.shape[-2] > 100 else out

    probe = rows.run_block.__wrapped__
    _runs_keep_bits_here(4, 2, 16)
    monkeypatch.setattr(rows.F, "scaled_dot_product_attention", small_blocks_round_apart)
    assert probe(4, 2, 16) == 4
    monkeypatch.setattr(rows.F, "scaled_dot_product_attention", long_calls_round_apart)
    assert probe(4, 2, 16) is None


def test_in_bf16_the_probe_sees_a_sum_made_in_another_order(monkeypatch) -> None:
    """bf16's rounding of the output hides most sums made in another order; the probe's inputs
    whose sums cancel show them: a kernel that adds a small block's first two keys the other way
    round gets blocks of 4. (Here the random inputs alone pass that kernel with blocks of 2.)"""
    kernel = F.scaled_dot_product_attention

    def small_blocks_sum_apart(q, k, v, attn_mask=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
        if q.shape[-2] % rows.BUCKET in (1, 2, 3):  # (the same sum, its first two terms swapped)
            order = torch.arange(k.shape[-2])
            order[:2] = torch.tensor([1, 0])
            return kernel(q, k[..., order, :], v[..., order, :], attn_mask=attn_mask[..., order], **kwargs)
        return kernel(q, k, v, attn_mask=attn_mask, **kwargs)

    probe = rows.run_block.__wrapped__
    _runs_keep_bits_here(4, 2, 16, torch.bfloat16)
    monkeypatch.setattr(rows.F, "scaled_dot_product_attention", small_blocks_sum_apart)
    assert probe(4, 2, 16, "cpu", torch.bfloat16) == 4


def test_rows_attend_in_fp32_where_bf16_calls_keep_no_rows_bits(monkeypatch) -> None:
    kernel = F.scaled_dot_product_attention

    def long_bf16_calls_round_apart(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        out = kernel(q, *args, **kwargs)
        return out * (1 + 2 ** -6) if q.dtype == torch.bfloat16 and q.shape[-2] > 100 else out

    monkeypatch.setattr(rows.F, "scaled_dot_product_attention", long_bf16_calls_round_apart)
    rows.run_block.cache_clear()
    try:
        assert rows.attention_rules(4, 2, 16, "cpu", torch.bfloat16) == (torch.float32, rows.run_block(4, 2, 16))
        assert rows.attention_rules(4, 2, 16, "cpu", torch.float32)[0] == torch.float32
    finally:
        rows.run_block.cache_clear()  # (no probe made under the fake kernel outlives the test)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_prompt_before_a_token_tree_attends_as_a_run_and_keeps_its_bits(long_checkpoint, dtype: str) -> None:  # noqa: ANN001
    """A first verify carries the prompt and the draft's token tree in one forward: the prompt's
    rows attend as a run (not each row as a problem of its own), and every row keeps the bits it
    has when the prompt is prefilled first and the tree verified after."""
    model = load_model(long_checkpoint, dtype=dtype, batch_invariant=True)
    ids, tree = _ids(600), [7, 8, 9, 10, 11]
    tree_parents = [-1, 0, 0, 1, 2]  # (two branches after the prompt's last token)
    cache = model.new_cache()
    together = model([cache], [ids + tree], [6], [list(range(-1, 599)) + [600 + p if p >= 0 else 599 for p in tree_parents]])[0]

    cache = model.new_cache()
    prompt_last = model([cache], [ids], [1])[0]
    apart = model([cache], [tree], [5], [tree_parents])[0]
    assert torch.equal(together, torch.cat((prompt_last, apart))), f"a prompt with its tree differs from apart in {dtype}"

    # (and its prompt is one run of calls, not rows alone)
    plan = Batch([model.new_cache()], [605], [list(range(-1, 599)) + [599, 600, 600, 601, 602]], torch.device("cpu"),
                 group=True, invariant_windows={None}, invariant_block=model.run_block or 2,
                 invariant_dtype=model.attention_dtype).rows
    runs = [g for g in plan.groups[None] if isinstance(g, rows.RunCall)]
    assert sum(g.size for g in runs) == 602  # (the prompt and the tree's first branch up to where the second starts)
