"""Remember that a COCO split passed its check, so that an unchanged dataset is checked once per machine.

One JSON entry per split (host + resolved paths), valid while the annotation file's size and ``mtime_ns``, the
image directory's ``mtime_ns``, ``check_files`` and :data:`VERSION` are unchanged; written atomically, only
for files last modified :data:`RACY_SECONDS` before the check began. One process checks a split at a time
(``flock``); the waiting ones read its entry or raise its recorded error. The dataset directory is never
written to; a bad entry is ignored and rewritten. Reasons: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ssd_lightning import errors
from ssd_lightning.io.atomic import atomic_write_json

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["VERSION", "RACY_SECONDS", "SplitCache", "file_lock", "writable_cache_dir"]

log = logging.getLogger(__name__)

VERSION = 3  # bump when the check's policy or the entry's fields change (2: file ends, sizes; 3: str sizes)
RACY_SECONDS = 2.0
_ERRORS = {cls.__name__: cls for cls in (errors.DataError, errors.MissingDataError)}


def writable_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """``cache_dir`` (created if needed), else the default (``$SSD_LIGHTNING_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/ssd_lightning``, ``~/.cache/ssd_lightning``), else a per-user temp folder (None: none
    works)."""
    if cache_dir is not None:
        candidates = [Path(cache_dir)]
    else:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        default = os.environ.get("SSD_LIGHTNING_CACHE_DIR") or os.path.join(xdg, "ssd_lightning")
        candidates = [Path(default), Path(tempfile.gettempdir()) / f"ssd_lightning-{uid}"]
    for folder in candidates:
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK | os.X_OK):
                return folder
    log.warning("no writable cache directory among %s; every process checks its data itself", candidates)
    return None


@contextlib.contextmanager
def file_lock(lock_file: Path, doing: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` (created if needed) while one process is ``doing`` what
    the others then reuse; without ``fcntl`` or where locking fails, go on without it (logged)."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.warning("cannot create the lock file %s (%s); going on without it", lock_file, exc)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish %s", doing)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # e.g. ENOLCK on a network file system without locking
            log.warning("cannot lock %s (%s); going on without the lock", lock_file, exc)
        yield
    finally:
        os.close(fd)  # releases the lock


class SplitCache:
    """The cache entry of one split (annotation file + image directory) in ``folder``."""

    def __init__(self, folder: Path, annotation_file: Path, image_dir: Path) -> None:
        self.annotation_file = annotation_file.resolve()
        self.image_dir = image_dir.resolve()
        # the host is part of the key: a cache folder shared by the nodes of a cluster ($HOME on NFS) holds
        # one entry per node, so nodes with local copies at the same path neither queue nor overwrite
        where = f"{socket.gethostname()}\0{self.annotation_file}\0{self.image_dir}"
        key = hashlib.sha1(where.encode()).hexdigest()[:16]
        self.path = folder / f"split-{annotation_file.stem}-{key}.json"
        self._started = time.time()
        self._identity = self._current_identity()

    def _current_identity(self) -> dict[str, Any]:
        ann, img = self.annotation_file.stat(), self.image_dir.stat()
        identity = dict(version=VERSION, annotation_file=str(self.annotation_file), size=ann.st_size)
        return identity | dict(
            mtime_ns=ann.st_mtime_ns, image_dir=str(self.image_dir), image_dir_mtime_ns=img.st_mtime_ns
        )

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """Hold the entry's exclusive lock (waits while another process checks this split)."""
        return file_lock(self.path.with_suffix(".lock"), f"checking {self.annotation_file}")

    def load(self, *, check_files: bool) -> dict[str, Any] | None:
        """The stored result when it is for the files as they are now (and checked at least as much)."""
        try:
            entry = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable split cache %s (%s)", self.path, exc)
            return None
        if not isinstance(entry, dict) or entry.get("identity") != self._identity:
            return None
        error = entry.get("error")
        if isinstance(error, dict) and entry.get("written", 0) >= self._started:
            # found by the process this one was waiting for: same files, same error
            raise _ERRORS.get(error.get("kind"), errors.DataError)(str(error.get("message")))
        if check_files and not entry.get("files_checked"):
            return None
        result = entry.get("result")
        return result if isinstance(result, dict) else None

    def store(self, result: dict[str, Any], *, files_checked: bool) -> bool:
        """Write the entry atomically; False (nothing written) if the files changed recently or meanwhile."""
        if self._current_identity() != self._identity:
            return False  # changed while it was being checked
        newest = max(self._identity["mtime_ns"], self._identity["image_dir_mtime_ns"]) / 1e9
        if self._started - newest < RACY_SECONDS:
            log.debug(
                "not caching the check of %s: modified less than %s s ago", self.annotation_file, RACY_SECONDS
            )
            return False
        return self._write({"identity": self._identity, "files_checked": files_checked, "result": result})

    def store_error(self, error: errors.UserError) -> None:
        """Record what the check found wrong, for the processes waiting for this one (see the module doc)."""
        if self._current_identity() == self._identity:
            found = {"kind": type(error).__name__, "message": str(error)}
            self._write({"identity": self._identity, "error": found, "written": time.time()})

    def _write(self, entry: dict[str, Any]) -> bool:
        try:
            atomic_write_json(self.path, entry)
        except OSError as exc:
            log.warning("could not write the split cache %s (%s)", self.path, exc)
            return False
        return True
