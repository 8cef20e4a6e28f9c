"""What torch's attention kernels do on this GPU, standalone (no project code), for docs/benchmarks.md
("FlashAttention over the arena, cuDNN's per-shape plans"):
  1. FlashAttention-2's varlen forward reading an arena-shaped tensor in place (``cu_seqlens_k`` =
     where each sequence starts, ``seqused_k`` = its keys), against fp32 SDPA: the largest
     difference, and whether each sequence gets the bits it gets alone, per batch shape, with and
     without a sliding window, with one key split (where the kernel takes ``num_splits``) and with
     the kernel's own choice;
  2. the same call captured in a CUDA graph, replayed with other key counts;
  3. the first and second call of a causal prefill at new lengths: SDPA as torch picks, SDPA
     without cuDNN, FlashAttention varlen.
  python3 tools/gpu_attention_probe.py     (on a CUDA machine; ~10 s)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNEL = torch.ops.aten._flash_attention_forward
SPLITS = "num_splits" in str(KERNEL.default._schema)
DEV, DTYPE = torch.device("cuda"), torch.bfloat16
LAYERS, KV_HEADS, HEADS, DIM, SLOTS = 2, 3, 9, 64, 4096
CHUNK = torch.randn(SLOTS, LAYERS, 2, KV_HEADS, DIM, dtype=DTYPE, device=DEV)
KEYS, VALUES = CHUNK[:, 1, 0], CHUNK[:, 1, 1]  # (one layer's strided view, as the arena's)
# name: (where each sequence starts, cached positions, new rows)
BATCHES = {"decode": ([100, 900, 2000, 50], [10, 300, 77, 1], [1, 1, 1, 1]),
           "verify": ([100, 900, 2000, 50], [10, 300, 77, 1], [5, 5, 5, 5]),
           "mixed": ([100, 900, 2000, 3000], [0, 300, 77, 5], [200, 1, 6, 17]),
           "out of slot order": ([2000, 100, 3000, 900], [7, 3, 0, 40], [3, 1, 64, 2])}


def reference(q: torch.Tensor, base: int, past: int, window: int | None) -> torch.Tensor:
    n = q.shape[0]
    end = past + n
    pos, key = torch.arange(past, end, device=DEV)[:, None], torch.arange(end, device=DEV)[None, :]
    allowed = (key <= pos) & ((pos - key < window) if window else True)
    k, v = (t[base:base + end].transpose(0, 1)[None].float() for t in (KEYS, VALUES))
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), k, v, attn_mask=allowed, enable_gqa=True)
    return out[0].transpose(0, 1)


def flash(q: torch.Tensor, bases: list[int], pasts: list[int], rows: list[int], window: int | None,
          one_split: bool) -> torch.Tensor:
    ends = [p + n for p, n in zip(pasts, rows)]
    cu_q = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    starts = torch.tensor(bases + [bases[-1] + ends[-1]], dtype=torch.int32, device=DEV)
    extra: dict = {"seqused_k": torch.tensor(ends, dtype=torch.int32, device=DEV)}
    if window:
        extra.update(window_size_left=window - 1, window_size_right=0)
    if one_split:
        extra["num_splits"] = 1
    return KERNEL(q, KEYS, VALUES, cu_q, starts, max(rows), max(ends), 0.0, True, False, **extra)[0]


def against_reference() -> None:
    for name, (bases, pasts, rows) in BATCHES.items():
        for window in (None, 8):
            for one_split in ((True, False) if SPLITS else (False,)):
                q = torch.randn(sum(rows), HEADS, DIM, dtype=DTYPE, device=DEV)
                out = flash(q, bases, pasts, rows, window, one_split)
                errors, invariant, start = [], True, 0
                for b, p, n in zip(bases, pasts, rows):
                    errors.append(float((out[start:start + n].float() - reference(q[start:start + n], b, p, window)).abs().max()))
                    alone = flash(q[start:start + n].contiguous(), [b], [p], [n], window, one_split)
                    invariant &= torch.equal(alone, out[start:start + n])
                    start += n
                print(f"{name}, window {window}, one split {one_split}: largest difference {max(errors):.4f}, "
                      f"each sequence's bits as alone: {invariant}")


def in_a_graph() -> None:
    bases = [i * 400 for i in range(8)]
    q = torch.randn(8, HEADS, DIM, dtype=DTYPE, device=DEV)
    cu_q = torch.arange(9, dtype=torch.int32, device=DEV)
    starts = torch.tensor(bases + [4000], dtype=torch.int32, device=DEV)
    used = torch.full((8,), 10, dtype=torch.int32, device=DEV)

    def step() -> torch.Tensor:
        return KERNEL(q, KEYS, VALUES, cu_q, starts, 1, 256, 0.0, True, False, seqused_k=used)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    used.copy_(torch.tensor([5, 50, 100, 200, 3, 7, 250, 1], dtype=torch.int32))
    graph.replay()
    eager = step()
    error = max(float((out[i:i + 1].float() - reference(q[i:i + 1], bases[i], int(used[i]) - 1, None)).abs().max())
                for i in range(8))
    print(f"graph replay with other key counts: equal to eager {torch.equal(out, eager)}, largest difference {error:.4f}")


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def first_calls() -> None:
    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    for shift, label in enumerate(("SDPA as torch picks", "SDPA without cuDNN", "FlashAttention varlen")):
        firsts, seconds = [], []
        for n in (37, 41, 53, 67, 83, 97, 131):
            n += shift  # (lengths no earlier label saw)
            q, k = torch.randn(1, HEADS, n, DIM, dtype=DTYPE, device=DEV), torch.randn(1, KV_HEADS, n, DIM, dtype=DTYPE, device=DEV)
            packed = torch.randn(n, HEADS, DIM, dtype=DTYPE, device=DEV)

            def call(n: int = n, q: torch.Tensor = q, k: torch.Tensor = k, packed: torch.Tensor = packed,
                     label: str = label) -> object:
                if label == "FlashAttention varlen":
                    return flash(packed, [0], [0], [n], None, False)
                if label == "SDPA as torch picks":
                    return F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
                with sdpa_kernel(no_cudnn):
                    return F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)

            firsts.append(timed(call))
            seconds.append(timed(call))
        print(f"{label}: first call ms {[round(x, 2) for x in firsts]}, second {[round(x, 2) for x in seconds]}")


if __name__ == "__main__":
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "num_splits:", SPLITS)
    against_reference()
    in_a_graph()
    first_calls()
