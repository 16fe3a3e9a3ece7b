"""Files that appear whole or not at all: written to a temporary file in the same folder, then renamed.

A reader sees the previous version or the new one; a crash leaves at most a ``.<name>.<random>.tmp``, unique
per call, so writers on other hosts do not collide (the last rename wins).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_json", "atomic_write_text"]

_UMASK = os.umask(0)  # read once, at import: os.umask can only be read by setting it
os.umask(_UMASK)


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False) -> Path:
    """Create or replace ``path`` with what ``write`` writes to an open text (UTF-8) or binary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text))


def atomic_write_json(path: str | os.PathLike, data: Any, **dump_kwargs: Any) -> Path:
    return atomic_write(path, lambda f: json.dump(data, f, **dump_kwargs))
