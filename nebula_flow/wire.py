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
from typing import Any, ClassVar, NewType, get_args, get_origin, get_type_hints

import numpy as np
import orjson

from nebula_flow import codegen

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


# a worker's error for a task whose ``base`` it lacks the tokens before (``workers/token_book.py``): not a
# failure, the broker sends that task again with all its tokens (``broker/known.py``)
TOKENS_MISSING = "tokens_missing"


def lacked_tokens(error: str | None) -> bool:
    """Whether a task's error (``TaskResult.error``) is ``TOKENS_MISSING``."""
    return error is not None and error.startswith(TOKENS_MISSING + ":")


def malformed(message: str) -> ProtocolError:
    return ProtocolError("malformed", message)


MAX_REQ_ID = 128  # characters of a client's request id


def check_req_id(req_id: str) -> None:
    if not 0 < len(req_id) <= MAX_REQ_ID:
        raise malformed(f"req_id must have 1..{MAX_REQ_ID} characters")


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
        return token_ids
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
        raise _wrong_type(where, v)
    return check


def _object_checker(cls: type) -> Checker:
    hints = get_type_hints(cls)
    plan = []
    for f in fields(cls):
        required = f.default is MISSING and f.default_factory is MISSING
        tp = _unoptional(hints[f.name])
        if f.metadata.get("isolate"):
            check = _isolated(_checker(get_args(tp)[0]))
        else:
            check = tp if tp in codegen.INLINE_TYPES else _checker(hints[f.name])
        plan.append((f.name, check, required, f"{getattr(cls, 'KIND', '') or cls.__name__}.{f.name}"))
    # (the labels made once: no string work per message)
    return codegen.decoder(cls, plan, callable(getattr(cls, "check", None)), _wrong_type, malformed)


def _unoptional(tp: Any) -> Any:  # noqa: ANN401
    """``X`` for ``X | None``; any other type as it is."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def _wrong_type(label: str, v: Any) -> ProtocolError:  # noqa: ANN401
    return malformed(f"{label} has the wrong type {type(v).__name__}")


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


def token_ids(value: Any, name: str, frames: list | None = None) -> list[int]:  # noqa: ANN401
    """``value`` if it is a list of token ids (whole numbers in int32's range, where tokens travel
    as tensors), else ``ProtocolError`` (the model's vocabulary is checked where it is known:
    ``workers/tasks.py``). ``frames``: unused (the signature of a ``Checker``)."""
    # (the types collected in C: a generator testing each id cost the broker ~1 us a round's result)
    if type(value) is not list or value and ({*map(type, value)} != _INT or min(value) < 0 or max(value) >= MAX_TOKEN_ID):
        raise malformed(f"{name} must be a list of token ids")
    return value


_INT = {int}  # (exact: JSON gives bool for true/false, never an int subclass else)


def array(desc: Any, frames: list[Any]) -> np.ndarray:  # noqa: ANN401
    """The tensor a descriptor names, as a read-only view of its frame (no copy): a frame of its
    own (``{"f", "dtype", "shape"}``) or a slice of the message's packed integer frame
    (``{"p": dtype, "o": offset, "n": length}``, see ``Frames``)."""
    if isinstance(desc, dict) and "p" in desc:
        return _packed(desc, getattr(frames, "packs", {}))
    if not isinstance(desc, dict) or set(desc) != {"f", "dtype", "shape"}:
        raise malformed(f"bad tensor descriptor {desc!r}")
    idx, dtype, shape = desc["f"], desc["dtype"], desc["shape"]
    if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(frames):
        raise ProtocolError("bad_frame", f"tensor frame {idx!r} is missing")
    if dtype not in DTYPES or not isinstance(shape, list) or len(shape) > 8 or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise malformed(f"bad tensor dtype/shape {dtype!r} {shape!r}")
    view = _view(frames[idx])
    # (plain Python arithmetic: a KV pull decodes these between batches, where every numpy
    # call costs tens of microseconds)
    if view.nbytes != math.prod(shape) * ITEMSIZE[dtype]:
        raise ProtocolError("bad_frame", f"frame {idx} has {view.nbytes} bytes, expected {shape} x {dtype}")
    return np.frombuffer(view, dtype=DTYPES[dtype]).reshape(shape)


def _view(frame: Any) -> memoryview:  # noqa: ANN401
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


def _packed(desc: dict, packs: dict[str, np.ndarray]) -> np.ndarray:
    pack, start, n = packs.get(desc.get("p")), desc.get("o"), desc.get("n")
    if pack is None or len(desc) != 3:
        raise ProtocolError("bad_frame", f"packed tensor {desc!r} names no packed frame")
    if type(start) is not int or type(n) is not int or start < 0 or n < 0 or start + n > len(pack):
        raise malformed(f"packed tensor {desc!r} is outside its frame")
    return pack[start:start + n]


# A message's small integer vectors (a task's tokens, a prompt) share one frame per dtype, each a
# slice of it: the sender pays one send for all, the receiver one view. (Written into the header
# as JSON, parsing the ints and checking them back cost the worker ~70 us per task of 300 tokens.)
PACK_MAX = 4096  # (a longer vector gets a frame of its own)
PACK_DTYPES = ("int32", "int64")
PLAIN_TYPES = frozenset({int, float, str, bool, dict, type(None)})  # (values that travel as they are)
HEADER_OPTIONS = orjson.OPT_SERIALIZE_NUMPY  # (numpy scalars in free-form dicts: a worker's counters)


class Frames(list):
    """A message's tensor frames. Being written, ``pack`` collects its small integer vectors
    (``packing``: per dtype, the vectors and their length so far) and ``close`` appends them, one
    frame per dtype, named in the header's ``packs``; being read (``received``), ``packs`` holds
    those frames as arrays."""

    def __init__(self, frames: Any = (), packs: dict[str, np.ndarray] | None = None) -> None:  # noqa: ANN401
        super().__init__(frames)
        self.packs = packs if packs is not None else {}
        self.packing: dict[str, tuple[list[np.ndarray], list[int]]] = {}

    def pack(self, arr: np.ndarray, name: str) -> dict[str, Any]:
        packing = self.packing.get(name)
        if packing is None:  # (not setdefault: that makes the pair for every vector)
            packing = self.packing[name] = ([], [0])
        arrays, length = packing
        arrays.append(arr)
        start = length[0]
        length[0] += len(arr)
        return {"p": name, "o": start, "n": len(arr)}

    def close(self, header: dict[str, Any]) -> None:
        if self.packing:
            header["packs"] = named = {}
            for name, (arrays, _) in self.packing.items():
                named[name] = len(self)
                self.append(np.concatenate(arrays) if len(arrays) > 1 else arrays[0])

    @classmethod
    def received(cls, header: dict[str, Any], frames: list[Any]) -> Frames:
        """A received message's frames (after kind and header), its packed frames as arrays."""
        raw = header.get("packs")
        if raw is None:
            return cls(frames)
        if not isinstance(raw, dict):
            raise malformed("packs must be an object")
        packs = {}
        for name, idx in raw.items():
            if name not in PACK_DTYPES or type(idx) is not int or not 0 <= idx < len(frames):
                raise ProtocolError("bad_frame", f"packed frame {name!r}: {idx!r} is not one of the message's")
            view = _view(frames[idx])
            if view.nbytes % ITEMSIZE[name]:
                raise ProtocolError("bad_frame", f"packed {name} frame of {view.nbytes} bytes")
            packs[name] = arr = np.frombuffer(view, dtype=DTYPES[name])
            arr.flags.writeable = False  # (a received frame may be writable memory: its slices are read-only views, as documented)
        return cls(frames, packs)


