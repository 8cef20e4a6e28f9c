"""The messages between workers' KV servers (ZeroMQ transport): a pull and its rows.

Part of the wire schema (``nebula_flow/protocol.py``, which lists every kind); the UCX transport
carries the same fields as int64 arrays of sizes both sides know (``nebula_flow/kv/ucx.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from nebula_flow.wire import Msg, Tensor, malformed

MAX_PULL_ITEMS = 4096  # requests in one KV exchange


@dataclass
class KvPull(Msg):
    """Puller -> holder: "send me these KV positions": ``items`` of [rid, role, start, end], every request of a batch
    this holder has, in one exchange."""

    KIND: ClassVar[str] = "KV_PULL"
    seq: int
    items: list[list]

    def check(self) -> None:
        if not 0 < len(self.items) <= MAX_PULL_ITEMS or not all(
                len(it) == 4 and all(isinstance(x, int) and not isinstance(x, bool) for x in (it[0], it[2], it[3]))
                and isinstance(it[1], str) and 0 <= it[2] < it[3] for it in self.items):
            raise malformed(f"items must be 1..{MAX_PULL_ITEMS} of [rid, role, start, end] with 0 <= start < end")


@dataclass
class KvRows:
    """The KV one pull item asked for: its tokens (int32) and rows ([n, layers, 2, heads, dim])."""

    tokens: Tensor
    rows: Tensor


@dataclass
class KvData(Msg):
    """Holder -> puller: per asked item its ``KvRows``, or null when the holder no longer has them (evicted, freed,
    shorter)."""

    KIND: ClassVar[str] = "KV_DATA"
    seq: int
    items: list[KvRows | None] = field(default_factory=list)
