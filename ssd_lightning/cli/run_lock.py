"""One owner per run directory: ``train.py`` refuses a folder that a live process is training in.

Rank 0 holds an exclusive ``flock`` on ``<run dir>/.owner.lock``, dropped however the process ends.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from ssd_lightning.cli.sweep_summary import launcher_rank
from ssd_lightning.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".owner.lock"
_held: dict[Path, int] = {}  # lock file -> open descriptor, for as long as this process owns the run


class RunInUseError(UserError):
    """Another live process is training in this run directory."""


def own_run_dir(run_dir: str | os.PathLike) -> None:
    """Take ``run_dir`` (rank 0 only), or raise :class:`RunInUseError` naming its owner."""
    if launcher_rank() != 0 or os.environ.get("NODE_RANK", "0").strip() not in ("", "0"):
        return
    path = Path(run_dir).resolve() / LOCK_NAME
    if path in _held:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        owner = os.read(fd, 512).decode(errors="replace").strip()
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            log.warning("%s: this filesystem has no file locks, so nothing stops a second run here", path)
            return
        raise RunInUseError(
            f"run directory {path.parent} is in use by {owner or 'another process'}: a second process there "
            "would overwrite its checkpoints and logs. Wait for that one to end (or stop it), then resume"
        ) from None
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, training since {since}\n".encode())
    _held[path] = fd


def release_run_dirs() -> None:
    """Let the next process have the run directories this process owns."""
    while _held:  # closing the descriptor drops the lock; the file stays, naming the last owner
        os.close(_held.popitem()[1])
