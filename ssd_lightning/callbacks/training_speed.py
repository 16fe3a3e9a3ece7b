"""Training speed of a real run, logged at the logging interval: ``train/images_per_second`` and
``train/data_wait_fraction``.

Images (all ranks) per second of the slowest rank's host time in training batches, and the largest rank's
share of it in the loader's ``__next__``; no device sync on ordinary steps (docs/internals.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch

from ssd_lightning import compat
from ssd_lightning.callbacks.throughput import _batch_size, gather_rows

__all__ = ["FETCH_ACTION", "IntervalSpeed", "TrainingSpeed", "interval_speed"]

FETCH_ACTION = compat.TRAIN_FETCH_ACTION  # Lightning's profiler action around the training loader's __next__


@dataclass(frozen=True)
class IntervalSpeed:
    """One closed logging interval, over all ranks: ``images_per_second * elapsed == images``."""

    step: int  # Lightning's logging step (the ``step`` column of metrics.csv)
    batches: int  # training batches in the interval, per rank
    images: float  # images in the interval, all ranks
    elapsed: float  # seconds, the longest over the ranks
    wait: float  # seconds in the loader's __next__, this rank
    images_per_second: float
    data_wait_fraction: float


def interval_speed(per_rank: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(images/s, data wait fraction)`` of one interval from each rank's ``(images, elapsed s, wait s)``."""
    if not per_rank or any(elapsed <= 0 for _, elapsed, _ in per_rank):
        raise ValueError(f"every rank needs a positive elapsed time, got {per_rank}")
    images = sum(n for n, _, _ in per_rank)
    elapsed = max(e for _, e, _ in per_rank)
    wait_fraction = max(min(w / e, 1.0) for _, e, w in per_rank)
    return images / elapsed, wait_fraction


class TrainingSpeed(pl.Callback):
    """Log both every logging interval, leaving out ``warmup_steps`` batches after every start of ``fit``;
    ``last_interval`` holds the latest :class:`IntervalSpeed` (every rank)."""

    def __init__(self, warmup_steps: int = 10, *, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = int(warmup_steps)
        self.clock = clock
        self.last_interval: IntervalSpeed | None = None
        self._profiler_patch: tuple[Any, dict[str, Any]] | None = None
        self._reset_run()

    def _reset_run(self) -> None:
        self._batches_seen = 0  # since this fit started: the warm-up counts these
        self._in_epoch = False
        self._last_logged_step = -1
        self._running_since: float | None = None  # start of the open time segment; None while paused
        self._fetch_started: float | None = None
        self._reset_interval()

    def _reset_interval(self) -> None:
        self._elapsed, self._batches, self._images, self._wait = 0.0, 0, 0, 0.0  # _elapsed: closed segments

    def _pause(self, now: float) -> None:
        if self._running_since is not None:
            self._elapsed += now - self._running_since
            self._running_since = None

    def _resume(self, now: float) -> None:
        if self._running_since is None:
            self._running_since = now

    # -- the loader's __next__, seen through Lightning's profiler (called through self: tests wrap them)
    def _fetch_start(self) -> None:
        measuring = self._batches_seen >= self.warmup_steps and self._running_since is not None
        self._fetch_started = self.clock() if measuring else None

    def _fetch_stop(self) -> None:
        if self._fetch_started is not None:
            self._wait += self.clock() - self._fetch_started
            self._fetch_started = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wrap ``trainer.profiler.start/stop`` (instance attributes) to time :data:`FETCH_ACTION`."""
        compat.train_fetch_action(trainer)  # still the action Lightning times the fetch with
        if self._profiler_patch is not None:
            return
        profiler = trainer.profiler
        saved = {name: vars(profiler)[name] for name in ("start", "stop") if name in vars(profiler)}
        start, stop = profiler.start, profiler.stop

        def timed_start(action_name: str) -> None:
            start(action_name)
            if action_name.endswith(FETCH_ACTION):
                self._fetch_start()

        def timed_stop(action_name: str) -> None:
            if action_name.endswith(FETCH_ACTION):
                self._fetch_stop()
            stop(action_name)

        profiler.start, profiler.stop = timed_start, timed_stop
        self._profiler_patch = (profiler, saved)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._profiler_patch is not None:  # the profiler as it was, also after an exception
            profiler, saved = self._profiler_patch
            for name in ("start", "stop"):
                vars(profiler).pop(name, None)
            vars(profiler).update(saved)
            self._profiler_patch = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_run()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_epoch = True
        self._resume(self.clock())

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause(self.clock())
        self._in_epoch = False

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_epoch:
            self._pause(self.clock())

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_epoch:
            self._resume(self.clock())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = self.clock()
        self._batches_seen += 1
        if self._batches_seen <= self.warmup_steps:
            if self._batches_seen == self.warmup_steps:  # the measured time starts after the warm-up
                self._reset_interval()
                self._running_since = now
            return
        self._batches += 1
        self._images += _batch_size(batch)
        step = compat.batches_that_stepped(trainer) + 1  # the 1-based count Lightning tests for logging
        n = trainer.log_every_n_steps
        if n > 0 and step % n == 0 and step != self._last_logged_step:
            self._last_logged_step = step
            self._pause(now)
            self._log(trainer, pl_module, step - 1)
            self._reset_interval()
            self._resume(now)  # intervals tile the measured time

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        per_rank = [(float(self._images), self._elapsed, self._wait)]
        if trainer.world_size > 1:  # one collective per logging interval, on every rank at the same step
            per_rank = gather_rows(trainer, per_rank[0], torch.float64, pl_module.device).tolist()
        if any(elapsed <= 0 for _, elapsed, _ in per_rank):
            return  # a clock that did not move (cannot happen with perf_counter): nothing to report
        rate, wait_fraction = interval_speed(per_rank)
        images, elapsed = sum(n for n, _, _ in per_rank), max(e for _, e, _ in per_rank)
        self.last_interval = IntervalSpeed(
            step, self._batches, images, elapsed, self._wait, rate, wait_fraction
        )
        for name, value in (("train/images_per_second", rate), ("train/data_wait_fraction", wait_fraction)):
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
