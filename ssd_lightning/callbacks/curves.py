"""``curves.png`` of a run: training loss and LR over steps, validation mAP over epochs."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger

from ssd_lightning.callbacks.evaluation_artifacts import EvaluationArtifacts
from ssd_lightning.visualize import plot_curves

__all__ = ["TrainingCurves"]


class TrainingCurves(EvaluationArtifacts):
    """Redraw ``<output_dir>/curves.png`` from the run's ``CSVLogger`` file on rank 0 during ``fit``: after
    every ``every_n_evals``-th evaluation (and the last epoch's) and at its end. No ``CSVLogger``: no curves
    (warned once); a failing plot is warned about once per error type and never stops training."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and self._count_evaluation(trainer) and trainer.is_global_zero:
            self._write_curves(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._write_curves(trainer)

    def _write_curves(self, trainer: pl.Trainer) -> None:
        csv_logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        if csv_logger is None:
            self._warn_once("csv", "curves.png needs a CSVLogger (logger=default or csv); no curves")
            return
        out_dir = self._out_dir(trainer)
        try:
            csv_logger.save()  # flush what is buffered so the curves include the latest values
            metrics_file = Path(csv_logger.experiment.metrics_file_path)
            if metrics_file.is_file():
                title = f"{out_dir.name}: epoch {trainer.current_epoch}"
                plot_curves({"run": metrics_file}, out_dir / "curves.png", title=title)
        except Exception as e:  # never end a training run over a plot
            self._warn_once(f"curves:{type(e).__name__}", f"could not draw curves.png: {e}")
