"""Linear layers with their weight packed once, at load, into the CPU kernel's blocked layout.

A bf16 ``F.linear`` on a CPU hands oneDNN a plain row-major weight, which the kernel reorders into
its blocked layout on every call: for the few rows of a decode step or a verify that reorder costs
as much as the product. Packing once removes it. Measured on the bundled target's shapes, one
thread: a 576 -> 3072 projection of one row 143 -> 70 us, the 49k-row output head 6.4 -> 3.9 ms;
at 64 rows the gain shrinks to ~10 %. The packed kernel gave the same bits as ``F.linear`` on
every shape and row count tried, and the batch-invariance probe (``invariant.row_plan``) runs on
the kernel the layer really uses, so invariance holds either way.

Only where it pays and exists: bf16 weights on a CPU with PyTorch's oneDNN build. fp32 (MKL) gave
no gain; fp16 needs CPU features many machines lack. Anything else keeps ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in the oneDNN layout, or None where packing does not apply or is unavailable."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        if not torch.equal(linear(probe, packed, None), F.linear(probe, weight)):
            return None  # a kernel that rounds differently from the unpacked one: not worth the doubt
        return packed
    except (RuntimeError, AttributeError):  # a build or CPU without the packed bf16 path
        return None


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with a weight from ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
