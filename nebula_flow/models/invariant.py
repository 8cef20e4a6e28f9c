"""Batch-invariant numerics: a token's logits do not depend on what it is computed alongside.

Speculative decoding is lossless only if the verifier scores a position exactly as plain decoding
would. But the two compute it in different shapes: decoding runs one row per sequence, the verifier
k+1 rows of one sequence at once, and a batch stacks rows of many sequences. In fp32 the kernels'
shape-dependent rounding stays around 1e-6 and has not flipped a greedy choice in our tests; in
bf16 every layer rounds its output to 8 mantissa bits, so one different accumulation order can
change a bit, and near ties the greedy token changes with it (measured on the bundled pair: the
speculative output left the target's own greedy output on most prompts).

Batch-invariant mode removes the shape dependence where it comes from:

* Linear layers run on row chunks of at most ``ROW_CHUNK`` rows. :func:`rows_independent` probes,
  once per weight shape, whether the kernels give a row the same bits for every chunk size up to
  that; where they do not, chunks are zero-padded to exactly ``ROW_CHUNK`` rows, so every row goes
  through the same kernel with the same shape.
* Attention runs one query row at a time against exactly its own prefix (the decode shape), never
  as a masked block (see ``llama.Attention``).

Elementwise and per-row operations (norms, rotary embedding, activations) do not mix rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_CHUNK = 8  # rows per linear call; bf16 CPU kernels keep each row's bits up to this size


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pad: bool) -> torch.Tensor:
    """``F.linear`` over row chunks of ``ROW_CHUNK`` (zero-padded to that size when ``pad``)."""
    rows = x.shape[0]
    if rows <= ROW_CHUNK and not pad:
        return F.linear(x, weight, bias)
    outs = []
    for start in range(0, rows, ROW_CHUNK):
        part = x[start:start + ROW_CHUNK]
        n = part.shape[0]
        if pad and n < ROW_CHUNK:
            part = torch.cat([part, part.new_zeros(ROW_CHUNK - n, part.shape[1])])
        outs.append(F.linear(part, weight, bias)[:n])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


@torch.inference_mode()
def rows_independent(weight: torch.Tensor, trials: int | None = None) -> bool:
    """True when a row's product with ``weight`` has the same bits for every call size from 1 to
    ``ROW_CHUNK`` rows. Checked on random inputs in the weight's dtype and device, ``trials``
    times (default: 64 for small weights, 16 for large): the kernels' shape-dependent rounding
    shows only on some inputs (measured: bf16 with
    1536 inputs per row differs between 1-row and 8-row calls on about 80 % of random inputs,
    between 3-row and 8-row calls on about 10 %)."""
    if trials is None:  # cheap for small weights, so look harder there
        trials = 64 if weight.numel() < (1 << 20) else 16
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):
        x = (3 * torch.randn(ROW_CHUNK, weight.shape[1], generator=gen)).to(dtype=weight.dtype, device=weight.device)
        whole = F.linear(x, weight)
        for m in range(1, ROW_CHUNK):
            if not torch.equal(torch.cat([F.linear(x[s:s + m], weight) for s in range(0, ROW_CHUNK, m)]), whole):
                return False
    return True
