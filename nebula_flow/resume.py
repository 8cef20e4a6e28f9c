"""What the client library sends again, and how a sampled request's stream survives a broker that
lost it.

A request is sent again after a timeout and when a dropped connection to its broker is back (a
restarted broker). A broker that still runs the request re-attaches the caller to it, and one that
finished it sends its result again. A broker that lost it runs it anew. Greedy and seeded output comes
out the same again, so the stream goes on where it was (chunks carry offsets: ``outputs.Collector``).
A sampled request without a seed would draw another sample: its resend carries the tokens the caller
has had, and the new run continues after them.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import numpy as np

from nebula_flow.outputs import Collector
from nebula_flow.protocol import Submit


def _unseeded_sample(params: dict[str, Any]) -> bool:
    """A sampled request without a seed (``params``: as the caller gives them, or as they travel)."""
    return bool(params.get("temperature")) and params.get("seed") is None


def seeded(params: dict[str, Any]) -> dict[str, Any]:
    """A sampled request without a seed is sent again with the tokens it has had (``resend``), so
    a restarted broker goes on from them. One that asks for its tokens' log-probabilities gets a seed
    instead (a random one samples the same distribution): a resumed run could not give the resumed
    tokens' log-probabilities, so it runs again from the start and must draw the same tokens. A seed
    makes the policy plan a request as it would on any placement (never by load or measured costs:
    ``Request.reproducible``), so only those requests get one."""
    if _unseeded_sample(params) and params.get("logprobs") is not None:
        params = dict(params, seed=int.from_bytes(uuid.uuid4().bytes[:7], "big"))
    return params


def resend(submit: Submit, col: Collector | None) -> Submit:
    """``submit`` to send again (a retry, a connection made again): a sampled request without a
    seed carries the tokens ``col`` has passed on (``Submit.resume_tokens``): a broker that lost
    the request runs it on after them, where drawing anew from the start would break the stream
    the caller has. Greedy and seeded output comes out the same again: sent as it was."""
    if col is None or not col.token_ids or not _unseeded_sample(submit.params):
        return submit
    return replace(submit, resume_tokens=np.asarray(col.token_ids, dtype=np.int64))
