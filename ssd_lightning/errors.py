"""Errors that mean "the input is wrong", as opposed to a bug.

``python train.py`` prints them as one message, the traceback to the log file only (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


class UserError(Exception):
    """Bad configuration, data or environment: the message says which key/file and how to fix it."""


class ConfigError(UserError, ValueError):
    """A config value is missing, of the wrong type, or impossible."""


class DataError(UserError, ValueError):
    """A dataset file is unreadable or inconsistent (bad JSON, unknown ids, corrupt images, ...)."""


class MissingDataError(UserError, FileNotFoundError):
    """A dataset folder or file the config points at does not exist."""


class DatasetConflictError(UserError, FileExistsError):
    """A dataset folder to generate exists but is incomplete or other (delete it, or pick another path)."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written; the previous file of that name is untouched."""


class NonFiniteLossError(UserError, FloatingPointError):
    """Training produced NaN/inf losses for too many consecutive steps."""


# -- how command-line entry points report them --------------------------------------------------------
def is_user_error(error: BaseException) -> bool:
    """Input errors, not bugs: ours, Lightning's misconfiguration, Hydra's wrapping of a ValueError."""
    from hydra.errors import InstantiationException
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    if isinstance(error, (UserError, MisconfigurationException)):
        return True
    return isinstance(error, InstantiationException) and isinstance(error.__cause__, (ValueError, UserError))


def _in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank_prefix() -> str:
    import torch.distributed as dist
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)
    return f"[rank {rank}] " if (_in_process_group() and dist.get_world_size() > 1) or rank > 0 else ""


@contextlib.contextmanager
def user_errors_as_messages() -> Iterator[None]:
    """Print user errors as one ``Error: ...`` line (traceback to the log files; ``HYDRA_FULL_ERROR=1``
    re-raises) and exit 2 (config) or 1; others keep their traceback. Ctrl-C exits 130."""
    try:
        yield
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        raise SystemExit(130) from None
    except Exception as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        # a collective broke because another process of the job died (gloo says so; NCCL would time out)
        peer = any(f"Connection {w} by peer" in str(error) for w in ("closed", "reset"))
        if isinstance(error, RuntimeError) and peer and _in_process_group():
            sys.stderr.write(
                f"{_rank_prefix()}Stopped: another process of this job failed; its message is above.\n"
            )
            raise SystemExit(1) from None
        if not is_user_error(error):
            raise
        files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        exc_info = (type(error), error, error.__traceback__)
        record = logging.LogRecord("ssd_lightning", logging.ERROR, "", 0, "failed", (), exc_info)
        for handler in files:  # the traceback goes to the log files only
            handler.handle(record)
        where = f"traceback in {files[0].baseFilename}; " if files else ""
        # ours raised inside a constructor Hydra called: our one line, not Hydra's wrapping of it
        shown = error.__cause__ if isinstance(error.__cause__, UserError) else error
        sys.stderr.write(f"{_rank_prefix()}Error: {shown}\n({where}HYDRA_FULL_ERROR=1 prints it here)\n")
        config_error = isinstance(error, ConfigError) or isinstance(error.__cause__, ConfigError)
        raise SystemExit(2 if config_error else 1) from None
