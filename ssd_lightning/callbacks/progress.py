"""A progress bar that shows the loss and LR without reading them back from the device every step."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.callbacks import TQDMProgressBar

__all__ = ["StepMetricsProgressBar"]


class StepMetricsProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar plus the latest loss, LR and images/s, read only when the bar redraws."""

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        metrics = super().get_metrics(trainer, pl_module)
        if trainer.training:
            loss = trainer.callback_metrics.get("train/loss_step")
            if loss is not None:
                metrics["loss"] = f"{float(loss):.3f}"
            if trainer.optimizers:
                metrics["lr"] = f"{trainer.optimizers[0].param_groups[0]['lr']:.3g}"
            # `is not None`: a tqdm without a total (a resumed epoch) raises on bool()
            bar = self.train_progress_bar.format_dict if self.train_progress_bar is not None else {}
            batch_size = getattr(trainer.datamodule, "batch_size", None)
            if bar.get("elapsed") and batch_size:  # over the epoch so far, all ranks
                metrics["img/s"] = f"{bar['n'] / bar['elapsed'] * batch_size * trainer.world_size:.1f}"
        return metrics
