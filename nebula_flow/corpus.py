"""Text to read: Python source files (by default the standard library's), for draft training,
long-context benchmarks and prompts cut from traces that carry only lengths."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(paths: list[str] | None) -> list[Path]:
    """The ``*.py`` files under ``paths`` (folders or files; default: the standard library), test
    folders left out, in a stable order."""
    roots = [Path(p) for p in paths] if paths else [stdlib_root()]
    files: list[Path] = []
    for root in roots:
        files.extend(sorted(root.rglob("*.py")) if root.is_dir() else [root])
    return [f for f in files if "test" not in f.parts and f.is_file()]
