"""Every private attribute of Lightning, Hydra and torch that ssd_lightning touches, behind named accessors.

Each accessor looks its attribute up strictly (:class:`CompatError` when an upgrade renamed it);
:func:`check_installed` runs them all on a fresh Trainer before ``fit``. Imports stay inside the accessors.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ssd_lightning.errors import UserError

if TYPE_CHECKING:
    import pytorch_lightning as pl
    import torch
    from torch import nn

SignalHandler = Callable[[int, Any], None]

_PL, _TORCH, _HYDRA = "pytorch_lightning", "torch", "hydra"
_DISTRIBUTIONS = {_PL: "pytorch-lightning", _TORCH: "torch", _HYDRA: "hydra-core"}

# Lightning's profiler action around the training loader's ``__next__`` ("[_TrainingEpochLoop].<this>")
TRAIN_FETCH_ACTION = "train_dataloader_next"
# the attribute names Lightning's signal handling is replaced through (instance attributes shadow them)
_SIGTERM_NOTIFIER = "_sigterm_notifier_fn"
_SLURM_SIGUSR_HANDLER = "_slurm_sigusr_handler_fn"
_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


class CompatError(UserError, RuntimeError):
    """An unsupported Lightning/Hydra/torch: one line naming package, version, attribute, supported range."""


def _supported(package: str) -> str:
    """ssd_lightning's requirement for ``package`` (``pytorch-lightning>=2.6,<2.7``)."""
    distribution = _DISTRIBUTIONS[package]
    try:
        requirements = importlib.metadata.requires("ssd_lightning") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*([^;]*)", requirement.split(";")[0].strip())
        if found and found[1] == distribution and found[2]:
            return distribution + ",".join(sorted(found[2].split(","), key=lambda s: not s.startswith(">")))
    return f"the {distribution} versions pyproject.toml pins"


def _missing(package: str, what: str) -> CompatError:
    version = getattr(importlib.import_module(package), "__version__", "?")
    return CompatError(f"{package} {version} has no {what}; ssd_lightning supports {_supported(package)}")


def _attr(owner: object, name: str, where: str, package: str = _PL) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _missing(package, f"{where}.{name}") from None


# -- Lightning: signals --------------------------------------------------------------------------------------
def _signal_connector(trainer: pl.Trainer) -> Any:
    return _attr(trainer, "_signal_connector", "Trainer")


def set_sigterm_received(trainer: pl.Trainer, value: bool) -> None:
    """Raise or lower Lightning's "stop after this step" flag (``trainer.received_sigterm``)."""
    connector = _signal_connector(trainer)
    _attr(connector, "received_sigterm", "Trainer._signal_connector")
    connector.received_sigterm = bool(value)


def replace_signal_handlers(
    trainer: pl.Trainer, *, sigterm: SignalHandler, slurm_requeue: SignalHandler
) -> None:
    """Make Lightning register ``sigterm``/``slurm_requeue`` instead of its handlers (which broadcast or save
    inside the handler); call in ``on_fit_start``, undo with :func:`restore_signal_handling`."""
    connector = _signal_connector(trainer)
    for name, handler in ((_SIGTERM_NOTIFIER, sigterm), (_SLURM_SIGUSR_HANDLER, slurm_requeue)):
        _attr(connector, name, "Trainer._signal_connector")
        setattr(connector, name, handler)


def skip_per_step_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """No broadcast of the SIGTERM flag before every DDP training step (a sync per step); undoable."""
    epoch_loop = trainer.fit_loop.epoch_loop
    _attr(epoch_loop, _SIGTERM_BROADCAST, "Trainer.fit_loop.epoch_loop")
    setattr(epoch_loop, _SIGTERM_BROADCAST, lambda: None)


def restore_signal_handling(trainer: pl.Trainer) -> None:
    """Lightning's own handlers and per-step broadcast again (drops what the two functions above set)."""
    for name in (_SIGTERM_NOTIFIER, _SLURM_SIGUSR_HANDLER):
        vars(_signal_connector(trainer)).pop(name, None)
    vars(trainer.fit_loop.epoch_loop).pop(_SIGTERM_BROADCAST, None)


@functools.cache
def _subprocess_script_launcher_class() -> type:
    where = "pytorch_lightning.strategies.launchers.subprocess_script"
    try:
        return importlib.import_module(where)._SubprocessScriptLauncher
    except (ImportError, AttributeError):
        raise _missing(_PL, f"{where}._SubprocessScriptLauncher") from None


def subprocess_script_launcher(trainer: pl.Trainer) -> Any | None:
    """The trainer's launcher if Lightning's own starts the ranks as subprocesses, else None."""
    launcher = trainer.strategy.launcher
    return launcher if isinstance(launcher, _subprocess_script_launcher_class()) else None


def take_launched_processes(trainer: pl.Trainer) -> list[subprocess.Popen]:
    """The rank processes Lightning's launcher started here (``[]`` elsewhere), taken out of the list its
    observer watches: it would SIGKILL this process on finding one ended by a signal."""
    launcher = subprocess_script_launcher(trainer)
    if launcher is None:
        return []
    procs = _attr(launcher, "procs", "_SubprocessScriptLauncher")
    children = list(procs)
    procs.clear()
    return children


