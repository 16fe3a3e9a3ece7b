"""``checkpoints/best.ckpt``: the weights of the evaluation that scored highest, beside ``last.ckpt``."""

from __future__ import annotations

import logging
import os

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

log = logging.getLogger(__name__)


class BestCheckpoint(ModelCheckpoint):
    """``<dirpath>/<filename>.ckpt`` of the best ``monitor``; without ``monitor`` none, said once."""

    def __init__(
        self, dirpath: str | os.PathLike, monitor: str, mode: str = "max", filename: str = "best"
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            mode=mode,
            save_top_k=1,
            save_last=False,
            auto_insert_metric_name=False,
            enable_version_counter=False,  # rewrite best.ckpt, never best-v1.ckpt
            save_on_train_epoch_end=False,  # after validation, when the metric is fresh
        )
        self._said_missing = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor in trainer.callback_metrics:
            super().on_validation_end(trainer, pl_module)
        elif not self._said_missing and trainer.is_global_zero:
            self._said_missing = True
            log.warning(
                "validation logged no %s: no %s.ckpt is written (is the callback that logs it disabled?)",
                *(self.monitor, self.filename),
            )
