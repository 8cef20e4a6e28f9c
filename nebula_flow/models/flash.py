"""Attention on CUDA in one FlashAttention-2 call per layer, reading the KV arena in place.

PyTorch ships FlashAttention-2's kernels (``aten::_flash_attention_forward``); its varlen form
takes the batch's query rows packed, each sequence's key range by where it starts
(``cu_seqlens_k``) and how many keys it has (``seqused_k``). A request's KV is a contiguous range
of one arena chunk (``kv/arena.py``), so the keys of every sequence of the chunk are read where
they lie: no gather into a padded copy, no mask (causal from each sequence's last key, sliding
windows by the kernel), no padding rows, prefills of any length in the same call as decode
steps and verify blocks. The plans here hold those few index tensors, made once per forward (a
CUDA graph's in fixed tensors, ``models.graphs``).

What it does not take: token trees (a row sees its own path, not every earlier row: they attend
through a mask, ``models.batch.GroupPlan``), fp32 (the kernel is fp16/bf16 only), GPUs before
Ampere. Batch invariance: a sequence's attention bits do not depend on its batch where the
kernel takes ``num_splits`` (PyTorch 2.12 and later: one split). Before that, the kernel splits
the keys of a decode batch (one row a sequence, grouped-query heads, no window) into a number of
parts it picks from the batch size and the longest key count, so there a sequence's bits may
depend on what it is batched with; batches with wider sequences (verify blocks, prefills) and
windowed layers are never split, and a sequence keeps its bits among them. (An H200 with PyTorch
2.11, ``tools/gpu_attention_probe.py``: 7 of 8 probed batch shapes kept each sequence's bits alone;
the one that did not held a 200-row prefill, its decode row alone a decode batch of one.) The
matrix products around attention are not batch-invariant on CUDA either (``models.invariant``
makes them so).
"""

from __future__ import annotations

import torch

from nebula_flow.models import staging

kernel = torch.ops.aten._flash_attention_forward  # (FlashAttention-2's varlen forward, as PyTorch builds it)
# (PyTorch 2.12 added ``num_splits``: with 1 the split over keys, chosen from the batch, is off)
SPLITS_ARG = "num_splits" in str(kernel.default._schema)


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a model on ``device`` in ``dtype`` attends through FlashAttention-2 (else SDPA)."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def skip_cudnn_attention(device: torch.device) -> None:
    """On CUDA, SDPA (token trees, fp32, shared-file caches) picks from flash, memory-efficient and
    math kernels, not cuDNN's: cuDNN builds a plan for each new shape, which cost 43-46 ms on
    every new prompt length's first prefill (measured on an H200, PyTorch 2.11, against 0.06 ms
    without cuDNN and 0.14 ms for cuDNN's second call), and prompt lengths rarely repeat. The
    switch is the process's (a worker's process runs only its models)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def indices(bases: torch.Tensor, pasts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host-made int tensors of a batch whose sequence i starts at slot ``bases[i]`` of the chunk,
    has ``pasts[i]`` cached positions and ``lengths[i]`` new rows: the slots the new rows' KV goes
    to (in row order), the query rows' cumulative counts, where each sequence's keys start (and one
    past the last's end) and how many keys each has."""
    ends = pasts + lengths
    row = torch.arange(int(lengths.max()))
    write = (bases + pasts)[:, None].add(row[None, :])[row[None, :] < lengths[:, None]]
    cu_q = torch.cat((torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)))
    starts = torch.cat((bases, bases[-1:] + ends[-1:])).to(torch.int32)
    return write, cu_q, starts, ends.to(torch.int32)


class FlashPlan:
    """How a batch's sequences of one chunk attend in one call per layer: ``rows``, their rows among
    the forward's (None: all, in order); ``write``, the slots their new KV goes to; ``cu_q``,
    ``starts`` and ``used`` as the kernel takes them (``indices``)."""

    flash = True

    def __init__(self, chunk: torch.Tensor, bases: list[int], pasts: list[int], lengths: list[int],
                 rows: torch.Tensor | None, device: torch.device) -> None:
        self.chunk, self.rows = chunk, rows
        made = indices(torch.tensor(bases), torch.tensor(pasts), torch.tensor(lengths))
        self.write, self.cu_q, self.starts, self.used = (staging.to_device(t, device) for t in made)
        self.max_q, self.max_k = max(lengths), max(p + n for p, n in zip(pasts, lengths))


def attend(plan: FlashPlan, layer: int, window: int | None, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> torch.Tensor:
    """The attention of ``plan``'s rows at ``layer`` ([rows, heads, head_dim] each of q, k, v; the
    new KV written into the arena first), [rows, heads * head_dim]."""
    kv = plan.chunk[:, layer]  # [slots, 2, kv_heads, head_dim]: strided views, read in place
    kv.index_copy_(0, plan.write, torch.stack((k, v), 1))
    extra = {"num_splits": 1} if SPLITS_ARG else {}
    if window is not None:  # (a row at position p sees keys p - window + 1 .. p)
        extra.update(window_size_left=window - 1, window_size_right=0)
    out = kernel(
        q, kv[:, 0], kv[:, 1], plan.cu_q, plan.starts, plan.max_q, plan.max_k, 0.0, True, False,
        seqused_k=plan.used, **extra)[0]
    return out.reshape(q.shape[0], -1)  # (a view, unless the kernel's grouped-query decode path left it strided)