# -- Lightning: loops and validation schedule ----------------------------------------------------------------
def load_pending_loader_states(trainer: pl.Trainer) -> None:
    """Give the train loaders the checkpoint's states for them, if Lightning has not yet."""
    fit_loop = trainer.fit_loop
    pending = _attr(fit_loop, "_combined_loader_states_to_load", "Trainer.fit_loop")
    loader = _attr(fit_loop, "_combined_loader", "Trainer.fit_loop")
    if pending and loader is not None:
        _attr(loader, "_load_state_dicts", "CombinedLoader")(pending)
        fit_loop._combined_loader_states_to_load = []


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """Lightning's logging step (the ``step`` column of ``metrics.csv``), restored from checkpoints."""
    return int(_attr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", "Trainer.fit_loop.epoch_loop"))


def val_check_time_interval(trainer: pl.Trainer) -> float | None:
    """Seconds between validations for a time-based ``Trainer(val_check_interval=...)``, else None."""
    return _attr(trainer, "_val_check_time_interval", "Trainer")


@functools.cache
def _fetch_action_in(loop_class: type) -> bool:
    try:
        return f'].{TRAIN_FETCH_ACTION}"' in inspect.getsource(loop_class)
    except (OSError, TypeError):  # installed without sources: nothing to check against
        return True


def train_fetch_action(trainer: pl.Trainer) -> str:
    """:data:`TRAIN_FETCH_ACTION`, checked against the source of the trainer's training epoch loop."""
    loop_class = type(trainer.fit_loop.epoch_loop)
    if not _fetch_action_in(loop_class):
        raise _missing(_PL, f'{loop_class.__name__} profiler action "{TRAIN_FETCH_ACTION}"')
    return TRAIN_FETCH_ACTION


# -- Lightning: the CSV logger -------------------------------------------------------------------------------
def csv_logger_experiment(logger: Any, writer_class: type) -> Any:
    """``CSVLogger.experiment`` with ``writer_class`` (overriding ``_check_log_dir_exists``) as its writer."""
    from pytorch_lightning.loggers.csv_logs import ExperimentWriter

    _attr(ExperimentWriter, "_check_log_dir_exists", "ExperimentWriter")
    if _attr(logger, "_experiment", "CSVLogger") is None:
        _attr(logger, "_fs", "CSVLogger").makedirs(logger.root_dir, exist_ok=True)
        logger._experiment = writer_class(log_dir=logger.log_dir)
    return logger._experiment


# -- torch ---------------------------------------------------------------------------------------------------
@functools.cache
def _storage_use_count_fn() -> Callable[[int], int]:
    import torch

    use_count = _attr(torch._C, "_storage_Use_Count", "torch._C", _TORCH)
    _attr(torch.empty(0).untyped_storage(), "_cdata", "UntypedStorage", _TORCH)
    return use_count


def storage_use_count(tensor: torch.Tensor) -> int:
    """Tensors sharing ``tensor``'s storage, ``tensor`` included (views count)."""
    # the temporary storage object made by untyped_storage() holds one reference of its own
    return _storage_use_count_fn()(tensor.untyped_storage()._cdata) - 1


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on ``module`` (``torch.compile(module)`` wraps it instead)."""
    return _attr(module, "_compiled_call_impl", "nn.Module", _TORCH) is not None


def norm_base_class() -> type:
    """torch's base class of BatchNorm*/SyncBatchNorm/InstanceNorm* layers."""
    from torch import nn

    return _attr(nn.modules.batchnorm, "_NormBase", "torch.nn.modules.batchnorm", _TORCH)


# -- Hydra ---------------------------------------------------------------------------------------------------
def job_return_value(job_return: Any) -> Any:
    """A Hydra job's return value or exception (``JobReturn.return_value`` re-raises the latter)."""
    return _attr(job_return, "_return_value", "JobReturn", _HYDRA)


# -- all at once ---------------------------------------------------------------------------------------------
def check_installed(trainer: pl.Trainer) -> None:
    """Look up every private attribute the accessors touch; :class:`CompatError` for the first missing."""
    from hydra.core.utils import JobReturn
    from pytorch_lightning.loggers import CSVLogger
    from pytorch_lightning.loggers.csv_logs import ExperimentWriter
    from pytorch_lightning.utilities import CombinedLoader
    from torch import nn

    connector = _signal_connector(trainer)
    for name in ("received_sigterm", _SIGTERM_NOTIFIER, _SLURM_SIGUSR_HANDLER):
        _attr(connector, name, "Trainer._signal_connector")
    _attr(trainer.fit_loop.epoch_loop, _SIGTERM_BROADCAST, "Trainer.fit_loop.epoch_loop")
    _subprocess_script_launcher_class()
    for name in ("_combined_loader_states_to_load", "_combined_loader"):
        _attr(trainer.fit_loop, name, "Trainer.fit_loop")
    _attr(CombinedLoader, "_load_state_dicts", "CombinedLoader")
    batches_that_stepped(trainer)
    val_check_time_interval(trainer)
    train_fetch_action(trainer)
    csv = CSVLogger(save_dir="unused", version=0)  # touches no file
    for name in ("_experiment", "_fs"):
        _attr(csv, name, "CSVLogger")
    _attr(ExperimentWriter, "_check_log_dir_exists", "ExperimentWriter")

    _storage_use_count_fn()
    _attr(nn.Module, "_compiled_call_impl", "nn.Module", _TORCH)
    norm_base_class()
    _attr(JobReturn, "_return_value", "JobReturn", _HYDRA)
