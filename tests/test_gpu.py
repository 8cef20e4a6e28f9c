"""GPU paths: bf16 runtime on CUDA, KV caches in CUDA memory, UCX pulls into CuPy buffers.

Skipped without a CUDA device (CI has none); run them where one is lent.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nebula_flow.kv.store import KVStore
from nebula_flow.kv.transport import ZmqTransport
from nebula_flow.models.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_runtime_on_cuda_tracks_fp32(tiny_pair) -> None:  # noqa: ANN001
    gpu = load_model(tiny_pair / "target", device="cuda")
    cpu = load_model(tiny_pair / "target")
    assert gpu.lm_head.weight.dtype == torch.bfloat16
    ids = list(range(1, 40))
    got = gpu([gpu.new_cache()], [ids], [len(ids)])[0].cpu()
    ref = cpu([cpu.new_cache()], [ids], [len(ids)])[0]
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert torch.allclose(got, ref, atol=0.15 * ref.abs().max().item())


@pytest.mark.parametrize("transport", ["zmq", "ucx"])
def test_pull_into_cuda_cache(tiny_pair, transport: str) -> None:  # noqa: ANN001
    if transport == "ucx":
        pytest.importorskip("ucxx")
        pytest.importorskip("cupy")
        from nebula_flow.kv.ucx import UcxTransport

        server = client = UcxTransport()
    else:
        server, client = ZmqTransport(), ZmqTransport()
    model = load_model(tiny_pair / "target", device="cuda")
    holder, puller = KVStore(model), KVStore(model)
    tokens = np.arange(1, 50, dtype=np.int64)
    model([holder.prepare(3, tokens)], [tokens[:-1].tolist()], [1])
    endpoint = server.serve("127.0.0.1", lambda rid, role, s, e: holder.snapshot(rid, s, e))
    try:
        puller.fetch(3, "target", tokens, 48, endpoint, client)
        assert puller.stats.pulled == 48
        assert torch.equal(puller.caches[3].buf[:48], holder.caches[3].buf[:48])
    finally:
        server.close()
        if client is not server:
            client.close()


def test_grouped_attention_on_cuda_matches_attending_apart(tiny_pair, monkeypatch) -> None:  # noqa: ANN001
    """The batch's one attention call per layer (models/batch.py) on CUDA: the same logits as each
    sequence attending apart, for prefills, decodes, a verify block and a token tree."""
    from tests.test_kv_arena import record_plans

    model = load_model(tiny_pair / "target", device="cuda", dtype="float32")
    model.step_graphs = None  # (the eager path's kernels; graphs replay them: test_steps_replay_cuda_graphs_...)
    plans = record_plans(monkeypatch)
    prompts = [list(range(1, n)) for n in (30, 9, 17)]
    steps, parents = [[5], [6, 7, 8], [1, 2, 3, 4]], [None, None, [-1, 0, 0, 1]]

    def run(group: bool) -> list[torch.Tensor]:
        model.group_attention = group
        caches = [model.new_cache() for _ in prompts]
        first = model(caches, prompts, [1] * 3)
        return [x.cpu() for x in first + model(caches, steps, [len(s) for s in steps], parents)]

    apart, together = run(False), run(True)
    assert [bool(made) for made, _ in plans[-2:]] == [True, True]
    for got, want in zip(together, apart):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_flash_attention_kernel_on_cuda_matches_its_reference() -> None:
    """FlashAttention-2's varlen kernel as ``models/flash.py`` calls it, reading an arena chunk in
    place (sequences out of slot order; decode rows, a verify block, a prefill, a prefill after
    cached positions; a sliding window), against its contract computed by SDPA in fp32
    (``reference_varlen``); the new rows' KV lands in their slots."""
    from nebula_flow.models import flash
    from tests.test_kv_arena import reference_varlen

    device = torch.device("cuda")
    assert flash.usable(device, torch.bfloat16, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    chunk = torch.randn(4096, 2, 2, 3, 64, generator=g, device="cuda").bfloat16()  # [slots, layer, K/V, kv heads, dim]
    bases, pasts, lengths = [2000, 100, 3000, 900, 50], [7, 3, 0, 40, 30], [5, 1, 64, 2, 17]
    plan = flash.FlashPlan(chunk, bases, pasts, lengths, None, device)
    rows = sum(lengths)
    for window in (None, 8):
        q = torch.randn(rows, 9, 64, generator=g, device="cuda").bfloat16()
        k, v = (torch.randn(rows, 3, 64, generator=g, device="cuda").bfloat16() for _ in range(2))
        got = flash.attend(plan, 1, window, q, k, v)
        kv = chunk[:, 1]
        assert torch.equal(kv[plan.write, 0], k) and torch.equal(kv[plan.write, 1], v)
        want = reference_varlen(q.float(), kv[:, 0].float(), kv[:, 1].float(), plan.cu_q, plan.starts, plan.max_q,
                                plan.max_k, 0.0, True, False, seqused_k=plan.used,
                                window_size_left=None if window is None else window - 1, window_size_right=0)[0]
        torch.testing.assert_close(got.float(), want.reshape(rows, -1), atol=2e-2, rtol=2e-2)


def test_flash_attention_on_cuda_keeps_a_sequences_bits_where_it_never_splits_keys() -> None:
    """What ``models/flash.py`` states of batch invariance on CUDA: in batches of multi-row blocks
    (verify blocks, prefills) and in windowed layers the kernel never splits keys, so a sequence's
    attention has the bits it has alone (alone with more than one row too); with the kernel's
    ``num_splits`` (PyTorch 2.12 on) in decode batches and mixed ones as well."""
    from nebula_flow.models import flash

    device = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    chunk = torch.randn(12288, 1, 2, 2, 64, generator=g, device="cuda").bfloat16()
    bases, pasts = [0, 2000, 4000, 6000, 8000, 10000], [5, 700, 40, 1500, 90, 3]  # (ranges apart)

    def attention(seqs: list[int], rows: list[int], q: torch.Tensor, window: int | None) -> torch.Tensor:
        plan = flash.FlashPlan(chunk, [bases[i] for i in seqs], [pasts[i] for i in seqs], rows, None, device)
        k, v = chunk[plan.write, 0, 0], chunk[plan.write, 0, 1]  # (the rows' own KV again: the arena keeps its bits)
        return flash.attend(plan, 0, window, q, k, v)

    kinds = [("verify blocks", [5, 3, 5, 2, 5, 4], None), ("decode rows, windowed", [1] * 6, 16),
             ("mixed, windowed", [1, 40, 1, 3, 1, 200], 16)]
    if flash.SPLITS_ARG:
        kinds += [("decode rows", [1] * 6, None), ("mixed", [1, 40, 1, 3, 1, 200], None)]
    for kind, rows, window in kinds:
        q = torch.randn(sum(rows), 8, 64, generator=g, device="cuda").bfloat16()
        together = attention(list(range(6)), rows, q, window)
        start = 0
        for i, n in enumerate(rows):
            alone = attention([i], [n], q[start:start + n].contiguous(), window)
            assert torch.equal(alone, together[start:start + n]), f"{kind}: sequence {i}'s bits differ from alone"
            start += n


def test_bf16_model_on_cuda_attends_through_flash_attention_as_through_sdpa(tiny_pair, monkeypatch) -> None:  # noqa: ANN001
    """The bf16 target on CUDA: prefills, then decodes, a verify block and a token tree in one
    forward. Through FlashAttention (the chains in one call, the tree through the mask) the logits
    are SDPA's within bf16's rounding, and the greedy picks agree."""
    from tests.test_kv_arena import record_plans

    model = load_model(tiny_pair / "target", device="cuda", dtype="bfloat16")
    model.step_graphs = None
    assert model.uses_flash() and model.runtime_status()["attention"] == "flash-attention-2"
    plans = record_plans(monkeypatch)
    prompts = [list(range(1, n)) for n in (30, 9, 17, 120)]
    steps, parents = [[5], [6, 7, 8], [1, 2, 3, 4], [9]], [None, None, [-1, 0, 0, 1], None]

    def run(use_flash: bool) -> list[torch.Tensor]:
        model.flash_attention = use_flash
        caches = [model.new_cache() for _ in prompts]
        first = model(caches, prompts, [1] * 4)
        return [x.float().cpu() for x in first + model(caches, steps, [len(s) for s in steps], parents)]

    sdpa, flash = run(False), run(True)
    # (the tree attended apart: alone, it has no one to share a mask with)
    assert [[p.flash for p in made] for made, _ in plans[-2:]] == [[True], [True]]
    for got, want in zip(flash, sdpa):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_greedy_and_sampled_requests_end_to_end_on_cuda(tiny_pair) -> None:  # noqa: ANN001
    """A pooled deployment on the GPU (fp32, so greedy is comparable bit for bit with HF's on the
    CPU): greedy output is the target's own; sampled requests finish (logits cross to the host once)."""
    import asyncio

    from nebula_flow.client import AsyncClient
    from nebula_flow.deploy import Deployment
    from tests.conftest import deploy_config, hf_greedy

    cfg = deploy_config(tiny_pair, "pooled", 1, 1, max_batch=4)
    for pool in (cfg.draft, cfg.target):
        pool.device, pool.dtype = "cuda", "float32"
        pool.devices = ["cuda:0"]
    prompts = [[5 + i, 40 + 3 * i, 7, 300 + i] for i in range(4)]

    async def run(address: str) -> list:
        async with AsyncClient(address, timeout_s=120) as client:
            greedy = [client.generate(token_ids=p, max_new_tokens=24) for p in prompts]
            sampled = [client.generate(token_ids=p, max_new_tokens=24, temperature=0.8, seed=i) for i, p in enumerate(prompts)]
            return await asyncio.gather(*greedy, *sampled)

    with Deployment(cfg) as dep:
        outs = asyncio.run(run(dep.address))
    for p, out in zip(prompts, outs[:4]):
        assert out.token_ids == hf_greedy(tiny_pair / "target", p, 24)
    assert all(len(o.token_ids) == 24 or o.finish_reason == "stop" for o in outs[4:])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_workers_land_on_two_devices(tiny_pair) -> None:  # noqa: ANN001
    import asyncio

    from nebula_flow.client import AsyncClient, Client
    from nebula_flow.deploy import Deployment
    from tests.conftest import deploy_config

    async def two_at_once(address: str) -> list:
        async with AsyncClient(address, timeout_s=120) as client:
            return await asyncio.gather(*(client.generate(token_ids=[1, 2, 3 + i], max_new_tokens=16) for i in range(2)))

    cfg = deploy_config(tiny_pair, "autoregressive", 0, 2, max_batch=1)
    cfg.target.device = "cuda"
    with Deployment(cfg) as dep, Client(dep.address) as client:
        # (two at once on workers of one task each: both compute; a worker reports its device with its results)
        assert all(o.token_ids for o in asyncio.run(two_at_once(dep.address)))
        devices = {w["device"].get("device") for w in client.status()["workers"] if w["device"]}
    assert devices == {"cuda:0", "cuda:1"}, devices


def test_batch_invariant_bf16_on_cuda_keeps_a_positions_bits(tiny_pair) -> None:  # noqa: ANN001
    """What holds on CUDA when ``batch_invariant`` is turned on there (it is off by default on
    CUDA): the same machinery as on a CPU (linears in probed call sizes, each row's attention its
    own problem, rows of one size stacked) gives a position the same logits bit for bit in a
    decode, a verify block, a ragged batch and a prefill."""
    model = load_model(tiny_pair / "target", device="cuda", dtype="bfloat16", batch_invariant=True)
    assert model.batch_invariant
    prompt, extra, other = list(range(3, 14)), [20, 21, 22, 23, 24], list(range(30, 37))
    cache = model.new_cache()
    model([cache], [prompt], [1])
    decoded = torch.cat([model([cache], [[t]], [1])[0] for t in extra])
    cache = model.new_cache()
    model([cache], [prompt], [1])
    verified = model([cache], [extra], [5])[0]
    a, b = model.new_cache(), model.new_cache()
    model([a, b], [prompt, other], [1, 1])
    batched = model([b, a], [extra[:3], extra], [3, 5])[1]
    prefilled = model([model.new_cache()], [prompt + extra], [5])[0]
    for name, got in (("verify", verified), ("ragged batch", batched), ("prefill", prefilled)):
        assert torch.equal(got, decoded), f"{name} logits differ from decode logits on CUDA"


def test_draft_steps_on_cuda_wait_for_the_device_once_whatever_k(tiny_pair) -> None:  # noqa: ANN001
    """A batch's draft steps on CUDA (``workers/draft_steps.py``): greedy and sampled drafts equal
    the host loop's (one sequence, step by step, each token read on the host); the synchronising
    calls (torch's sync debug mode counts them, host-to-device copies from pageable memory
    included) are a few per batch whatever k; and the forwards' times reach the step costs as the
    device's (``ForwardClock``), not the launches'."""
    import warnings

    from nebula_flow import specdec
    from nebula_flow.params import SamplingParams
    from nebula_flow_workers.runner import ModelRunner, Task

    model = load_model(tiny_pair / "draft", device="cuda", dtype="float32")
    kinds = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95)]

    def host_loop(t: Task) -> list[int]:
        cache, feed, out = model.new_cache(), t.tokens.tolist(), []
        for step in range(t.k):
            row = model([cache], [feed], [1])[0][0]
            out.append(int(model.token_ids(torch.tensor(specdec.propose(row, t.params, t.seed, len(t.tokens) + step, 8)[0]))))
            feed = [out[-1]]
        return out

    def syncs(k: int) -> int:
        runner = ModelRunner(model, proposal_top_k=8)
        tasks = [Task(rid, "draft", 1, 1, np.arange(1, 12 + rid), k, p, rid) for rid, p in enumerate(kinds)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                drafts = runner.draft(tasks)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(len(d.tokens) == k for d in drafts)
        # (a batch's forwards are costed by their rows in all; step costs take single-sequence ones)
        assert runner.batch_costs.seconds and min(runner.batch_costs.seconds.values()) > 0 and runner.busy_s > 0
        return sum("synchroniz" in str(w.message) for w in caught)

    for p in kinds:
        t = Task(0, "draft", 1, 1, np.arange(1, 12), 5, p, 3)
        assert ModelRunner(model, proposal_top_k=8).draft([t])[0].tokens == host_loop(t)
    assert syncs(1) == syncs(6) <= 3  # (the one read of the steps' choices; host copies never wait: models/staging.py)


def test_kv_copies_do_not_wait_behind_the_running_batch(tiny_pair) -> None:  # noqa: ANN001
    """A KV pull over ZeroMQ into CUDA memory, and the holder's copy out of it, run on copy
    streams of their own (``kv/device_copy.py``): both finish while the compute stream is still
    busy, and a forward on the pulled cache then gives the holder's logits (it waits for the copy)."""
    from nebula_flow.kv import device_copy

    server, client = ZmqTransport(), ZmqTransport()
    model = load_model(tiny_pair / "target", device="cuda", dtype="float32")
    holder, puller = KVStore(model), KVStore(model)
    tokens = np.arange(1, 50, dtype=np.int64)
    model([holder.prepare(3, tokens)], [tokens[:-1].tolist()], [1])
    torch.cuda.synchronize()
    device_copy.batch_done(torch.device("cuda", 0))
    endpoint = server.serve("127.0.0.1", lambda rid, role, s, e: holder.snapshot(rid, s, e))
    try:
        torch.cuda._sleep(3_000_000_000)  # (the running batch: a second or more of the compute stream)
        busy = torch.cuda.Event()
        busy.record()
        puller.fetch(3, "target", tokens, 48, endpoint, client)
        assert puller.stats.pulled == 48 and puller.caches[3].ready is not None
        assert not busy.query(), "the pull waited for the compute stream"
        want = model([holder.prepare(3, tokens)], [[int(tokens[-1])]], [1])[0]
        got = model([puller.prepare(3, tokens)], [[int(tokens[-1])]], [1])[0]
        assert torch.equal(got.cpu(), want.cpu())
    finally:
        server.close()
        client.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_replay_cuda_graphs_that_match_eager_steps(tiny_pair, dtype: str) -> None:  # noqa: ANN001
    """Decode steps and verify blocks on CUDA replay recorded graphs (``models/graphs.py``): each
    recorded graph passed its bit-for-bit check against the eager step (graphs stay on), a draft
    made through graphs equals one made with graphs off, greedy and sampled, and so do the
    committed tokens of verify blocks and of token trees, of one k and of mixed k (padded). In
    fp32 attention is SDPA's; in bf16 FlashAttention's (token trees: SDPA's)."""
    from nebula_flow.params import SamplingParams
    from nebula_flow_workers.runner import ModelRunner, Task

    graphed = load_model(tiny_pair / "draft", device="cuda", dtype=dtype)
    eager = load_model(tiny_pair / "draft", device="cuda", dtype=dtype)
    eager.step_graphs = None
    assert graphed.step_graphs is not None
    kinds = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=1)]
    for size in (1, 3):
        tasks = [Task(rid, "draft", 1, 1, np.arange(1, 20 + 7 * rid), 6, kinds[rid % 2], rid) for rid in range(size)]
        got = ModelRunner(graphed, proposal_top_k=8).draft(tasks)
        want = ModelRunner(eager, proposal_top_k=8).draft(tasks)
        assert [d.tokens for d in got] == [d.tokens for d in want]
    assert graphed.step_graphs.enabled and graphed.step_graphs.replays >= 10
    target, target_eager = (load_model(tiny_pair / "target", device="cuda", dtype=dtype) for _ in range(2))
    target_eager.step_graphs = None

    def rounds(model, runner_ups: list[int]) -> list:  # noqa: ANN001
        """A verify with the prompt's prefill (wider than a graph: eager), then over the cached KV
        blocks of one width, then of mixed k (padded to the widest): graphs."""
        runner, tokens, out = ModelRunner(model), [np.arange(1, 20 + 3 * rid) for rid in range(3)], []
        for r in (1, 2, 3):
            drafts = [[5, 6, 7, 8][:4 - rid * (r == 3)] for rid in range(3)]
            tasks = [Task(rid, "verify", r, 1, tokens[rid], len(drafts[rid]), kinds[0], rid, draft=drafts[rid],
                          runner_ups=list(runner_ups)) for rid in range(3)]
            out.append(runner.verify(tasks))
            tokens = [np.concatenate([t, np.array(c, dtype=t.dtype)]) for t, c in zip(tokens, out[-1])]
        return out

    for runner_ups in ([], [7]):  # (verify blocks, then token trees)
        assert rounds(target, runner_ups) == rounds(target_eager, runner_ups)
    assert target.step_graphs.enabled and target.step_graphs.replays >= 4


