"""Preemption, time limits and Ctrl-C: finish the current step, write ``last.ckpt`` (on every DDP rank), then
exit cleanly or let the scheduler requeue the job, which continues from it."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.plugins.environments import SLURMEnvironment
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ssd_lightning import compat
from ssd_lightning.io.atomic import atomic_write_text

log = logging.getLogger(__name__)

__all__ = ["INTERRUPTED_FILE", "InterruptCheckpoint", "read_interruption", "scheduler_job_id"]

# what the ranks reduce, by position; the last one present wins (a requeue signal over a plain stop)
_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2")
# SLURM's time-limit/preemption signals: submitit's (USR2) and Lightning's auto-requeue (USR1)
_REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
INTERRUPTED_FILE = "interrupted.json"


def scheduler_job_id() -> str | None:
    """The job id a scheduler keeps across a requeue (submitit_local's, SLURM's (array) job's), else None."""
    if os.environ.get("SUBMITIT_LOCAL_JOB_ID"):
        return f"local_{os.environ['SUBMITIT_LOCAL_JOB_ID']}"
    return _slurm_job_id()


def _slurm_job_id() -> str | None:
    """``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID`` (what ``scontrol requeue`` takes)."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def read_interruption(checkpoint_dir: str | Path) -> dict | None:
    """What :class:`InterruptCheckpoint` recorded in ``<checkpoint_dir>/interrupted.json``, or None."""
    path = Path(checkpoint_dir) / INTERRUPTED_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        log.warning(f"{path} is unreadable ({error}); not continuing from it")
        return None


def _distributed(trainer: pl.Trainer) -> bool:  # only then do the ranks agree through a collective
    return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()


def _wait_for(children: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error(f"rank process {child.pid} still runs {timeout:.0f} s after the interrupt; killing it")
            child.kill()


class InterruptCheckpoint(pl.Callback):
    """Turn SIGTERM, SIGUSR1/SIGUSR2 and a first Ctrl-C into ``<dirpath>/<filename>`` (default: the
    ModelCheckpoint's ``last.ckpt``) written at the same step on every DDP rank; the caller then exits 143
    (SIGTERM), 130 (Ctrl-C) or hands over to the scheduler's requeue.

    Handlers only set a flag; the ranks agree by one all-reduce every ``check_every_n_steps`` optimizer steps
    or (None) about every ``check_every_seconds``; then every rank saves after that step and rank 0 writes
    ``interrupted.json`` for a requeued job. A second Ctrl-C aborts without a checkpoint.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "last.ckpt",
        check_every_n_steps: int | None = None,
        check_every_seconds: float = 1.0,
    ) -> None:
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1 or None, got {check_every_n_steps}")
        if not check_every_seconds > 0:
            raise ValueError(f"check_every_seconds must be > 0, got {check_every_seconds}")
        self.dirpath, self.filename = dirpath, filename
        self.check_every_n_steps = check_every_n_steps
        self.check_every_seconds = float(check_every_seconds)
        self.stopped_by: str | None = None  # what stopped the run on this rank: "SIGTERM" / "SIGINT" / ...
        self.saved_path: Path | None = None
        self._received: str | None = None  # the first signal this process received
        self._agreed: str | None = None  # the signal all ranks stopped for (a requeue signal wins)
        self._before: dict[int, object] = {}  # SIGUSR1/SIGUSR2 handlers from before training (submitit's)
        self._slurm_requeue = False  # Lightning would requeue on SIGUSR1 (SLURM, auto_requeue)
        self.children_exit_timeout = 60.0  # s that rank 0 of Lightning's launcher waits for the others
        self._rank = 0
        self._trainer: pl.Trainer | None = None  # during fit, for the handlers
        self._reset_schedule(0)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stopped_by, self.saved_path, self._received, self._agreed = None, None, None, None
        self._trainer, self._rank = trainer, trainer.global_rank
        # before Lightning registers its handlers (after this hook): submitit's, if any, for hand_over()
        self._before = {int(s): signal.getsignal(s) for s in _REQUEUE_SIGNALS}
        env = getattr(trainer.strategy, "cluster_environment", None)
        if env is None and SLURMEnvironment.detect():
            env = SLURMEnvironment()
        self._slurm_requeue = (
            isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None
        )
        # Lightning's SIGTERM and SLURM SIGUSR1 handlers run a collective or save from inside the handler;
        # ours only take note (SIGUSR1/SIGUSR2 until on_train_start installs ours for good)
        compat.replace_signal_handlers(trainer, sigterm=self._on_signal, slurm_requeue=self._on_signal)
        compat.skip_per_step_sigterm_broadcast(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here: Lightning records the handlers when it registers its own (after on_fit_start) and restores
        # them in its teardown, removing ours too. Ours replace its SLURM handler and submitit's
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, *_REQUEUE_SIGNALS):
                signal.signal(signum, self._on_signal)
        self._reset_schedule(trainer.global_step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a later trainer.validate()/test() gets Lightning's own behaviour back
            compat.restore_signal_handling(trainer)
            self._trainer = None

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self._received == "SIGINT":  # second Ctrl-C: stop now, no checkpoint
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        if self._received is not None:
            return
        self._received = name
        if self._rank == 0:
            why = " (the scheduler's time-limit/requeue signal)" if name in ("SIGUSR1", "SIGUSR2") else ""
            what, why = ("Ctrl-C", " (press Ctrl-C again to abort now)") if name == "SIGINT" else (name, why)
            log.warning(f"{what}: stopping after this step and saving {self.filename}{why}")
        trainer = self._trainer
        # one process: nothing to agree on; the step in flight is the last one (Lightning's own path)
        if trainer is not None and not (
            _distributed(trainer) or trainer.validating or trainer.sanity_checking
        ):
            self._stop(trainer, name)

    def _stop(self, trainer: pl.Trainer, agreed: str) -> None:
        self.stopped_by = self._received or agreed
        self._agreed = agreed
        # Lightning's own path: SIGTERMException after this step (and its validation) on every rank
        compat.set_sigterm_received(trainer, True)

    def _reset_schedule(self, global_step: int) -> None:
        self._last_step = global_step
        self._next_check = global_step + (self.check_every_n_steps or 1)
        self._last_check_time: float | None = None
        self._last_check_step = global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # gradient accumulation: no optimizer step yet, keep the batch together
            return
        self._last_step = step
        if self.stopped_by is not None:
            return
        if not _distributed(trainer):
            agreed = self._received
        elif step >= self._next_check:
            agreed = self._agree(trainer, step)
        else:
            return
        if agreed is not None:
            self._stop(trainer, agreed)

    def _agree(self, trainer: pl.Trainer, step: int) -> str | None:
        """All-reduce (MAX) of [SIGINT, SIGTERM, SIGUSR1, SIGUSR2 received, seconds per step]."""
        now = time.monotonic()
        per_step = 0.0
        if self._last_check_time is not None:
            per_step = (now - self._last_check_time) / max(1, step - self._last_check_step)
        flags = [0.0] * len(_SIGNALS) + [per_step]
        if self._received is not None:
            flags[_SIGNALS.index(self._received)] = 1.0
        # The collective's device (CUDA under NCCL) and one read back: a single sync per check interval.
        tensor = torch.tensor(flags, dtype=torch.float32, device=trainer.strategy.root_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        *received, slowest = tensor.tolist()
        self._last_check_time, self._last_check_step = now, step
        if self.check_every_n_steps is not None:
            interval = self.check_every_n_steps
        elif slowest > 0:  # the same on every rank: computed from reduced values only
            interval = max(1, min(1000, math.floor(self.check_every_seconds / slowest)))
        else:
            interval = 1  # no timing yet (first check)
        self._next_check = step + interval
        return next((name for name, got in zip(_SIGNALS[::-1], received[::-1], strict=True) if got), None)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The evaluation loop raises after any batch when Lightning's flag is up; let validation finish.
        if self.stopped_by is not None and trainer.state.fn == "fit":
            compat.set_sigterm_received(trainer, False)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit":
            return
        if self.stopped_by is not None:
            compat.set_sigterm_received(trainer, True)
        elif self._received is not None and not _distributed(trainer):  # arrived during validation
            self._stop(trainer, self._received)

    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath) / self.filename
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        return Path(dirpath or Path(trainer.default_root_dir) / "checkpoints") / self.filename

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != "fit":
            return
        self.stopped_by = self.stopped_by or self._received or "SIGTERM"
        children = compat.take_launched_processes(trainer)
        path = self.checkpoint_path(trainer)
        started = time.monotonic()
        try:
            trainer.save_checkpoint(path, weights_only=False)  # every rank calls it: all stopped at this step
        except Exception as error:  # let Lightning finish its clean-up; the message says what was lost
            log.error(f"{self.stopped_by}: could not save {path}: {error}")
            return
        finally:
            _wait_for(children, timeout=self.children_exit_timeout)
        self.saved_path = path
        prefix = f"[rank {trainer.global_rank}] " if trainer.world_size > 1 else ""
        epoch, step = trainer.current_epoch, trainer.global_step
        if trainer.is_global_zero:  # what a requeued job checks before continuing
            record = {"signal": self.stopped_by, "epoch": epoch, "step": step, "checkpoint": path.name}
            file = path.parent / INTERRUPTED_FILE
            try:
                atomic_write_text(file, json.dumps({**record, "job_id": scheduler_job_id()}, indent=1) + "\n")
            except OSError as error:
                log.error(f"could not write {file}: {error}")
        run = Path(path).parent.parent  # <run>/checkpoints/last.ckpt
        how = f"resume={run} (or ckpt_path={path})" if (run / ".hydra").is_dir() else f"ckpt_path={path}"
        log.warning(
            f"{prefix}{self.stopped_by}: stopped at epoch {epoch}, step {step}; "
            f"saved {path} in {time.monotonic() - started:.1f} s. Resume with the same command plus {how}"
            + (" (a requeued job continues from it by itself)" if self._requeuer() else "")
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # training finished: nothing left for a requeued job of this run to continue
        if trainer.is_global_zero:
            (self.checkpoint_path(trainer).parent / INTERRUPTED_FILE).unlink(missing_ok=True)

    def _requeuer(self):
        """What requeues the job after a SIGUSR1/SIGUSR2 stop: submitit's handler, "scontrol" or None."""
        if self._agreed not in ("SIGUSR1", "SIGUSR2"):
            return None
        before = self._before.get(int(signal.Signals[self._agreed]))
        if callable(before):
            return before
        return "scontrol" if self._slurm_requeue and self._agreed == "SIGUSR1" else None

    def hand_over(self) -> None:
        """After a SIGUSR1/SIGUSR2 stop and its save: requeue the job as the signal's own handler would."""
        requeuer = self._requeuer()
        if requeuer is None or self.saved_path is None:
            return
        signum = signal.Signals[self._agreed]
        if requeuer != "scontrol":
            log.info(f"{signum.name}: {self.filename} saved; the scheduler's handler requeues the job now")
            requeuer(int(signum), None)
            return
        if self._rank != 0:
            return
        # what Lightning's SLURM auto-requeue handler does after its own save
        if not (job_id := _slurm_job_id()):
            log.error("SIGUSR1: no SLURM_JOB_ID, the job is not requeued")
            return
        try:
            result = subprocess.run(["scontrol", "requeue", job_id], timeout=60, check=False).returncode
        except (OSError, subprocess.TimeoutExpired) as error:
            result = error
        if result == 0:
            log.info(f"requeued SLURM job {job_id}; it continues from the checkpoint")
        else:
            log.error(f"scontrol requeue {job_id} failed ({result}); resume the run by hand")
