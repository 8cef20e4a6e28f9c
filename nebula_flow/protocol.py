"""The wire schema: every message that crosses a ZeroMQ socket, and its validation.

A message is a multipart ZeroMQ message::

    [kind, header, *tensor frames]

``kind`` is an ASCII name from ``SCHEMA``; ``header`` is an orjson object that always carries
``"v": VERSION``; tensors (token ids, proposal distributions, KV rows) travel as extra frames
sent and received without copies, described in the header by ``{"f": frame index, "dtype",
"shape"}``. ``decode`` checks the version, the kind, every required header field's type and
every tensor descriptor against its frame, and raises ``ProtocolError`` (with a stable
``code``) on anything else; receivers answer that with an ``ERROR`` where there is a sender
to answer, count it, and carry on.

Client <-> broker (client socket, DEALER -> ROUTER):
  SUBMIT   client -> broker  req_id, params, and prompt (text) or prompt_tokens (int32 tensor);
                             chat (bool) applies the tokenizer's chat template to a text prompt.
                             Idempotent: the req_id is the client's (random, unique); resending a
                             running request re-attaches to it, a finished one replays its DONE.
  CANCEL   client -> broker  req_id.
  STATUS   client -> broker  ask for the broker's counters and workers.
  TOKENS   broker -> client  req_id, token_ids and text committed by one verify (a stream chunk);
                             offset = tokens committed before this chunk (a retry may resend).
  DONE     broker -> client  req_id, all token_ids, text, finish_reason, stats.
  STATE    broker -> client  reply to STATUS: a JSON object of counters.
  ERROR    either way        code, message, and req_id when it concerns one request.

Worker <-> broker (worker socket, DEALER -> ROUTER):
  REGISTER worker -> broker  role, name, capacity (max batch), model facts (vocab, context);
                             draft workers: drafter (the kind of draft model; rounds are routed
                             among drafters, see nebula_flow/routing.py).
  WELCOME  broker -> worker  worker_id, slot (pair/colocated index), mode, speculation settings.
  PULL     worker -> broker  credits (tasks it can take; 0 withdraws a waiting PULL) and idle
                             (nothing computing now).
  TASKS    broker -> worker  tasks: a batch of draft / verify / round tasks (see ``TASK_FIELDS``).
  RESULT   worker -> broker  results of finished tasks and the forward time they took; kv (KV
                             movement counters) and device (forwards, numerics, and step_costs:
                             per role, forward seconds for one sequence by new rows [1, 2, ...],
                             null where not seen, at most once a second, which adaptive k
                             weighs; malformed ones are counted and left out).
  FREE     broker -> worker  rids whose KV can be dropped (finished or cancelled).
  HEARTBEAT either way       liveness when nothing else is said.
  BYE      worker -> broker  the worker leaves; its in-flight tasks go back to their topic.

Worker <-> worker (KV server, ZeroMQ transport; the UCX transport carries the same fields
as int64 arrays of sizes both sides know, see ``nebula_flow/kv/ucx.py``):
  KV_PULL    puller -> holder  seq, items: [[rid, role, start, end], ...]: "send me these KV positions"
                               (every request of a batch this holder has, in one exchange).
  KV_DATA    holder -> puller  seq, items: per asked item {tokens (int32 tensor), rows (tensor
                               [n, layers, 2, heads, dim])}, or null when the holder no longer has
                               them (evicted, freed, shorter).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

VERSION = 1
DRAFTER_CHARS = "A-Za-z0-9._:-"  # what a REGISTER's drafter name may hold (1-64 of them)
DRAFTER_NAME = re.compile(f"[{DRAFTER_CHARS}]{{1,64}}")
DRAFTER_RULE = "1-64 letters, digits or . _ - :"  # (what DRAFTER_NAME takes, for error messages)
MAX_HEADER_BYTES = 1 << 20
DTYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float16": np.float16,
          "bfloat16": np.uint16, "uint8": np.uint8}
ITEMSIZE = {name: np.dtype(t).itemsize for name, t in DTYPES.items()}

# Header field specs: name -> accepted type(s). A leading "?" marks an optional field.
_NUM = (int, float)
SCHEMA: dict[str, dict[str, Any]] = {
    "SUBMIT": {"req_id": str, "params": dict, "?prompt": str, "?prompt_tokens": dict, "?chat": bool},
    "CANCEL": {"req_id": str},
    "STATUS": {},
    "TOKENS": {"req_id": str, "token_ids": list, "text": str, "?offset": int},
    "DONE": {"req_id": str, "token_ids": list, "text": str, "finish_reason": str, "stats": dict},
    "STATE": {"state": dict},
    "ERROR": {"code": str, "message": str, "?req_id": str},
    "REGISTER": {"role": str, "name": str, "capacity": int, "model": dict, "?kv_endpoint": str, "?drafter": str},
    "WELCOME": {"worker_id": int, "slot": int, "mode": str, "settings": dict},
    "PULL": {"credits": int, "idle": bool},
    "TASKS": {"tasks": list},
    "RESULT": {"results": list, "busy_s": _NUM, "?kv": dict},
    "FREE": {"rids": list},
    "HEARTBEAT": {},
    "BYE": {},
    "KV_PULL": {"seq": int, "items": list},
    "KV_DATA": {"seq": int, "items": list},
}

# A task names one request's round half. ``tokens`` are the request's committed tokens
# (prompt + output) as an int32 tensor; ``holder`` is the KV holder for the task's role.
# A request may draft a two-level token tree: ``alts`` (draft / round tasks) asks for that
# many alternatives to the first draft token; ``alt`` (verify tasks) carries them to the verifier.
# Any request may also fuse other drafters' chains into the tree: ``fuse`` (draft / round tasks)
# asks for a prompt-lookup chain of up to that many tokens beside the model's draft (``lookup``);
# ``chains`` (verify tasks) carries the fused chains, each starting where the draft starts.
TASK_FIELDS = {"rid": int, "kind": str, "round": int, "attempt": int, "tokens": dict, "k": int,
               "params": dict, "seed": int, "holder": dict, "?draft": list, "?q_idx": dict,
               "?q_prob": dict, "?q_len": list, "?alts": int, "?alt": list, "?fuse": int, "?chains": list}
# A result: ``draft`` tokens (+ proposal q) for a draft task, ``committed`` for verify/round
# (a round task's ``draft``: the drafts it verified); ``alt`` and ``chains``: the alternatives and
# fused chains a draft or round task made.
RESULT_FIELDS = {"rid": int, "kind": str, "round": int, "attempt": int, "?draft": list,
                 "?q_idx": dict, "?q_prob": dict, "?q_len": list, "?alt": list, "?chains": list,
                 "?committed": list, "?error": str}
MAX_ALTERNATIVES = 8
MAX_FUSED_CHAINS = 4  # fused chains in one round's token tree
MAX_DRAFT = 64  # tokens in a draft, and in a fused chain
TASK_KINDS = ("draft", "verify", "round")


class ProtocolError(Exception):
    """A message that does not follow this schema. ``code`` is stable and machine-readable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass
