"""A model's KV arena (kv/arena.py) and the attention that reads a whole batch through it
(models/batch.py): ranges that never overlap and merge back, rows that survive growth, and one
attention call per layer whose logits equal attending sequence by sequence."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from nebula_flow.kv import arena as arena_mod
from nebula_flow.kv.arena import MIN_ROWS, KVArena
from nebula_flow.kv.cache import KVCache
from nebula_flow.models import batch as batch_mod
from nebula_flow.models import flash as flash_mod
from nebula_flow.models.config import ModelConfig
from nebula_flow.models.llama import CausalLM
from nebula_flow.models.ops import QWEN3_0_6B, forward_ops, random_model

ROW = (2, 2, 1, 4)  # layers, K/V, kv heads, head dim
ROW_BYTES = 2 * 2 * 1 * 4 * 4


def _arena(rows: int = 256) -> KVArena:
    return KVArena(ROW, torch.float32, "cpu", chunk_bytes=rows * ROW_BYTES)


def test_leases_never_overlap_merge_back_and_overflow_into_a_new_chunk() -> None:
    arena = _arena(256)
    leases = [arena.lease(n) for n in (1, 16, 17, 40, 100, 60)]
    assert [lease.rows for lease in leases] == [MIN_ROWS, 16, 32, 48, 112, 64]  # multiples of MIN_ROWS
    spans = sorted((lease.base, lease.base + lease.rows) for lease in leases[:5])
    assert spans == [(0, 16), (16, 32), (32, 64), (64, 112), (112, 224)]  # disjoint, lowest first
    assert {lease.chunk for lease in leases[:5]} == {0} and arena.leased_rows == 224 + 64
    assert leases[5].chunk == 1  # (64 rows: 32 were left in chunk 0, so a second chunk)
    huge = arena.lease(1000)  # more than a chunk: a chunk of its own
    assert huge.rows == 1008 and huge.chunk == 2 and arena.chunks[2].buf.shape[0] == 1008
    arena.give(leases[1])  # rows 16..32 free
    arena.give(leases[3])  # rows 64..112 free
    middle = arena.lease(20)
    assert (middle.base, middle.rows) == (64, 32)  # the lowest free range long enough (16..32 is not)
    arena.give(leases[2])  # rows 32..64: merged with 16..32 into one free range of 48 rows
    merged = arena.lease(48)
    assert (merged.chunk, merged.base) == (0, 16)  # (no other free range is that long)
    for lease in (leases[0], leases[4], leases[5], huge, middle, merged):
        arena.give(lease)
    assert arena.lease(256).base == 0  # every range given back: one whole chunk again
    assert arena.chunks[1] is None and arena.chunks[2] is None  # emptied extra chunks gave their memory back


def test_a_range_a_peer_was_served_from_is_not_reused_until_its_quarantine_ends(monkeypatch) -> None:  # noqa: ANN001
    arena = _arena(32)
    first = arena.lease(16)
    first.served_at = time.monotonic()  # a network send may still read these rows
    arena.give(first)
    second = arena.lease(16)
    assert second.base != first.base  # the other half, not the quarantined one
    monkeypatch.setattr(arena_mod, "QUARANTINE_S", -1.0)  # (its time is over)
    arena.give(second)
    assert arena.lease(32).base == 0  # both halves free again, merged


def test_the_quarantine_outlasts_the_pull_a_peer_waits_for_and_no_more() -> None:
    from nebula_flow.kv.link_fit import MAX_PULL_S, PULL_TIMEOUT_S, LinkFit
    from nebula_flow.kv.shm import POOL_QUARANTINE_S

    assert PULL_TIMEOUT_S <= MAX_PULL_S < arena_mod.QUARANTINE_S == POOL_QUARANTINE_S <= MAX_PULL_S + 1.0
    # the longest a puller waits, whatever its link measured: a huge pull over a crawling link
    crawling = LinkFit()
    crawling.observe(0.0, 1024, 0.01)  # (the connection's setup)
    crawling.observe(0.0, 1 << 20, 100.0)
    assert crawling.deadline(1 << 30, 0.0) == MAX_PULL_S


def test_a_budget_larger_than_memory_allows_gives_a_smaller_chunk_not_a_failure(monkeypatch) -> None:  # noqa: ANN001
    made = arena_mod.Chunk

    def scarce(rows: int, *args) -> arena_mod.Chunk:  # noqa: ANN002
        if rows > 64:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return made(rows, *args)

    monkeypatch.setattr(arena_mod, "Chunk", scarce)
    arena = _arena(1024)
    assert arena.lease(20).rows == 32 and arena.chunks[0].buf.shape[0] == 64  # halved until it fit
    with pytest.raises(RuntimeError, match="allocate"):
        arena.lease(100)  # (a cache that cannot fit at all still fails loudly)


def test_a_cache_grows_in_the_arena_keeps_its_rows_and_gives_back_what_it_left() -> None:
    arena = _arena(1024)
    cache = KVCache(*ROW[:1], ROW[2], ROW[3], capacity=16, arena=arena)
    assert cache.lease is not None and cache.buf.shape[0] == 16
    cache.buf[:10] = torch.arange(10.0)[:, None, None, None, None]
    cache.tokens = list(range(10))
    where = cache.buf.data_ptr()
    cache.reserve(100)  # (the rows after it are free: it grows where it is, nothing copied)
    assert cache.buf.shape[0] == 128 and cache.buf.data_ptr() == where == arena.rows(cache.lease).data_ptr()
    assert torch.equal(cache.buf[:10, 0, 0, 0, 0], torch.arange(10.0)) and arena.leased_rows == 128
    neighbour = arena.lease(16)  # right after it: the next growth moves it
    cache.reserve(200)
    assert cache.buf.shape[0] == 256 and cache.lease.base == 144 and cache.buf.data_ptr() == arena.rows(cache.lease).data_ptr()
    assert torch.equal(cache.buf[:10, 0, 0, 0, 0], torch.arange(10.0))  # (its rows copied over)
    assert arena.leased_rows == 256 + 16  # the old range went back
    arena.give(neighbour)
    cache.release()
    assert arena.leased_rows == 0 and cache.length == 0
    dropped = KVCache(*ROW[:1], ROW[2], ROW[3], capacity=40, arena=arena)
    assert dropped.lease.rows == 48
    del dropped  # never released (an evicted fork): its range comes back all the same
    gc.collect()
    assert arena.leased_rows == 0


def _model(**extra: object) -> CausalLM:
    raw = dict(QWEN3_0_6B, num_hidden_layers=2, vocab_size=300, hidden_size=64, intermediate_size=96,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    raw.update(extra)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(raw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.fuse_projections()
    return model


def record_plans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list, list[int]]]:
    """Each ``Batch`` made from now on, as (its plans, the sequences that attend apart)."""
    made, plans = batch_mod.Batch.__init__, []

    def spy(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        made(self, *args, **kwargs)
        plans.append((list(self.plans), list(self.apart)))

    monkeypatch.setattr(batch_mod.Batch, "__init__", spy)
    return plans


def reference_varlen(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_q: torch.Tensor, starts: torch.Tensor,
                     max_q: int, max_k: int, dropout: float, causal: bool, debug: bool, *, seqused_k: torch.Tensor,
                     window_size_left: int | None = None, window_size_right: int | None = None,
                     num_splits: int | None = None) -> tuple:
    """What FlashAttention-2's varlen forward computes (``models/flash.py`` calls it on CUDA; the
    GPU tests run the kernel itself), on a CPU: sequence b's queries are rows cu_q[b]..cu_q[b+1],
    its keys the ``seqused_k[b]`` slots from ``starts[b]``, causal from the last key, windowed."""
    assert causal and dropout == 0.0 and window_size_right in (None, 0)
    out = torch.empty_like(q)
    for b, used in enumerate(seqused_k.tolist()):
        q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(starts[b])
        assert q1 - q0 <= max_q and used <= max_k
        pos, key = torch.arange(used - (q1 - q0), used, device=q.device)[:, None], torch.arange(used, device=q.device)[None, :]
        allowed = (key <= pos) & (pos - key <= (window_size_left if window_size_left is not None else used))
        o = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1)[None], keys[k0:k0 + used].transpose(0, 1)[None],
            values[k0:k0 + used].transpose(0, 1)[None], attn_mask=allowed, enable_gqa=True)
        out[q0:q1] = o[0].transpose(0, 1)
    return out, None, None, None, None


@pytest.mark.parametrize("flash", [False, True], ids=["masked", "flash-plan"])
@pytest.mark.parametrize("family", ["qwen3", "qwen2-window-layers"])
def test_one_attention_call_for_a_mixed_batch_scores_every_row_as_attending_alone(family: str, flash: bool,
                                                                                  monkeypatch) -> None:  # noqa: ANN001
    """Decodes, a verify block, a token tree, a prefill chunk and a long prefill in one forward give
    the logits each sequence gets alone: attending in one masked call (the long prefill apart), or
    as on CUDA in bf16, the chains in one FlashAttention call (``models.flash``, its kernel's
    contract run on this CPU) and the tree apart."""
    extra = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1} \
        if family == "qwen2-window-layers" else {}
    model = _model(**extra)
    if flash:
        monkeypatch.setattr(flash_mod, "kernel", reference_varlen)
        model.flash_attention = True
    plans = record_plans(monkeypatch)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 3, 14, 5, 2)]
    steps = [[5], [6, 7, 8], [1, 2, 3, 4], list(range(10, 90)), [7]]  # (80 rows: attends apart)
    parents = [None, None, [-1, 0, 0, 1], None, None]
    alone = []
    for prompt, step, tree in zip(prompts, steps, parents):
        cache = model.new_cache(4)
        model([cache], [prompt], [1])
        alone.append(model([cache], [step], [len(step)], [tree])[0])
    caches = [model.new_cache(4) for _ in prompts]
    model(caches, prompts, [1] * len(prompts))
    together = model(caches, steps, [len(s) for s in steps], parents)
    for got, want in zip(together, alone):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (plan,), apart = plans[-1]
    prefills = plans[len(prompts) * 2][0][0]  # (the ragged prefills were one call)
    if flash:  # (every chain in one call, the long prefill too; the tree apart)
        assert plan.flash and plan.rows.tolist() == [0, 1, 2, 3] + list(range(8, 89)) and apart == [2]
        assert prefills.flash and prefills.rows is None and prefills.max_q == 14
    else:
        assert not plan.flash and plan.size == 4 and apart == [3]  # the long prefill attended apart
        assert prefills.size == len(prompts)


def test_a_batchs_host_work_does_not_grow_with_its_sequences() -> None:
    """Aten ops of a forward (torch's profiler; on a GPU, kernel launches and host time): a decode
    of 16 sequences dispatches about what a decode of one does (per sequence per layer, it was a
    dozen more each)."""
    model = random_model(dict(QWEN3_0_6B, num_hidden_layers=2, vocab_size=1000))
    one = forward_ops(model, 1, 1, context=32, repeats=1)["ops"]
    sixteen = forward_ops(model, 16, 1, context=32, repeats=1)["ops"]
    two_verifies = forward_ops(model, 2, 5, context=32, repeats=1)["ops"]
    sixteen_verifies = forward_ops(model, 16, 5, context=32, repeats=1)["ops"]
    assert sixteen <= 1.15 * one and sixteen_verifies <= 1.15 * two_verifies, (one, sixteen, two_verifies, sixteen_verifies)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_logits_keep_their_bits_wherever_the_arena_puts_a_cache(dtype: torch.dtype) -> None:
    """Batch-invariant mode (each row its own attention problem, ``models.rows``): a position's
    logits have the same bits whatever it is batched with, whichever way its keys are read (a view,
    a gather) and wherever its KV sits in the arena (another range, another chunk)."""
    model = _model().to(dtype)
    model.make_batch_invariant()
    c = model.cfg
    model.kv_arena = KVArena((c.num_layers, 2, c.num_kv_heads, c.head_dim), dtype, "cpu", chunk_bytes=1)  # tiny chunks
    g = torch.Generator().manual_seed(2)
    prompt, other, step = (torch.randint(0, 300, (n,), generator=g).tolist() for n in (11, 7, 4))
    alone = model.new_cache(64)
    model([alone], [prompt], [1])
    want = model([alone], [step], [4])[0]
    filler = [model.new_cache(64) for _ in range(3)]  # (moves the next caches to other ranges and chunks)
    a, b = model.new_cache(16), model.new_cache(200)
    assert (a.lease.chunk, a.lease.base) != (alone.lease.chunk, alone.lease.base)
    model([b, a], [other, prompt], [1, 1])
    got = model([a, b], [step, step[:1]], [4, 1])[0]
    assert torch.equal(got, want)
    # decode rows of several sequences gather their keys into one call; alone, a row reads a view
    together = model([b, a], [[5], [6]], [1, 1])[1]
    assert torch.equal(together, model([alone], [[6]], [1])[0])
    del filler


@pytest.mark.parametrize("flash", [False, True], ids=["masked", "flash-plan"])
def test_a_batch_whose_caches_are_in_two_chunks_attends_in_a_call_per_chunk(flash: bool, monkeypatch) -> None:  # noqa: ANN001
    """A worker's KV overflows into another chunk when its budget is full: the batch then attends
    in one call per chunk (not per sequence), with the logits each sequence gets alone."""
    model = _model()
    if flash:
        monkeypatch.setattr(flash_mod, "kernel", reference_varlen)
        model.flash_attention = True
    c = model.cfg
    model.kv_arena = KVArena((c.num_layers, 2, c.num_kv_heads, c.head_dim), torch.float32, "cpu",
                             chunk_bytes=256 * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4)  # (256 rows a chunk)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 3, 10, 5)]
    steps = [[5], [6, 7, 8], [1, 2], [7]]
    alone = []
    for prompt, step in zip(prompts, steps):
        cache = model.new_cache(16)
        model([cache], [prompt], [1])
        alone.append(model([cache], [step], [len(step)])[0])
        cache.release()
    filler = [model.new_cache(16) for _ in range(14)]  # (the first chunk's 16 ranges but two)
    caches = [model.new_cache(16) for _ in prompts]  # (two there, two in a chunk of 32 rows made for them)
    assert [cache.lease.chunk for cache in caches] == [0, 0, 1, 1]
    model(caches, prompts, [1] * len(prompts))
    plans = record_plans(monkeypatch)
    together = model(caches, steps, [len(s) for s in steps])
    assert [(len(made), apart) for made, apart in plans] == [(2, [])]
    for got, want in zip(together, alone):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    del filler
