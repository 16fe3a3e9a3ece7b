"""Stop a fit when its monitored metric has stopped improving, counted in evaluations."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.callbacks import EarlyStopping as LightningEarlyStopping

__all__ = ["EarlyStopping"]


class EarlyStopping(LightningEarlyStopping):
    """Lightning's ``EarlyStopping`` after validations only (``patience`` counts them); None: off."""

    def __init__(
        self, monitor: str, *, patience: int | None = None, min_delta: float = 0.0, mode: str = "max"
    ):
        if patience is not None and (
            isinstance(patience, bool) or not isinstance(patience, int) or patience < 0
        ):
            raise ValueError(
                f"callbacks.early_stopping.patience must be null or an int >= 0, got {patience!r}"
            )
        super().__init__(
            monitor=monitor, patience=0 if patience is None else patience, min_delta=min_delta, mode=mode,
            strict=True, verbose=True, check_on_train_epoch_end=False,
        )  # fmt: skip
        self.enabled = patience is not None

    def load_state_dict(self, state_dict: dict) -> None:
        """Counters and best score from a checkpoint; the patience stays this run's (a resume may set it)."""
        patience = self.patience
        super().load_state_dict(state_dict)
        self.patience = patience

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled:
            super().on_validation_end(trainer, pl_module)