class Message:
    """One decoded (or to-be-encoded) message: kind, header and tensor frames."""

    kind: str
    header: dict[str, Any] = field(default_factory=dict)
    frames: list[Any] = field(default_factory=list)

    def add_array(self, arr: np.ndarray) -> dict[str, Any]:
        """Attach ``arr`` as a frame; returns the descriptor to put in the header."""
        arr = np.ascontiguousarray(arr)
        name = next((k for k, v in DTYPES.items() if np.dtype(v) == arr.dtype), None)
        if name is None:
            raise ValueError(f"dtype {arr.dtype} cannot travel on the wire")
        self.frames.append(arr)
        return {"f": len(self.frames) - 1, "dtype": name, "shape": list(arr.shape)}

    def array(self, desc: Any) -> np.ndarray:
        """The tensor a descriptor names, as a read-only view of its frame (no copy)."""
        if not isinstance(desc, dict) or set(desc) != {"f", "dtype", "shape"}:
            raise ProtocolError("malformed", f"bad tensor descriptor {desc!r}")
        idx, dtype, shape = desc["f"], desc["dtype"], desc["shape"]
        if not isinstance(idx, int) or not 0 <= idx < len(self.frames):
            raise ProtocolError("bad_frame", f"tensor frame {idx!r} is missing")
        if dtype not in DTYPES or not isinstance(shape, list) or len(shape) > 8 or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise ProtocolError("malformed", f"bad tensor dtype/shape {dtype!r} {shape!r}")
        buf = self.frames[idx]
        view = memoryview(buf.buffer if hasattr(buf, "buffer") else buf)
        # (plain Python arithmetic: a KV pull decodes these between batches, where every numpy
        # call costs tens of microseconds)
        if view.nbytes != math.prod(shape) * ITEMSIZE[dtype]:
            raise ProtocolError("bad_frame", f"frame {idx} has {view.nbytes} bytes, expected {shape} x {dtype}")
        return np.frombuffer(view, dtype=DTYPES[dtype]).reshape(shape)

    def int_list(self, desc: Any, name: str) -> list[int]:
        arr = self.array(desc)
        if arr.ndim != 1 or arr.dtype.kind != "i":
            raise ProtocolError("malformed", f"{name} must be a 1-d integer tensor")
        return arr.tolist()


