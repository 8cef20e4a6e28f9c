"""What a worker's RESULT says about its devices (``Result.device``): forward passes run, each
model's numerics and runtime (packing, CUDA graphs, attention), the forward-time tables adaptive
k weighs, lent cores, and on emulated devices how far the host fell behind the profile."""

from __future__ import annotations

import time
from typing import Any

import torch

COSTS_EVERY_S = 1.0  # forward-time tables go to the broker at most this often


class DeviceStats:
    """Builds each RESULT's ``device`` entry; remembers when each table of forward times last went."""

    def __init__(self) -> None:
        self.costs_sent_at: dict[str, float] = {}

    def snapshot(self, draft: Any, target: Any, lease: Any) -> dict[str, Any]:  # noqa: ANN401
        """``draft``/``target``: the worker's runners (None where it has none); ``lease``: its core
        lease (``nebula_flow.cores``), if any."""
        runners = [r for r in (draft, target) if r is not None]
        out: dict[str, Any] = {"forwards": sum(r.forwards for r in runners)}
        # each model's forward seconds for one sequence by new rows (1, 2, ...; null: not seen): the
        # policy's adaptive k weighs a round's draft steps and verify block with them. At most once
        # per COSTS_EVERY_S: they move slowly, and the broker takes a median over workers per update.
        for key in ("step_costs", "batch_costs"):  # (by a forward's rows in all: elastic workers weigh their stages)
            if time.monotonic() - self.costs_sent_at.get(key, float("-inf")) < COSTS_EVERY_S:
                continue
            tables = {role: t for role, r in (("draft", draft), ("target", target))
                      if r is not None and hasattr(r, key) and (t := getattr(r, key).table())}
            if tables:
                out[key] = tables
                self.costs_sent_at[key] = time.monotonic()
        for role, runner in (("draft", draft), ("target", target)):
            if runner is not None and isinstance(runner.model, torch.nn.Module):  # (numerics, packing, CUDA graphs)
                out.update({f"{role}_{key}": value for key, value in runner.model.runtime_status().items()})
        if lease is not None:  # (forwards on cores idle workers lent)
            out.update(lease.status())
        emulated = [r.model for r in runners if hasattr(r.model, "overrun_s")]
        if emulated:
            out["emulated_predicted_s"] = sum(m.predicted_s for m in emulated)
            out["emulated_overrun_s"] = sum(m.overrun_s for m in emulated)
        return out
