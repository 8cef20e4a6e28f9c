"""Cost models: how long a forward pass and a KV transfer take in the simulator.

A forward is described as the runtime sees it: ``batch`` sequences, ``tokens`` new tokens in
all, ``context`` positions in all once they are written (what attention reads).

* ``ProfileCost``: a latency profile written by ``nebula-flow profile`` (or by hand): inside
  its measured grid, multilinear interpolation; outside, the fitted linear model extends it.
* ``RooflineCost``: max(FLOPs / usable compute, bytes / usable bandwidth) + fixed overheads,
  from a ``ModelSpec`` and a ``Hardware`` description.
* ``Link``: a KV transfer costs latency + bytes / bandwidth; ``Link.free()`` is idealised.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any, Protocol

from nebula_flow.emulated import predict_seconds
from nebula_flow.kv.link_fit import worth_pulling
from nebula_flow.sim.hardware import Hardware, ModelSpec

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


class CostModel(Protocol):
    name: str
    kv_bytes_per_token: int

    def forward_s(self, batch: int, tokens: int, context: int) -> float:
        """Seconds for one forward over ``batch`` sequences with ``tokens`` new tokens in all."""
        ...


class ProfileCost:
    def __init__(self, profile: dict[str, Any]) -> None:
        m = profile["model"]
        self.name = profile.get("name", "profile")
        self.latency = profile["latency"]
        self.kv_bytes_per_token = (2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"]
                                   * DTYPE_BYTES[profile.get("kv_dtype", "float16")])
        self.grid: dict[tuple[int, int, int], float] = {}
        for g in profile.get("grid", []):
            self.grid[(g["batch"], g["tokens"], g["context"])] = g["seconds"]
        self.axes = [sorted({key[i] for key in self.grid}) for i in range(3)]
        # Interpolate only on a complete grid (what ``nebula-flow profile`` writes).
        if len(self.grid) != len(self.axes[0]) * len(self.axes[1]) * len(self.axes[2]):
            self.grid = {}

    def _linear(self, b: float, t: float, c: float) -> float:
        """The fitted model at ``b`` sequences of ``t`` new tokens after ``c`` cached positions each."""
        return predict_seconds(self.latency, b, b * t, b * (c + t))

    def forward_s(self, batch: int, tokens: int, context: int) -> float:
        if not self.grid:
            return predict_seconds(self.latency, batch, tokens, context)
        point = (batch, tokens / batch, (context - tokens) / batch)  # per-sequence, as the grid is
        clamped = tuple(min(max(x, ax[0]), ax[-1]) for x, ax in zip(point, self.axes))
        return max(0.0, self._interpolate(clamped) + self._linear(*point) - self._linear(*clamped))

    def _interpolate(self, p: tuple[float, ...]) -> float:
        brackets = []
        for x, ax in zip(p, self.axes):
            hi = min(max(bisect.bisect_left(ax, x), 1), len(ax) - 1) if len(ax) > 1 else 0
            lo = max(hi - 1, 0)
            w = 0.0 if ax[hi] == ax[lo] else (x - ax[lo]) / (ax[hi] - ax[lo])
            brackets.append(((ax[lo], 1 - w), (ax[hi], w)))
        total = 0.0
        for corner in itertools.product(*brackets):
            weight = corner[0][1] * corner[1][1] * corner[2][1]
            if weight:
                total += weight * self.grid[(corner[0][0], corner[1][0], corner[2][0])]
        return total


class RooflineCost:
    def __init__(self, model: ModelSpec, hw: Hardware) -> None:
        self.model, self.hw = model, hw
        self.name = f"{model.name}@{hw.name}"
        self.kv_bytes_per_token = model.kv_bytes_per_token

    def forward_s(self, batch: int, tokens: int, context: int) -> float:
        m, hw = self.model, self.hw
        q_width = m.num_heads * m.head_dim
        # Attention: each new token attends to its sequence's context (mean context per sequence).
        attn_flops = 4 * m.num_layers * q_width * tokens * (context / max(batch, 1))
        flops = 2 * (m.weight_bytes // m.dtype_bytes) * tokens + attn_flops
        moved = m.weight_bytes + context * m.kv_bytes_per_token
        compute = max(flops / (hw.flops * hw.mfu), moved / (hw.mem_bw * hw.mbu))
        return compute + hw.fixed_s + hw.per_layer_s * m.num_layers


@dataclass(frozen=True)
class Link:
    """How KV moves between workers: ``bandwidth`` bytes/s and ``latency_s`` per transfer."""

    bandwidth: float
    latency_s: float

    @classmethod
    def free(cls) -> Link:
        return cls(float("inf"), 0.0)

    def transfer_s(self, nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth

    def pull_s(self, nbytes: int, recompute_s: float) -> float | None:
        """A pull's seconds, or None where a live worker recomputes instead: where the pull takes
        more than twice computing those positions (``recompute_s``; ``kv/link_fit.py``, which a
        live worker applies to its links as measured)."""
        took = self.transfer_s(nbytes)
        return took if worth_pulling(took, recompute_s) else None

    def transfers_s(self, transfers: int, nbytes: int) -> float:
        """What ``transfers`` transfers of ``nbytes`` bytes in all cost: the model is affine in
        bytes, so how they split does not matter (checked against a live worker's ``kv.transfers``
        and ``kv.bytes_pulled`` in ``tests/test_hosts.py``)."""
        return 0.0 if transfers <= 0 else transfers * self.latency_s + nbytes / self.bandwidth
