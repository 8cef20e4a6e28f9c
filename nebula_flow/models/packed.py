"""Linear layers with their weight packed once, at load, into the CPU kernel's blocked layout.

A bf16 ``F.linear`` on a CPU hands oneDNN a plain row-major weight, which the kernel reorders into
its blocked layout on every call: for the few rows of a decode step or a verify that reorder costs
as much as the product. Packing once removes it. Measured on the bundled target's shapes, one
thread: a 576 -> 3072 projection of one row 143 -> 70 us, the 49k-row output head 6.4 -> 3.9 ms;
at 64 rows the gain shrinks to ~10 %. The packed kernel gave the same bits as ``F.linear`` on
every shape and row count tried, and the batch-invariance probe (``invariant.row_plan``) runs on
the kernel the layer really uses, so invariance holds either way.

In fp32 a plain ``F.linear`` (MKL) is the fastest for one to three rows, but from four rows on it
takes twice as long (on an AVX-512 CPU here: the 576 -> 3072 projection 0.25 ms for 1-3 rows,
0.49 ms for 4, 0.73 ms for 8; the output head 5.9, 8.0, 13.6, 22.1 ms for 1, 3, 4, 8 rows), while
the packed oneDNN kernel stays nearly flat (0.30 ms at 4 rows, 0.40 at 8; the head 8.1 and 9.2 ms):
a verify block ran at the cost of a decode step and a half. So an fp32 layer keeps its plain
weight and uses the packed one from the fewest rows where it is faster (timed at load for each
weight shape and kept, ``first_faster_rows``); a shape where it never is keeps only ``F.linear``. fp16
needs CPU features many machines lack. Anything else keeps ``F.linear``.

At many rows the two kernels converge (on a 2-core AVX2 AMD EPYC VM, one thread: the 576 -> 1536
projection 144 against 116 us at 2 rows, 299 against 242 at 8, 456 against 424 at 16). So a row
count where the packed kernel is not clearly faster must not rule it out from the counts where
it is: a tie read as 0.93 at 16 rows once left half the bundled target's layers on ``F.linear``,
whose verify then took 67 ms instead of 53 (the rule now: faster from there, never clearly slower).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from nebula_flow.models import probe_cache

PROBE_ROWS = (1, 2, 3, 4, 6, 8, 16)  # a decode step to a long verify block
PROBE_REPEATS = 5
FASTER = 0.9  # from its first rows the packed kernel must take under this share of the plain one's time,
NOT_SLOWER = 1.15  # and at more rows no more than this (a wrong "slower" there costs far more than a tie)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in the oneDNN layout (bf16 or fp32), or None where packing does not apply or is
    unavailable. A bf16 packed kernel must give the plain one's bits; an fp32 one its values within
    fp32 rounding (it accumulates in another order, as MKL itself does between 3 and 4 rows)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) \
            or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got, plain = linear(probe, packed, None), F.linear(probe, weight)
        same = torch.equal(got, plain) if weight.dtype == torch.bfloat16 else torch.allclose(got, plain, 1e-4, 1e-5)
        return packed if same else None  # (a kernel that rounds otherwise: not worth the doubt)
    except (RuntimeError, AttributeError):  # a build or CPU without the packed path
        return None


def first_faster_rows(weight: torch.Tensor, packed: torch.Tensor) -> int | None:
    """The fewest rows from which ``packed`` is the kernel to run for ``weight`` (``from_ratios``),
    or None if it never is. bf16: 1 (the plain kernel reorders its weight on every call); fp32:
    from the two kernels' timed ratios (``ratios``), kept per weight shape on this machine
    (``probe_cache``: they took 1.5 s of the bundled target's 3.2 s load, at every worker's start)."""
    if weight.dtype == torch.bfloat16:
        return 1
    inputs = {"shape": list(weight.shape), "dtype": str(weight.dtype), "rows": PROBE_ROWS, "repeats": PROBE_REPEATS}
    kept = probe_cache.remember("packed_ratios", inputs, weight.device,
                                lambda: {str(rows): r for rows, r in ratios(weight, packed).items()})
    return from_ratios({int(rows): r for rows, r in kept.items()})


def ratios(weight: torch.Tensor, packed: torch.Tensor) -> dict[int, float]:
    """The packed kernel's time over the plain one's for ``weight``, per row count of ``PROBE_ROWS``:
    the two alternating, medians of ``PROBE_REPEATS``."""
    kernels = (lambda x: F.linear(x, weight), lambda x: linear(x, packed, None))
    found = {}
    for rows in PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(PROBE_REPEATS + 1):  # (the first round warms both up)
            for kernel, took in zip(kernels, times):
                t0 = time.perf_counter()
                kernel(x)
                took.append(time.perf_counter() - t0)
        found[rows] = statistics.median(times[1][1:]) / statistics.median(times[0][1:])
    return found


def from_ratios(ratios: dict[int, float]) -> int | None:
    """The fewest rows where the packed kernel takes under ``FASTER`` of the plain one's time
    (``ratios``: packed over plain, per row count) and at no more rows over ``NOT_SLOWER``."""
    counts = sorted(ratios)
    return next((r for r in counts if ratios[r] < FASTER and all(ratios[m] < NOT_SLOWER for m in counts if m >= r)), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with a weight from ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