def plain(obj: Any, frames: Frames) -> Any:  # noqa: ANN401
    """``obj`` as header data: dataclasses as objects without their fields at defaults (the
    receiver fills them in), arrays as frames or packed slices (see ``Frames``)."""
    kind = type(obj)
    if kind in PLAIN_TYPES:  # (most values: checked first)
        return obj
    if kind is list:
        return [v if type(v) in PLAIN_TYPES else plain(v, frames) for v in obj]
    if isinstance(obj, np.ndarray):
        return tensor(obj, frames)
    if is_dataclass(kind):
        return _encoder(kind)(obj, frames)
    return obj


def tensor(obj: np.ndarray, frames: Frames) -> dict[str, Any]:
    """An array's descriptor; the array joins ``frames`` (or its pack)."""
    arr = np.ascontiguousarray(obj)
    name = DTYPE_NAMES.get(arr.dtype)
    if name is None:
        raise ValueError(f"dtype {arr.dtype} cannot travel on the wire")
    if name in PACK_DTYPES and arr.ndim == 1 and arr.size <= PACK_MAX:
        return frames.pack(arr, name)
    frames.append(arr)
    return {"f": len(frames) - 1, "dtype": name, "shape": list(arr.shape)}


class Msg:
    """A message kind; subclasses are dataclasses whose fields are the header's (``protocol.py``)."""

    KIND: ClassVar[str] = ""

    def check(self) -> None:
        """Rules beyond each field's type; raise ``ProtocolError``."""


@functools.cache
def _encoder(cls: type) -> typing.Callable[[Any, Frames], dict]:
    """``cls``'s encoder (``codegen.encoder``), each field encoded as its annotation says."""
    hints = get_type_hints(cls)
    return codegen.encoder(cls, {f.name: _encoding(hints[f.name]) for f in fields(cls)}, plain, tensor, PLAIN_TYPES)


VALUE_TYPES = (int, float, str, bool, dict, TokenIds)  # (sent as they are: orjson writes numpy scalars too)


def _encoding(tp: Any) -> tuple[str, Any]:  # noqa: ANN401
    tp = _unoptional(tp)
    item = get_args(tp)[0] if get_origin(tp) is list and get_args(tp) else None
    if tp is Tensor:
        return "tensor", None
    if is_dataclass(tp):
        return "object", _encoder(tp)
    if is_dataclass(item):
        return "objects", _encoder(item)
    if tp in VALUE_TYPES or item in VALUE_TYPES:
        return "value", None
    return "any", None


DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}  # (bfloat16 travels as, and is named by, uint16)
