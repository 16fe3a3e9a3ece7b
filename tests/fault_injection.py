"""Callbacks that inject faults at a chosen training step, for the reliability tests.

Added to a run from the command line like any callback, e.g.
``+callbacks.fault._target_=tests.fault_injection.SignalAtStep +callbacks.fault.step=3``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytorch_lightning as pl
import torch


class SignalAtStep(pl.Callback):
    """Sends ``signum`` to this process after global step ``step`` (on ``rank``), like a scheduler would."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM), rank: int = 0) -> None:
        self.step, self.signum, self.rank = step, signum, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


class TouchEachStep(pl.Callback):
    """Writes ``<directory>/step_<global_step>`` after every step, so another process can wait for one."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / f"step_{trainer.global_step}").touch()


class NaNImagesAt(pl.Callback):
    """Turns the images of the batches at these 0-based global batch indices into NaN (a corrupt batch)."""

    def __init__(self, batches: list[int]) -> None:
        self.batches = set(batches)
        self._original = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.fit_loop.total_batch_idx in self.batches:
            # replace, don't fill: data modules may hand out the same tensors again
            self._original = batch["images"]
            batch["images"] = torch.full_like(batch["images"], float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._original is not None:
            batch["images"], self._original = self._original, None


class RecordBatches(pl.Callback):
    """Appends ``{"step": global_step, "checksum": sum of the batch's images}`` lines to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        checksum = float(batch["images"].double().sum()) if torch.is_tensor(batch["images"]) else None
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "checksum": checksum}) + "\n")
