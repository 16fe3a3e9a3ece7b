"""``curves.png`` of a run: training loss and LR over steps, validation mAP over epochs."""

from __future__ import annotations

import os
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities import rank_zero_warn

from ssd_lightning.visualize import plot_curves

__all__ = ["TrainingCurves", "evaluation_is_due"]


def evaluation_is_due(trainer: pl.Trainer, evals_done: int, every_n_evals: int) -> bool:
    """Whether the evaluation now running is one to draw after.

    Outside ``fit`` (``trainer.validate``) always; in ``fit`` every ``every_n_evals``-th evaluation
    (``evals_done`` evaluations of this ``fit`` finished before this one), the last epoch's and one that
    ends the run (``trainer.should_stop``).
    """
    if trainer.state.fn != "fit":
        return True
    last_epoch = trainer.max_epochs is not None and trainer.current_epoch >= trainer.max_epochs - 1
    return last_epoch or trainer.should_stop or (evals_done + 1) % every_n_evals == 0


class TrainingCurves(Callback):
    """Redraw ``<output_dir>/curves.png`` from the run's ``CSVLogger`` file during ``fit``.

    On rank 0, after every ``every_n_evals``-th evaluation of ``fit`` (and the last epoch's; never the
    sanity check or ``trainer.validate``) and at the end of ``fit``, the buffered metrics are flushed and
    :func:`ssd_lightning.visualize.plot_curves` draws ``metrics.csv`` (title ``"<run dir name>: epoch <e>"``).
    No ``CSVLogger``: no curves (warned once). A plot that fails is warned about once per error type and
    never stops training.

    Args:
        output_dir: where ``curves.png`` goes; default ``trainer.default_root_dir``.
        every_n_evals: redraw after every n-th evaluation of ``fit`` (>= 1).
    """

    def __init__(self, *, output_dir: str | os.PathLike | None = None, every_n_evals: int = 1) -> None:
        super().__init__()
        if every_n_evals < 1:
            raise ValueError(f"every_n_evals must be >= 1, got {every_n_evals}")
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.every_n_evals = every_n_evals
        self._evals = 0
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"TrainingCurves: {message}")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        due = evaluation_is_due(trainer, self._evals, self.every_n_evals)
        self._evals += 1
        if due and trainer.is_global_zero:
            self._write_curves(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._write_curves(trainer)

    def _write_curves(self, trainer: pl.Trainer) -> None:
        csv_loggers = [lg for lg in trainer.loggers if isinstance(lg, CSVLogger)]
        if not csv_loggers:
            self._warn_once("csv", "curves.png needs a CSVLogger (logger=default or csv); no curves")
            return
        csv_logger = csv_loggers[0]
        out_dir = self.output_dir if self.output_dir is not None else Path(trainer.default_root_dir)
        try:
            csv_logger.save()  # flush what is buffered so the curves include the latest values
            metrics_file = Path(csv_logger.experiment.metrics_file_path)
            if not metrics_file.is_file():
                return
            title = f"{out_dir.name}: epoch {trainer.current_epoch}"
            plot_curves({"run": metrics_file}, out_dir / "curves.png", title=title)
        except Exception as e:  # never end a training run over a plot
            self._warn_once(f"curves:{type(e).__name__}", f"could not draw curves.png: {e}")
