"""Batch-invariant numerics: a token's logits do not depend on what it is computed alongside.

Speculative decoding is lossless only if the verifier scores a position exactly as plain decoding
would. But the two compute it in different shapes: decoding runs one row per sequence, the verifier
k+1 rows of one sequence at once, and a batch stacks rows of many sequences. In fp32 the kernels'
shape-dependent rounding stays around 1e-6 and has not flipped a greedy choice in our tests; in
bf16 every layer rounds its output to 8 mantissa bits, so one different accumulation order can
change a bit, and near ties the greedy token changes with it (measured on the bundled pair: the
speculative output left the target's own greedy output on most prompts).

Batch-invariant mode removes the shape dependence where it comes from:

* Linear layers run on row chunks. :func:`row_plan` probes, once per weight shape, which call sizes
  give a row the same bits: every size up to ``ROW_CHUNK`` (8) for most CPU bf16 kernels, often
  up to 32 or ``MAX_CHUNK`` (64) too, so a prefill or a big batch makes few calls; where small calls
  round differently, calls are zero-padded to a multiple of ``ROW_CHUNK`` rows (measured: a 1536-wide
  bf16 input rounds one way for 1-7 rows and another for 8, 16, ..., 64), so every row goes
  through a kernel that gives it the same bits.
* Attention poses each query row as a problem of its own size, whatever batch it is in: the row
  against its own keys padded to a bucket, rows of one size stacked as a call's batch dimension
  (``models.rows``).

Elementwise and per-row operations (norms, rotary embedding, activations) do not mix rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Product = Callable[[torch.Tensor], torch.Tensor]  # rows -> the layer's output rows, one kernel call

ROW_CHUNK = 8  # call sizes up to this keep each row's bits on bf16 CPU kernels (or, padded, its multiples)
MAX_CHUNK = 64  # the largest call a probe may allow
WIDER_CHUNKS = (MAX_CHUNK, 32, 16)  # the call sizes above ROW_CHUNK a probe tries, widest first
LARGE = 1 << 20  # elements: larger weights (output heads) get a cheaper probe


@dataclass(frozen=True)
class RowPlan:
    """How a batch-invariant linear runs: calls of at most ``chunk`` rows; a call of more than
    ``exact`` rows is zero-padded up to a multiple of ``multiple`` rows."""

    chunk: int
    exact: int
    multiple: int = 1


def chunked_linear(x: torch.Tensor, product: Product, plan: RowPlan) -> torch.Tensor:
    """A linear layer's ``product`` in the call sizes ``plan`` allows."""
    rows = x.shape[0]
    if rows <= plan.chunk and (rows <= plan.exact or rows % plan.multiple == 0):
        return product(x)
    outs = []
    for start in range(0, rows, plan.chunk):
        part = x[start:start + plan.chunk]
        n = part.shape[0]
        padded = n if n <= plan.exact else -(-n // plan.multiple) * plan.multiple
        if padded > n:
            part = torch.cat([part, part.new_zeros(padded - n, part.shape[1])])
        outs.append(product(part)[:n])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def row_plan(weight: torch.Tensor, product: Product | None = None) -> RowPlan:
    """The fastest plan whose call sizes all give a row the same bits, probed on this weight with
    the kernel the layer runs (``product``; default ``F.linear``): the widest call of
    ``WIDER_CHUNKS`` whose every size up to it keeps a row's bits (probed for small weights only:
    output heads cost milliseconds a probe call), or, padded to multiples of ``ROW_CHUNK``, the
    widest whose multiples do; the wider of the two (exact calls on a tie). A CPU kernel that
    changes its blocking at 48 rows still runs 9-32-row verifies in one call (measured on the
    bundled target, AMX bf16: every size up to 32 keeps a row's bits, 48 and 64 do not; one call
    instead of two halves a 12-row verify's reads of the weights)."""
    small = weight.numel() <= LARGE

    def independent(sizes: range, total: int, trials: int | None = None) -> bool:
        return rows_independent(weight, sizes, total, trials, product)

    def widest(sizes: Callable[[int], range], trials: int, above: int = 0) -> int | None:
        return next((c for c in WIDER_CHUNKS if c > above and independent(sizes(c), c, trials)), None)

    def multiples(c: int) -> range:
        return range(ROW_CHUNK, c + 1, ROW_CHUNK)

    padded_trials = 8 if small else 2
    if independent(range(1, ROW_CHUNK + 1), ROW_CHUNK):
        exact = (small and widest(lambda c: range(1, c + 1), trials=8)) or ROW_CHUNK
        padded = widest(multiples, padded_trials, above=exact)
        if padded is not None:
            return RowPlan(padded, ROW_CHUNK, ROW_CHUNK)
        return RowPlan(exact, exact)
    return RowPlan(widest(multiples, padded_trials) or ROW_CHUNK, 0, ROW_CHUNK)


@torch.inference_mode()
def rows_independent(weight: torch.Tensor, sizes: range, total: int, trials: int | None = None,
                     product: Product | None = None) -> bool:
    """True when, for every call size in ``sizes``, a row's product with ``weight`` has the bits
    it has in one call of ``total`` rows (calls of ``total`` rows cut into calls of each size; the
    last may be shorter, so ``sizes`` must allow it). Checked on random inputs in the weight's
    dtype and device, ``trials`` times (default: 64 for small weights, 16 for large): the kernels'
    shape-dependent rounding shows only on some inputs (measured: bf16 with 1536 inputs per row
    differs between 1-row and 8-row calls on about 80 % of random inputs, between 3-row and 8-row
    calls on about 10 %). ``product`` is the kernel under test (default ``F.linear`` on ``weight``;
    only the weight's shape, dtype and device are read otherwise)."""
    product = product or (lambda x: F.linear(x, weight))
    if trials is None:  # cheap for small weights, so look harder there
        trials = 64 if weight.numel() <= LARGE else 16
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):
        x = (3 * torch.randn(total, weight.shape[1], generator=gen)).to(dtype=weight.dtype, device=weight.device)
        whole = product(x)
        for m in sizes:
            if m != total and not torch.equal(torch.cat([product(x[s:s + m]) for s in range(0, total, m)]), whole):
                return False
    return True


@torch.inference_mode()
def same_bits_across_threads(model: Callable, counts: list[int]) -> bool:
    """True when ``model`` (a ``CausalLM``) gives the same logits, bit for bit, at each torch
    thread count in ``counts``: a ragged prefill, then a decode row beside a 5-row and a 20-row
    verify (a call size of its own: ``row_plan`` may allow up to 32 rows in one call). A worker
    that borrows idle cores (``nebula_flow.cores``) computes at varying counts, which must not
    change a bit in batch-invariant mode (measured on AVX-512 bf16 oneDNN: it does not; fp32 MKL
    does, by up to ~5e-5, as batch shapes do). Leaves torch at the last count."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (37, 9, 21)]
    outs = []
    for n in counts:
        torch.set_num_threads(n)
        caches = [model.new_cache(64) for _ in prompts]
        first = model(caches, prompts, [1, 1, 1])
        then = model(caches, [prompts[0][:1], prompts[1][:5], prompts[2][:20]], [1, 5, 20])
        outs.append(torch.cat([x.float().flatten() for x in first + then]))
    return all(torch.equal(outs[0], o) for o in outs[1:])
