"""What each worker was already sent of a request's tokens, so a task carries only the rest.

Workers are stateless, so every task used to carry its request's whole token sequence: the
broker's CPU and the wire grew with the context (a round of a 4,000-token request cost the
broker ~1.5x one of a 5-token request). Committed tokens never change, so a worker that was sent
the first ``n`` tokens of a request needs only those after ``n``: a task carries ``tokens[base:]``
with ``base`` = what its worker was last sent, and the CRC-32 of the first ``base`` (int32
bytes), which the worker checks against its own book (``workers/token_book.py``). A worker that
lacks them (it evicted them, or lost a message) answers ``tokens_missing``; the broker forgets
what it sent that worker and queues the task again, to go out whole.
"""

from __future__ import annotations

import zlib

import numpy as np

from nebula_flow.request import Request

MAX_RESENDS = 8  # a request's tasks sent again whole at most this often: a worker that lacks tokens sent whole is broken


def tokens_for(req: Request, wid: int, full: bool = False) -> tuple[np.ndarray, int, int]:
    """The tokens of ``req`` to send worker ``wid`` with a task, their base position and the CRC-32
    of the tokens before it; remembers that ``wid`` has them all now. ``full``: all of them, and
    nothing remembered (``BrokerOptions.full_tokens``)."""
    tokens = req.tokens
    if full:
        return tokens, 0, 0
    base, crc = req.known.get(wid, (0, 0))  # (committed tokens only grow: what was sent is a prefix)
    rest = tokens[base:]
    req.known[wid] = (len(tokens), zlib.crc32(rest, crc))
    return rest, base, crc

