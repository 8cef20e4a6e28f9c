"""The codec under ``protocol``: dataclass fields to an orjson header and tensor frames, and back.

Decoding walks a class's type annotations: each type gets a checker made once (``_checker``), so
decoding a message is a walk over precomputed checks, and a value of the wrong shape raises
``ProtocolError``. The types it knows: ``bool``, ``int`` (not a bool), ``float`` (finite), ``str``,
``dict``, ``list[...]``, ``X | None``, ``TokenIds`` (whole numbers >= 0), ``Tensor`` (a frame,
decoded as a read-only array view), and nested dataclasses (whose ``check`` method, if any, runs
after their fields). A list field marked ``metadata={"isolate": True}`` decodes item by item: a
bad item becomes a ``Rejected`` in its place. Encoding leaves out fields at their defaults.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, NewType, get_args, get_origin, get_type_hints

import numpy as np
import orjson

DTYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float16": np.float16,
          "bfloat16": np.uint16, "uint8": np.uint8}
ITEMSIZE = {name: np.dtype(t).itemsize for name, t in DTYPES.items()}

MAX_TOKEN_ID = 1 << 31  # token ids travel as int32 tensors (a request's tokens, KV pulls)
TokenIds = NewType("TokenIds", list)  # a list of token ids: whole numbers >= 0
Tensor = NewType("Tensor", np.ndarray)  # a tensor frame; in Python a read-only array view of it


class ProtocolError(Exception):
    """A message that does not follow this schema. ``code`` is stable and machine-readable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def malformed(message: str) -> ProtocolError:
    return ProtocolError("malformed", message)


@dataclass
class Rejected:
    """An item of a batch (a task, a result) that failed to decode: what names it, if anything,
    and why. The rest of the batch still counts."""

    head: dict | None
    error: ProtocolError


def req_id_of(frames: list[Any], max_len: int) -> str | None:
    """Best effort: the req_id of a rejected message, so the client can match the error."""
    try:
        header = orjson.loads(bytes(frames[1].buffer if hasattr(frames[1], "buffer") else frames[1]))
        rid = header.get("req_id")
        return rid if isinstance(rid, str) and len(rid) <= max_len else None
    except Exception:
        return None


def decode_fields(cls: type, raw: Any, where: str, frames: list[Any]) -> Any:  # noqa: ANN401
    """An instance of dataclass ``cls`` from its header object ``raw`` (``where`` names it in errors)."""
    return _checker(cls)(raw, where, frames)


Checker = typing.Callable[[Any, str, list], Any]


