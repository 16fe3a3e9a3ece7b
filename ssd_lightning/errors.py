"""Errors that mean "the input is wrong", as opposed to a bug.

``python train.py`` prints these as one message naming the config key or file and what to do, the traceback
going to the run's log file only (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

__all__ = ["UserError", "ConfigError", "DataError", "MissingDataError", "CheckpointWriteError",
           "DatasetConflictError", "NonFiniteLossError",
           "is_user_error", "user_errors_as_messages"]  # fmt: skip


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
    """Input errors, as opposed to bugs: ours, Lightning's ``MisconfigurationException`` (it names Trainer
    arguments), and Hydra's ``InstantiationException`` of a constructor that rejected a value (``ValueError``
    or ours; a ``TypeError`` there is a bug or a wrong key)."""
    from hydra.errors import InstantiationException
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    if isinstance(error, (UserError, MisconfigurationException)):
        return True
    return isinstance(error, InstantiationException) and isinstance(error.__cause__, (ValueError, UserError))


def _rank_prefix() -> str:
    """``"[rank N] "`` in a multi-process job, else nothing."""
    import torch.distributed as dist
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return f"[rank {rank}] " if distributed or rank > 0 else ""


def _peer_failed(error: BaseException) -> bool:
    """A collective broke because another process of the job died (gloo says so; NCCL would time out)."""
    import torch.distributed as dist

    text = str(error)
    in_a_job = dist.is_available() and dist.is_initialized()
    return in_a_job and ("Connection closed by peer" in text or "Connection reset by peer" in text)


@contextlib.contextmanager
def user_errors_as_messages() -> Iterator[None]:
    """Print user errors as one ``Error: ...`` message, the traceback to the log files only
    (``HYDRA_FULL_ERROR=1`` re-raises instead), and exit 2 (config) or 1 (data, files, environment); other
    errors keep their traceback. Ctrl-C outside training exits 130 with one line."""
    try:
        yield
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        raise SystemExit(130) from None
    except Exception as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if isinstance(error, RuntimeError) and _peer_failed(error):
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
