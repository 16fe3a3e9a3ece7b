"""What the callbacks that write files after evaluations share: their folder, their cadence, warnings once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn

__all__ = ["EvaluationArtifacts", "from_datamodule"]


def from_datamodule(trainer: pl.Trainer, value: Any, attribute: str) -> Any:
    """``value`` if given, else ``trainer.datamodule.<attribute>`` (``None`` when neither is there)."""
    return value if value is not None else getattr(trainer.datamodule, attribute, None)


class EvaluationArtifacts(pl.Callback):
    """Base of the callbacks that write files (to ``output_dir``, default ``trainer.default_root_dir``) after
    every ``every_n_evals``-th evaluation of ``fit`` (>= 1, else ValueError)."""

    def __init__(self, *, output_dir: str | os.PathLike | None = None, every_n_evals: int = 1) -> None:
        super().__init__()
        if every_n_evals < 1:
            raise ValueError(f"every_n_evals must be >= 1, got {every_n_evals}")
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.every_n_evals = every_n_evals
        self._evals = 0  # evaluations of fit finished
        self._warned: set[str] = set()

    def _out_dir(self, trainer: pl.Trainer) -> Path:
        return self.output_dir if self.output_dir is not None else Path(trainer.default_root_dir)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"{type(self).__name__}: {message}")

    def _is_due(self, trainer: pl.Trainer) -> bool:
        """Whether to write after the evaluation now running: outside ``fit`` always; in ``fit`` every
        ``every_n_evals``-th, the last epoch's and one that ends the run (``trainer.should_stop``)."""
        if trainer.state.fn != "fit":
            return True
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch >= trainer.max_epochs - 1
        return last_epoch or trainer.should_stop or (self._evals + 1) % self.every_n_evals == 0

    def _count_evaluation(self, trainer: pl.Trainer) -> bool:
        """Count an evaluation that ended (of ``fit`` only); returns whether it was due (sanity check: no)."""
        if trainer.sanity_checking:
            return False
        due = self._is_due(trainer)
        self._evals += int(trainer.state.fn == "fit")
        return due
