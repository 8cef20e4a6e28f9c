"""How long a runner's forwards take, on a CPU and on a GPU.

The measured cost of each forward feeds the policy (adaptive k weighs a draft step against a
verify block; an elastic worker weighs its stages), so it must be the device's time. On a CPU a
forward computes while it is called: the wall clock around the call is its time. On a GPU the
call only launches kernels, and the host waits for them only when it reads a result (once per
batch of draft steps, ``draft_steps``): the wall clock around the call would time the launches.
There the clock records CUDA events around the call on the current stream and reads them after
the batch's results reached the host (``settle``), when they are done without waiting again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class ForwardClock:
    """Times forwards on ``device``; each time goes to the ``observe`` given with it."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.on_gpu = device, device.type == "cuda"
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, Callable[[float], None]]] = []

    @contextmanager
    def timing(self, observe: Callable[[float], None]) -> Iterator[None]:
        """Time the forward called inside; ``observe(seconds)`` at once on a CPU, at ``settle`` on a GPU."""
        if not self.on_gpu:
            t0 = time.perf_counter()
            yield
            observe(time.perf_counter() - t0)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((start, end, observe))

    def settle(self) -> None:
        """Hand the GPU forwards' times on (call it once their results are on the host)."""
        for start, end, observe in self._pending:
            end.synchronize()
            observe(start.elapsed_time(end) / 1000)
        self._pending.clear()
