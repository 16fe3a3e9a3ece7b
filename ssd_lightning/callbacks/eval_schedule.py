"""Validate only after chosen epochs (the NVIDIA SSD recipe evaluates after epochs 21, 31, ..., 64)."""

from __future__ import annotations

import sys
from collections.abc import Iterable

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_warn

from ssd_lightning import compat

__all__ = ["EvalSchedule"]

# ``(current_epoch + 1) % _NEVER == 0`` (Lightning's "validate this epoch?" test) is false for every epoch.
_NEVER = sys.maxsize


class EvalSchedule(Callback):
    """Validate only after the 0-based ``eval_epochs`` (strictly increasing) and, with ``always_last``, the
    last one. Before each epoch it sets ``trainer.check_val_every_n_epoch`` to 1 or to a value no epoch
    reaches (restored after ``fit``), from ``current_epoch`` alone, so a resumed run keeps the schedule.
    """

    def __init__(self, eval_epochs: Iterable[int], *, always_last: bool = True) -> None:
        super().__init__()
        epochs = list(eval_epochs)
        if any(isinstance(e, bool) or not isinstance(e, int) for e in epochs):
            raise ValueError(f"eval_epochs must be a list of ints (0-based epochs), got {epochs!r}")
        if any(e < 0 for e in epochs):
            raise ValueError(f"eval_epochs must be non-negative (0-based epochs), got {epochs}")
        if any(b <= a for a, b in zip(epochs, epochs[1:], strict=False)):
            raise ValueError(f"eval_epochs must be strictly increasing, got {epochs}")
        self.eval_epochs: tuple[int, ...] = tuple(epochs)
        self.always_last = always_last
        self._user_check_val_every_n_epoch: int | None = None

    @staticmethod
    def _last_epoch(trainer: pl.Trainer) -> int | None:
        return None if trainer.max_epochs is None or trainer.max_epochs < 0 else trainer.max_epochs - 1

    def should_validate(self, epoch: int, last_epoch: int | None = None) -> bool:
        """Whether validation runs after 0-based ``epoch`` (``last_epoch``: ``max_epochs - 1``, if known)."""
        return epoch in self.eval_epochs or (self.always_last and epoch == last_epoch)

    def _apply(self, trainer: pl.Trainer) -> None:
        validate = self.should_validate(trainer.current_epoch, self._last_epoch(trainer))
        trainer.check_val_every_n_epoch = 1 if validate else _NEVER

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.check_val_every_n_epoch is None:
            raise ValueError(
                "EvalSchedule needs epoch-based validation, but the Trainer has check_val_every_n_epoch=None "
                "(validation every N training batches); set check_val_every_n_epoch=1 or drop EvalSchedule"
            )
        if compat.val_check_time_interval(trainer) is not None:
            raise ValueError("EvalSchedule does not support a time-based Trainer(val_check_interval=...)")
        if trainer.check_val_every_n_epoch not in (1, _NEVER):
            rank_zero_warn(
                f"EvalSchedule overrides Trainer(check_val_every_n_epoch={trainer.check_val_every_n_epoch}); "
                f"validation runs after epochs {list(self.eval_epochs)}"
                + (" and the last one" if self.always_last else "")
            )
        last = self._last_epoch(trainer)
        beyond = [e for e in self.eval_epochs if last is not None and e > last]
        if beyond:  # e.g. trainer.max_epochs=1 on a recipe's schedule: those epochs are never reached
            rank_zero_warn(
                f"eval_epochs {beyond} lie past the last epoch ({last}, from Trainer(max_epochs="
                f"{trainer.max_epochs}), 0-based) and are skipped"
                + ("; the last epoch is validated" if self.always_last else "")
            )
        self._user_check_val_every_n_epoch = trainer.check_val_every_n_epoch
        self._apply(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer)  # at on_train_start, current_epoch is restored from the checkpoint

    on_train_epoch_start = on_train_start

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: BaseException) -> None:
        if self._user_check_val_every_n_epoch is not None:
            trainer.check_val_every_n_epoch = self._user_check_val_every_n_epoch
            self._user_check_val_every_n_epoch = None

    on_exception = on_fit_end  # (trainer, pl_module, exception)
