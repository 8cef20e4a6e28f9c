"""The codec's per-class functions, written once from a dataclass's fields (``exec``): decoding
and encoding a message is then straight-line code (a field read, a type test, a store) instead of
a loop over a field table with a function call per value. The broker encodes and decodes every
task of every round and a worker decodes each batch on its critical path, so this is where the
codec's time went (a pooled round's TASKS and RESULT walked ~60 function calls per task).

``wire`` owns what the types mean (its checkers and ``plain``); this module only writes the
functions that call them, and the rules must stay those of ``wire``'s generic versions:
decoding, a field that is absent or null takes its default (a required one raises "lacks
field"); plain values are checked inline by exact type (``bool`` is not an ``int``: JSON decoding
gives exact types); encoding leaves out fields that are null or at their default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

import numpy as np

INLINE_TYPES = (int, str, bool, dict)  # (checked in the generated code by ``type(v) is T``)


def _run(source: str, name: str, namespace: dict[str, Any]) -> Callable:
    exec(compile(source, f"<codec {name}>", "exec"), namespace)  # noqa: S102 - our own source, from our own classes
    return namespace[name]


def decoder(cls: type, plan: list[tuple[str, Any, bool, str]], post: bool, wrong_type: Callable,
            malformed: Callable) -> Callable:
    """``decode(raw, where, frames) -> cls``: ``plan`` per field: name, its checker (or one of
    ``INLINE_TYPES``), whether it is required, and its label in errors; ``post``: run the
    instance's ``check`` after."""
    ns: dict[str, Any] = {"cls": cls, "wrong_type": wrong_type, "malformed": malformed}
    lines = ["def decode(raw, where, frames):",
             "    if type(raw) is not dict:",
             "        raise malformed(f'{where} must be an object')",
             "    get = raw.get",
             "    kw = {}"]
    for i, (name, check, required, label) in enumerate(plan):
        ns[f"l{i}"] = label
        lines.append(f"    v = get({name!r})")
        if required:
            lines += ["    if v is None:", f'        raise malformed(f"{{where}} lacks field {name!r}")']
            indent = "    "
        else:  # (absent or null: the constructor's default)
            lines.append("    if v is not None:")
            indent = "        "
        if check in INLINE_TYPES:
            ns[f"t{i}"] = check
            lines += [f"{indent}if type(v) is not t{i}:", f"{indent}    raise wrong_type(l{i}, v)",
                      f"{indent}kw[{name!r}] = v"]
        else:
            ns[f"c{i}"] = check
            lines.append(f"{indent}kw[{name!r}] = c{i}(v, l{i}, frames)")
    lines.append("    obj = cls(**kw)")
    if post:
        lines.append("    obj.check()")
    lines.append("    return obj")
    return _run("\n".join(lines), "decode", ns)


def encoder(cls: type, kinds: dict[str, tuple[str, Any]], plain: Callable, tensor: Callable,
            plain_types: frozenset) -> Callable:
    """``encode(obj, frames) -> dict``: per field of ``cls``, ``kinds[name]`` = (how, helper):
    ``"value"`` (sent as it is: plain JSON, token lists, numpy scalars), ``"tensor"``,
    ``"object"`` (a nested dataclass; helper: its encoder), ``"objects"`` (a list of them), or
    ``"any"`` (``plain``'s generic walk)."""
    ns: dict[str, Any] = {"plain": plain, "tensor": tensor, "PLAIN": plain_types, "ndarray": np.ndarray}
    lines = ["def encode(obj, frames):", "    out = {}"]
    for i, f in enumerate(fields(cls)):
        how, helper = kinds[f.name]
        ns[f"e{i}"] = helper
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else None)  # (None: required, or null)
        ns[f"d{i}"] = default
        lines.append(f"    v = obj.{f.name}")
        test = "v is not None"
        if how == "tensor":
            value = "tensor(v, frames)"
        else:
            if default is not None:  # (an array is always sent: ``!=`` compares elementwise)
                test += f" and (isinstance(v, ndarray) or v != d{i})" if how == "any" else f" and v != d{i}"
            value = {"value": "v", "object": f"e{i}(v, frames)", "objects": f"[e{i}(x, frames) for x in v]",
                     "any": "v if type(v) in PLAIN else plain(v, frames)"}[how]
        lines += [f"    if {test}:", f"        out[{f.name!r}] = {value}"]
    lines.append("    return out")
    return _run("\n".join(lines), "encode", ns)