@functools.cache
def _checker(tp: Any) -> Checker:  # noqa: ANN401, C901
    """A function that checks (and converts) a header value of type ``tp``; made once per type,
    so decoding a message is a walk over precomputed checks."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = _checker(next(a for a in get_args(tp) if a is not type(None)))
        return lambda v, where, frames: None if v is None else inner(v, where, frames)
    if tp is TokenIds:
        return lambda v, where, frames: token_ids(v, where)
    if tp is Tensor:
        return lambda v, where, frames: array(v, frames)
    if origin is list or tp is list:
        item = get_args(tp)[0] if get_args(tp) else None
        if item is None:
            return _typed(list)
        each = _checker(item)

        def check_list(v: Any, where: str, frames: list) -> list:  # noqa: ANN401
            if not isinstance(v, list):
                raise malformed(f"{where} must be a list")
            return [each(x, where, frames) for x in v]
        return check_list
    if is_dataclass(tp):
        return _object_checker(tp)
    return _typed(tp)


def _typed(tp: type) -> Checker:
    """A plain JSON value: bool, int (not a bool), float (finite; an int is taken), str, dict, list."""
    if tp is float:
        def check_float(v: Any, where: str, frames: list) -> float:  # noqa: ANN401
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                return float(v)
            raise malformed(f"{where} must be a number, not {type(v).__name__}")
        return check_float

    def check(v: Any, where: str, frames: list) -> Any:  # noqa: ANN401
        if isinstance(v, tp) and (tp is bool or not isinstance(v, bool)):
            return v
        raise malformed(f"{where} has the wrong type {type(v).__name__}")
    return check


def _object_checker(cls: type) -> Checker:
    hints = get_type_hints(cls)
    plan = []
    for f in fields(cls):
        required = f.default is MISSING and f.default_factory is MISSING
        isolate = bool(f.metadata.get("isolate"))
        check = _isolated(_checker(get_args(hints[f.name])[0])) if isolate else _checker(hints[f.name])
        plan.append((f.name, check, required, f"{getattr(cls, 'KIND', '') or cls.__name__}.{f.name}"))
    post = getattr(cls, "check", None)

    def check_object(raw: Any, where: str, frames: list) -> Any:  # noqa: ANN401
        if not isinstance(raw, dict):
            raise malformed(f"{where} must be an object")
        values = {}
        for name, check, required, label in plan:  # (labels made once: no string work per message)
            value = raw.get(name)
            if value is None:
                if required:
                    raise malformed(f"{where} lacks field {name!r}")
                continue
            values[name] = check(value, label, frames)
        obj = cls(**values)
        if post is not None:
            obj.check()
        return obj
    return check_object


def _isolated(each: Checker) -> Checker:
    """A list whose items decode one by one: a bad item becomes a ``Rejected`` in its place."""
    def check_items(raw: Any, where: str, frames: list) -> list:  # noqa: ANN401
        if not isinstance(raw, list):
            raise malformed(f"{where} must be a list")
        out: list[Any] = []
        for entry in raw:
            try:
                out.append(each(entry, where, frames))
            except ProtocolError as exc:
                out.append(Rejected(_head(entry), exc))
        return out
    return check_items


def _head(raw: Any) -> dict | None:  # noqa: ANN401
    """The fields that name a task or result (rid, kind, round, attempt), when all are there."""
    if not isinstance(raw, dict):
        return None
    head = {k: raw.get(k) for k in ("rid", "kind", "round", "attempt")}
    ok = all(isinstance(v, int) and not isinstance(v, bool) for k, v in head.items() if k != "kind")
    return head if ok and isinstance(head["kind"], str) else None


def token_ids(value: Any, name: str) -> list[int]:  # noqa: ANN401
    """``value`` if it is a list of token ids (whole numbers in int32's range, where tokens travel
    as tensors), else ``ProtocolError`` (the model's vocabulary is checked where it is known:
    ``workers/tasks.py``)."""
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in value):
        raise malformed(f"{name} must be a list of token ids")
    return value


def array(desc: Any, frames: list[Any]) -> np.ndarray:  # noqa: ANN401
    """The tensor a descriptor names, as a read-only view of its frame (no copy), or the small
    integer vector it holds inline (``{"ints": [...], "dtype"}``)."""
    if isinstance(desc, dict) and set(desc) == {"ints", "dtype"}:
        return _inline(desc["ints"], desc["dtype"])
    if not isinstance(desc, dict) or set(desc) != {"f", "dtype", "shape"}:
        raise malformed(f"bad tensor descriptor {desc!r}")
    idx, dtype, shape = desc["f"], desc["dtype"], desc["shape"]
    if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(frames):
        raise ProtocolError("bad_frame", f"tensor frame {idx!r} is missing")
    if dtype not in DTYPES or not isinstance(shape, list) or len(shape) > 8 or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise malformed(f"bad tensor dtype/shape {dtype!r} {shape!r}")
    buf = frames[idx]
    view = memoryview(buf.buffer if hasattr(buf, "buffer") else buf)
    # (plain Python arithmetic: a KV pull decodes these between batches, where every numpy
    # call costs tens of microseconds)
    if view.nbytes != math.prod(shape) * ITEMSIZE[dtype]:
        raise ProtocolError("bad_frame", f"frame {idx} has {view.nbytes} bytes, expected {shape} x {dtype}")
    return np.frombuffer(view, dtype=DTYPES[dtype]).reshape(shape)


def _inline(values: Any, dtype: Any) -> np.ndarray:  # noqa: ANN401
    """An inline integer vector, checked in numpy's C loops: whole numbers (no bools, floats or
    strings) within ``dtype``'s range."""
    if dtype not in INLINE_DTYPES or not isinstance(values, list) or len(values) > INLINE_MAX:
        raise malformed(f"bad inline tensor of dtype {dtype!r}")
    if not values:
        return np.empty(0, dtype=DTYPES[dtype])
    try:
        arr = np.array(values)
    except (ValueError, OverflowError):  # (ragged nesting, or beyond int64)
        arr = None
    limits = np.iinfo(DTYPES[dtype])
    if arr is None or arr.dtype.kind != "i" or arr.ndim != 1 or arr.min() < limits.min or arr.max() > limits.max:
        raise malformed(f"an inline {dtype} tensor must be a list of whole numbers in its range")
    arr = arr.astype(DTYPES[dtype])
    arr.flags.writeable = False  # (as a frame's view is)
    return arr


# Small integer vectors (a task's tokens, a prompt) travel inside the header rather than as frames
# of their own: a frame costs the sender a send call each, more than orjson's writing of the ints.
INLINE_MAX = 4096
INLINE_DTYPES = ("int32", "int64")
PLAIN_TYPES = frozenset({int, float, str, bool, dict, type(None)})  # (values that travel as they are)
HEADER_OPTIONS = orjson.OPT_SERIALIZE_NUMPY  # (for inline vectors)


def plain(obj: Any, frames: list[Any]) -> Any:  # noqa: ANN401
    """``obj`` as header data: dataclasses as objects without their fields at defaults (the
    receiver fills them in), arrays as frames or inline vectors (appended to ``frames``)."""
    kind = type(obj)
    if kind in PLAIN_TYPES:  # (most values: checked first, the broker encodes every task)
        return obj
    if kind is list:
        return [v if type(v) in PLAIN_TYPES else plain(v, frames) for v in obj]
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        name = DTYPE_NAMES.get(arr.dtype)
        if name is None:
            raise ValueError(f"dtype {arr.dtype} cannot travel on the wire")
        if name in INLINE_DTYPES and arr.ndim == 1 and arr.size <= INLINE_MAX:
            return {"ints": arr, "dtype": name}  # (orjson writes the array: ``HEADER_OPTIONS``)
        frames.append(arr)
        return {"f": len(frames) - 1, "dtype": name, "shape": list(arr.shape)}
    defaults = _defaults(kind) if is_dataclass(kind) else None
    if defaults is None:
        return obj
    out = {}
    for name, default in defaults.items():
        v = getattr(obj, name)
        if v is None:
            continue
        if type(v) in PLAIN_TYPES:
            if v != default:
                out[name] = v
        elif isinstance(v, np.ndarray) or v != default:
            out[name] = plain(v, frames)
    return out


DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}  # (bfloat16 travels as, and is named by, uint16)


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """Per field, its default (``MISSING`` for a required one: always sent)."""
    return {f.name: f.default if f.default is not MISSING else
            (f.default_factory() if f.default_factory is not MISSING else MISSING) for f in fields(cls)}


