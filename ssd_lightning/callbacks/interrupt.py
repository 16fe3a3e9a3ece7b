"""Preemption and Ctrl-C: finish the current step, write ``last.ckpt``, exit cleanly."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

__all__ = ["InterruptCheckpoint"]


class InterruptCheckpoint(pl.Callback):
    """Turns SIGTERM (cluster preemption, ``scancel``, ``docker stop``) and a first Ctrl-C into a checkpoint.

    Lightning itself notices SIGTERM, tells every DDP rank, and raises ``SIGTERMException`` at the end of the
    current training step. This callback

    * makes the first Ctrl-C (SIGINT) take the same path: the step finishes, nothing is cut mid-update;
      a second Ctrl-C aborts at once, without a checkpoint;
    * writes ``<dirpath>/<filename>`` when that exception arrives (atomically, through the Trainer's
      checkpoint IO), so ``ckpt_path=<dirpath>/last.ckpt`` resumes from exactly that step;
    * records :attr:`stopped_by` (``"SIGTERM"``/``"SIGINT"``) and :attr:`saved_path` for the caller, which
      exits with 143/130 as shells expect.

    Args:
        dirpath: where to write; defaults to the ModelCheckpoint's directory (else ``<root>/checkpoints``).
        filename: the file name; ``last.ckpt`` so that the usual resume command works.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str = "last.ckpt") -> None:
        self.dirpath = dirpath
        self.filename = filename
        self.stopped_by: str | None = None
        self.saved_path: Path | None = None
        self._rank = 0

    # -- Ctrl-C -------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not in on_fit_start: Lightning records the signal handlers after that hook and restores them in
        # its teardown, which also removes this one.
        self.stopped_by, self.saved_path = None, None
        self._rank = trainer.global_rank
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        if self.stopped_by is not None:  # second Ctrl-C: stop now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.stopped_by = "SIGINT"
        if self._rank > 0:
            # A terminal's Ctrl-C reaches every rank; rank 0 alone turns it into SIGTERM, which Lightning
            # (or torchrun) passes on, so every rank sees exactly one.
            return
        log.warning("Ctrl-C: stopping after this step and saving last.ckpt (press Ctrl-C again to abort now)")
        signal.raise_signal(signal.SIGTERM)  # Lightning's SIGTERM path: every rank stops at the same step

    # -- the checkpoint -----------------------------------------------------------------------------
    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath) / self.filename
        checkpoint = trainer.checkpoint_callback
        dirpath = getattr(checkpoint, "dirpath", None) or Path(trainer.default_root_dir) / "checkpoints"
        return Path(dirpath) / self.filename

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != "fit":
            return
        self.stopped_by = self.stopped_by or "SIGTERM"
        path = self.checkpoint_path(trainer)
        try:
            trainer.save_checkpoint(path, weights_only=False)  # every rank calls it: all stopped at this step
        except Exception as error:  # let Lightning finish its clean-up; the message says what was lost
            log.error(f"{self.stopped_by}: could not save {path}: {error}")
            return
        self.saved_path = path
        log.warning(
            f"{self.stopped_by}: stopped at epoch {trainer.current_epoch}, step {trainer.global_step}; "
            f"saved {path}. Resume with the same command plus ckpt_path={path}"
        )
