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
    takes them) and their CRC-32 (of their int32 bytes, as the broker holds them)."""

    def __init__(self, max_tokens: int = BOOK_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self.predictions: dict[int, np.ndarray] = {}  # rid -> its prediction (int64), for requests in ``entries``
        self.held = 0  # tokens in ``entries``
        self.missing = 0  # tasks whose base was not here (each went back to the broker)

    def tokens(self, spec: TaskSpec) -> np.ndarray:
        """``spec``'s request's whole token sequence (int64, read-only: the book keeps it for the
        request's next task); ``ProtocolError(TOKENS_MISSING)`` when this book lacks the first
        ``spec.base`` it names."""
        rest, base = spec.tokens.astype(np.int32, copy=False), spec.base  # (the CRC is of int32 bytes)
        if base == 0:
            whole = rest.astype(np.int64)
            crc = zlib.crc32(rest)
            if spec.prediction is not None:
                self.predictions[spec.rid] = spec.prediction.astype(np.int64)
            else:
                self.predictions.pop(spec.rid, None)
        else:
            held, held_crc = self.entries.get(spec.rid, (None, 0))
            if held is None or len(held) < base or \
                    (held_crc if len(held) == base else zlib.crc32(held[:base].astype(np.int32))) != spec.base_crc:
                self.missing += 1
                raise ProtocolError(TOKENS_MISSING, f"this worker lacks the first {base} tokens of request {spec.rid} "
                                             f"(it holds {0 if held is None else len(held)}): send them all")
            whole = np.concatenate([held[:base], rest], dtype=np.int64)
            crc = zlib.crc32(rest, spec.base_crc)
        whole.flags.writeable = False
        self._keep(spec.rid, whole, crc)
        return whole

    def _keep(self, rid: int, whole: np.ndarray, crc: int) -> None:
        old = self.entries.pop(rid, None)
        self.held += len(whole) - (len(old[0]) if old is not None else 0)
        self.entries[rid] = (whole, crc)
        while self.held > self.max_tokens and len(self.entries) > 1:
            dropped, (tokens, _) = self.entries.popitem(last=False)
            self.held -= len(tokens)
            self.predictions.pop(dropped, None)

    def prediction(self, rid: int) -> np.ndarray | None:
        """The prediction of request ``rid``'s output its tasks brought (None: none)."""
        return self.predictions.get(rid)

    def forget(self, rids: list[int]) -> None:
        """Requests that ended (a FREE): their tokens go."""
        for rid in rids:
            entry = self.entries.pop(rid, None)
            self.predictions.pop(rid, None)
            if entry is not None:
                self.held -= len(entry[0])