def encode(msg: Message) -> list[Any]:
    header = dict(msg.header, v=VERSION)
    return [msg.kind.encode(), orjson.dumps(header), *msg.frames]


def decode(frames: list[Any]) -> Message:
    """Parse and validate a multipart message (ROUTER identity frames already removed)."""
    if len(frames) < 2:
        raise ProtocolError("malformed", f"expected at least 2 frames, got {len(frames)}")
    raw_kind, raw_header = (bytes(f.buffer if hasattr(f, "buffer") else f) for f in frames[:2])
    kind = raw_kind.decode("ascii", "replace")
    if kind not in SCHEMA:
        raise ProtocolError("unknown_kind", f"unknown message kind {kind[:32]!r}")
    if len(raw_header) > MAX_HEADER_BYTES:
        raise ProtocolError("too_large", f"header of {len(raw_header)} bytes")
    try:
        header = orjson.loads(raw_header)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("malformed", f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("malformed", "header must be a JSON object")
    if header.get("v") != VERSION:
        raise ProtocolError("bad_version", f"protocol version {header.get('v')!r}, expected {VERSION}")
    check_fields(header, SCHEMA[kind], kind)
    return Message(kind, header, list(frames[2:]))


def check_fields(obj: Any, spec: dict[str, Any], what: str) -> None:
    """Raise ``ProtocolError`` unless ``obj`` has every required field of ``spec`` typed right."""
    if not isinstance(obj, dict):
        raise ProtocolError("malformed", f"{what} must be an object")
    for name, typ in spec.items():
        optional = name.startswith("?")
        key = name.lstrip("?")
        if key not in obj or (optional and obj[key] is None):
            if optional:
                continue
            raise ProtocolError("malformed", f"{what} lacks field {key!r}")
        value = obj[key]
        if isinstance(value, bool) and typ is not bool:
            raise ProtocolError("malformed", f"{what}.{key} must be {typ}, not a boolean")
        if not isinstance(value, typ):
            raise ProtocolError("malformed", f"{what}.{key} has the wrong type {type(value).__name__}")


def error(code: str, message: str, req_id: str | None = None) -> Message:
    header = {"code": code, "message": message}
    if req_id is not None:
        header["req_id"] = req_id
    return Message("ERROR", header)


def attach_q(msg: Message, head: dict, q_idx: list | None, q_prob: list | None) -> None:
    """Put a draft's proposal q on ``msg``: flat idx/prob tensors plus ``q_len`` per position."""
    if q_idx is None:
        return
    head["q_len"] = [len(a) for a in q_idx]
    head["q_idx"] = msg.add_array(np.concatenate(q_idx).astype(np.int32) if q_idx else np.zeros(0, np.int32))
    head["q_prob"] = msg.add_array(np.concatenate(q_prob).astype(np.float32) if q_prob else np.zeros(0, np.float32))


def split_q(msg: Message, raw: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Inverse of ``attach_q``: one (idx, prob) pair per draft position, validated."""
    lens = raw["q_len"]
    idx, prob = msg.array(raw.get("q_idx")), msg.array(raw.get("q_prob"))
    if (not all(isinstance(n, int) and n > 0 for n in lens) or idx.ndim != 1 or idx.shape != prob.shape
            or sum(lens) != len(idx) or idx.dtype != np.int32 or prob.dtype != np.float32
            or len(lens) != len(raw.get("draft") or [])):
        raise ProtocolError("malformed", "proposal q does not match the draft")
    if not np.all(np.isfinite(prob)) or np.any(prob < 0) or np.any(idx < 0):
        raise ProtocolError("malformed", "proposal q has invalid entries")
    if not lens:  # an empty draft (a drafter that had nothing to propose)
        return [], []
    cuts = np.cumsum(lens)[:-1]
    idxs, probs = np.split(idx, cuts), np.split(prob, cuts)
    if any(p.sum() <= 0 for p in probs):
        raise ProtocolError("malformed", "proposal q has a position with no probability mass")
    return idxs, probs

