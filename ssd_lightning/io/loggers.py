"""Loggers that continue their run when the run directory is resumed in place (``resume=<run dir>``).

``logger=csv`` appends to ``metrics.csv``; ``wandb``/``mlflow`` (the ``loggers`` extra) keep their run id.
"""

from __future__ import annotations

import csv
import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_fabric.loggers.logger import rank_zero_experiment
from lightning_fabric.utilities.rank_zero import rank_zero_only
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, MLFlowLogger, WandbLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import DummyLogger

from ssd_lightning import compat
from ssd_lightning.errors import UserError
from ssd_lightning.io.atomic import atomic_write, atomic_write_text


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer continuing an existing ``metrics.csv``: at the first save, its rows from the
    first step logged now on are dropped (the resumed run logs them again)."""

    def _check_log_dir_exists(self) -> None:  # Lightning's hook, checked by compat.csv_logger_experiment
        self._continued = os.path.isfile(self.metrics_file_path)
        if self._continued:
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])

    def save(self) -> None:
        if self._continued and self.metrics:
            self._continued = False
            first = min(int(row["step"]) for row in self.metrics)
            with open(self.metrics_file_path, newline="") as f:
                rows = [row for row in csv.DictReader(f) if not row["step"] or int(row["step"]) < first]

            def write(f) -> None:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(rows)

            atomic_write(self.metrics_file_path, write)
        super().save()


class ContinuingCSVLogger(CSVLogger):
    """``CSVLogger`` that continues a resumed run's ``metrics.csv`` (``resume=<run dir>``)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        return compat.csv_logger_experiment(self, _ContinuingWriter)


# -- W&B and MLflow: one tracker run per run directory, continued by resume=<run dir> ---------------------
EXTRA_INSTALL = 'pip install -e ".[loggers]"'
WANDB_RUN_ID_FILE = "wandb_run_id"
MLFLOW_RUN_ID_FILE = "mlflow_run_id"


class MissingExtraError(UserError, ModuleNotFoundError):
    """A logger's package is not installed; the message names the extra that installs it."""