def test_graphs_recorded_at_start_serve_the_first_requests(tiny_pair) -> None:  # noqa: ANN001
    """A worker records its short-context graphs at start (``StepGraphs.capture``): real CUDA
    graphs, each checked against its eager step; a draft of five requests (padded to a graph of
    eight) then replays them without recording another, and gives the eager model's tokens."""
    from nebula_flow.params import SamplingParams
    from nebula_flow_workers.runner import ModelRunner, Task

    graphed, eager = (load_model(tiny_pair / "draft", device="cuda", dtype="float32") for _ in range(2))
    eager.step_graphs = None
    runner = ModelRunner(graphed)  # (its KV store makes the arena: a worker warms up after, as here)
    assert graphed.step_graphs.capture(6) == 4 * 5 and graphed.step_graphs.enabled
    tasks = [Task(rid, "draft", 1, 1, np.arange(1, 20 + 3 * rid), 6, SamplingParams(max_new_tokens=8), rid)
             for rid in range(5)]
    assert [d.tokens for d in runner.draft(tasks)] == [d.tokens for d in ModelRunner(eager).draft(tasks)]
    assert graphed.step_graphs.recorded == 20 and graphed.step_graphs.replays >= 5


def test_rotary_embedding_on_cuda_turns_as_the_reference_does() -> None:
    """``rotate`` (a roll, the sign carried by ``signed_sin``) gives the reference's rotation on
    CUDA, bit for bit, in bf16 and fp32 (tests/test_models.py checks it on the CPU)."""
    from nebula_flow.models.llama import rotate, signed_sin
    from tests.test_models import reference_rotation

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x, angles = torch.randn(16, 24, 128, generator=g).to(dtype).cuda(), torch.randn(16, 1, 64, generator=g)
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos().to(dtype).cuda(), emb.sin().to(dtype).cuda()
        assert torch.equal(rotate(x, cos, signed_sin(sin)), reference_rotation(x, cos, sin))


def test_a_model_loaded_without_cuda_graphs_runs_eagerly(tiny_pair) -> None:  # noqa: ANN001
    """``cuda_graphs=False`` (a pool's ``cuda_graphs = false``, a worker's ``--enforce-eager``)."""
    assert load_model(tiny_pair / "draft", device="cuda").step_graphs is not None
    assert load_model(tiny_pair / "draft", device="cuda", cuda_graphs=False).step_graphs is None
