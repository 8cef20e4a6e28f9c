"""The tokens this worker was sent of each request, so a task needs to carry only the new ones.

A task's ``tokens`` start at its ``base`` (``broker/known.py``): the worker takes the first
``base`` from here, after checking them against the task's ``base_crc`` (CRC-32 of their int32
bytes). A request it lacks, or holds fewer or other tokens of (evicted from this bounded book, a
lost message, a broker that restarted and numbered its requests afresh), is ``tokens_missing``:
the broker sends that task again, whole. The book follows the requests the broker names: a FREE
drops them. A request's prediction of its output (Predicted Outputs) comes with its tasks of base
0 and is kept beside its tokens.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

import numpy as np

from nebula_flow.protocol import TOKENS_MISSING, ProtocolError, TaskSpec

BOOK_TOKENS = 1 << 24  # tokens kept in all (int64: at most 128 MiB), least recently sent dropped first


class TokenBook:
    """Per request, the tokens last sent (a task's base and what came with it; int64, as the runner
    takes them), their CRC-32 (of their int32 bytes, as the broker holds them) and its prediction."""

    def __init__(self, max_tokens: int = BOOK_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, tuple[np.ndarray, int, np.ndarray | None]] = OrderedDict()
        self.held = 0  # tokens in ``entries``, predictions included
        self.missing = 0  # tasks whose base was not here (each went back to the broker)

    def tokens(self, spec: TaskSpec) -> np.ndarray:
        """``spec``'s request's whole token sequence (int64, read-only: the book keeps it for the
        request's next task); ``ProtocolError(TOKENS_MISSING)`` when this book lacks the first
        ``spec.base`` it names."""
        rest, base = spec.tokens.astype(np.int32, copy=False), spec.base  # (the CRC is of int32 bytes)
        if base == 0:
            whole = rest.astype(np.int64)
            crc = zlib.crc32(rest)
            prediction = spec.prediction.astype(np.int64) if spec.prediction is not None else None
        else:
            held, held_crc, prediction = self.entries.get(spec.rid, (None, 0, None))
            if held is None or len(held) < base or \
                    (held_crc if len(held) == base else zlib.crc32(held[:base].astype(np.int32))) != spec.base_crc:
                self.missing += 1
                raise ProtocolError(TOKENS_MISSING, f"this worker lacks the first {base} tokens of request {spec.rid} "
                                             f"(it holds {0 if held is None else len(held)}): send them all")
            whole = np.concatenate([held[:base], rest], dtype=np.int64)
            crc = zlib.crc32(rest, spec.base_crc)
        whole.flags.writeable = False
        self._keep(spec.rid, (whole, crc, prediction))
        return whole

    def prediction(self, rid: int) -> np.ndarray | None:
        """The prediction of request ``rid``'s output its tasks brought (None: none)."""
        entry = self.entries.get(rid)
        return entry[2] if entry is not None else None

    def _keep(self, rid: int, entry: tuple[np.ndarray, int, np.ndarray | None]) -> None:
        self._drop(rid)
        self.held += _size(entry)
        self.entries[rid] = entry
        while self.held > self.max_tokens and len(self.entries) > 1:
            self.held -= _size(self.entries.popitem(last=False)[1])

    def _drop(self, rid: int) -> None:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.held -= _size(entry)

    def forget(self, rids: list[int]) -> None:
        """Requests that ended (a FREE): their tokens go."""
        for rid in rids:
            self._drop(rid)


def _size(entry: tuple[np.ndarray, int, np.ndarray | None]) -> int:
    """Tokens an entry holds: the request's, and its prediction's."""
    return len(entry[0]) + (len(entry[2]) if entry[2] is not None else 0)