def _require(module: str, choice: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(f"{choice} needs the {module} package: {EXTRA_INSTALL}") from None


def _stored_run_id(run_dir: str | os.PathLike, name: str) -> str | None:
    file = Path(run_dir) / name
    return (file.read_text().strip() or None) if file.is_file() else None


def _keep_run_id(run_dir: str | os.PathLike, name: str, run_id: str) -> None:
    if _stored_run_id(run_dir, name) != run_id:
        atomic_write_text(Path(run_dir) / name, run_id + "\n")


def _checkpoint_paths(callback: ModelCheckpoint) -> dict[str, str]:
    """``checkpoint/last`` and ``checkpoint/best`` (with a ``monitor``): absolute paths."""
    best = callback.best_model_path if callback.monitor is not None else ""
    paths = {"checkpoint/last": callback.last_model_path, "checkpoint/best": best}
    return {key: os.path.abspath(path) for key, path in paths.items() if path}


class ResumableWandbLogger(WandbLogger):
    """``WandbLogger`` under ``save_dir`` (the run directory), whose W&B run id ``<save_dir>/wandb_run_id``
    keeps for ``resume=<run dir>``; checkpoint paths go to the run's summary. Offline: ``offline=True``."""

    def __init__(self, save_dir: str | os.PathLike, **kwargs: Any) -> None:
        _require("wandb", "logger=wandb")
        if not (kwargs.get("id") or kwargs.get("version")):
            kwargs["id"] = _stored_run_id(save_dir, WANDB_RUN_ID_FILE)
        self._run: Any = None  # the W&B run this logger started, until finalize finishes it
        super().__init__(save_dir=save_dir, **kwargs)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        run = super().experiment
        if self._run is None and getattr(run, "id", None):
            self._run = run
            _keep_run_id(self.save_dir, WANDB_RUN_ID_FILE, run.id)
        return run

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Finish the W&B run (its files complete, its id free for a resume that follows at once)."""
        super().finalize(status)
        if self._run is not None:
            self._run.finish(exit_code=0 if status in ("success", "finished") else 1)
            self._run = None

    @property
    def log_dir(self) -> str:
        """``<save_dir>/wandb``: W&B's folder of this run directory (``offline-run-*`` for ``wandb sync``)."""
        return os.path.join(os.fspath(self.save_dir), "wandb")

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        super().after_save_checkpoint(checkpoint_callback)
        self.experiment.summary.update(_checkpoint_paths(checkpoint_callback))


def _flat(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``a/b/c`` keys (Lightning's flattening for MLflow parameters)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


class ResumableMLFlowLogger(MLFlowLogger):
    """``MLFlowLogger`` whose run id ``<run_dir>/mlflow_run_id`` keeps for ``resume=<run dir>`` (store:
    ``tracking_uri``, ``MLFLOW_TRACKING_URI`` or ``sqlite:///<run_dir>/mlflow.db``); a resumed run logs
    changed parameters as tags ``resumed/<key>``, checkpoint paths as ``checkpoint/last``/``best``."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        tracking_uri: str | None = None,
        artifact_location: str | None = None,
        **kwargs: Any,
    ) -> None:
        _require("mlflow", "logger=mlflow")
        self._run_dir = os.fspath(run_dir)
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            tracking_uri = f"sqlite:///{os.path.abspath(self._run_dir)}/mlflow.db"
            artifact_location = artifact_location or Path(self._run_dir, "mlartifacts").resolve().as_uri()
        self.tracking_uri = tracking_uri
        run_id = kwargs.pop("run_id", None) or _stored_run_id(run_dir, MLFLOW_RUN_ID_FILE)
        self._resumed, self._run_id_kept = run_id is not None, False
        super().__init__(
            tracking_uri=tracking_uri, artifact_location=artifact_location, run_id=run_id, **kwargs
        )

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        client = super().experiment
        if not self._run_id_kept:
            self._run_id_kept = True
            _keep_run_id(self._run_dir, MLFLOW_RUN_ID_FILE, self.run_id)
            if self._resumed:
                client.update_run(self.run_id, status="RUNNING")
        return client

    @property
    def log_dir(self) -> str:
        """The tracking URI (``mlflow ui --backend-store-uri <it>`` shows the run)."""
        return self.tracking_uri

    @rank_zero_only
    def log_hyperparams(self, params: Mapping[str, Any] | Any) -> None:
        if not self._resumed:
            super().log_hyperparams(params)
            return
        known = self.experiment.get_run(self.run_id).data.params
        params = _flat(params if isinstance(params, Mapping) else vars(params))
        super().log_hyperparams({k: v for k, v in params.items() if k not in known})
        for key, value in params.items():
            if key in known and known[key] != str(value)[:250]:
                self.experiment.set_tag(self.run_id, f"resumed/{key}", str(value)[:5000])

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        super().after_save_checkpoint(checkpoint_callback)
        for key, path in _checkpoint_paths(checkpoint_callback).items():
            self.experiment.set_tag(self.run_id, key, path)

    @rank_zero_only
    def log_image(self, key: str, images: list[str | os.PathLike], step: int | None = None) -> None:
        """Store the image files as artifacts under ``<key>/step_<step>/`` (``<key>/`` without a step)."""
        artifact_path = key if step is None else f"{key}/step_{step}"
        for image in images:
            self.experiment.log_artifact(self.run_id, os.fspath(image), artifact_path)


class _OtherRank(DummyLogger):
    """What a process other than global rank 0 gets for a tracker logger: every call does nothing."""

    @property
    def log_dir(self) -> None:
        return None


def mlflow_logger(**kwargs: Any) -> ResumableMLFlowLogger | DummyLogger:
    """``logger=mlflow``: a :class:`ResumableMLFlowLogger` on global rank 0, a do-nothing one elsewhere."""
    if getattr(rank_zero_only, "rank", 0) != 0:
        _require("mlflow", "logger=mlflow")
        return _OtherRank()
    return ResumableMLFlowLogger(**kwargs)
