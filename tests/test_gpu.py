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
