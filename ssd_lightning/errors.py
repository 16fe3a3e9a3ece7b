"""Errors that mean "the input is wrong", as opposed to a bug.

``python train.py`` prints these as one message naming the config key or file and what to do, without a
stack trace (the traceback still goes to the run's log file). See docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

__all__ = [
    "UserError",
    "ConfigError",
    "CheckpointWriteError",
    "NonFiniteLossError",
    "user_errors_as_messages",
]


class UserError(Exception):
    """Bad configuration, data or environment: the message says which key/file and how to fix it."""


class ConfigError(UserError, ValueError):
    """A config value is missing, of the wrong type, or impossible."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written; the previous file of that name is untouched."""


class NonFiniteLossError(UserError, FloatingPointError):
    """Training produced NaN/inf losses for too many consecutive steps."""


# -- how command-line entry points report them --------------------------------------------------------
#: Exceptions that come from the input (config, data files, environment) rather than from a bug. Hydra's
#: InstantiationException wraps errors raised by constructors; Lightning's MisconfigurationException names
#: Trainer arguments. Anything else is a bug and keeps its full traceback.
USER_ERROR_TYPES: tuple[type[BaseException], ...] = (UserError, ValueError, OSError)


def _user_error_types() -> tuple[type[BaseException], ...]:
    from hydra.errors import InstantiationException
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    return (*USER_ERROR_TYPES, InstantiationException, MisconfigurationException)


def _rank_prefix() -> str:
    """``"[rank N] "`` in a multi-process job, else nothing."""
    import torch.distributed as dist
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return f"[rank {rank}] " if distributed or rank > 0 else ""


def _peer_failed(error: BaseException) -> bool:
    """A collective broke because another process of the job died (gloo says so; NCCL would time out)."""
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "Connection closed by peer" in text or "Connection reset" in text
    )


def _log_files() -> list[str]:
    return [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


@contextlib.contextmanager
def user_errors_as_messages() -> Iterator[None]:
    """Print user errors as one ``Error: ...`` message and exit 2 (config) or 1 (data, files, environment).

    The traceback goes to the run's log file only (``HYDRA_FULL_ERROR=1`` re-raises it instead). Ctrl-C
    outside training exits 130 with one line.
    """
    try:
        yield
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        raise SystemExit(130) from None
    except RuntimeError as error:
        if not _peer_failed(error) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        sys.stderr.write(
            f"{_rank_prefix()}Stopped: another process of this job failed; its message is above.\n"
        )
        raise SystemExit(1) from None
    except _user_error_types() as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        files = _log_files()
        record = logging.makeLogRecord(
            {
                "name": "ssd_lightning",
                "levelno": logging.ERROR,
                "levelname": "ERROR",
                "msg": "failed",
                "exc_info": (type(error), error, error.__traceback__),
            }
        )
        for handler in logging.getLogger().handlers:  # the traceback goes to the log files only
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)
        where = f"traceback in {files[0]}; " if files else ""
        sys.stderr.write(f"{_rank_prefix()}Error: {error}\n({where}HYDRA_FULL_ERROR=1 prints it here)\n")
        config_error = isinstance(error, ConfigError) or isinstance(error.__cause__, ConfigError)
        raise SystemExit(2 if config_error else 1) from None
