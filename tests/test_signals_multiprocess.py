"""Ctrl-C and SIGTERM with 2 DDP processes (CPU, gloo), sent as users and schedulers send them.

* torchrun: the signal goes to the agent, which forwards it to every worker (SIGINT for a terminal's Ctrl-C,
  SIGTERM for ``kill``/SLURM-style stops) and SIGKILLs them after ``--shutdown-timeout`` (30 s);
* Lightning's own launcher (``python train.py trainer=ddp_cpu``): ``kill <pid>`` reaches rank 0 alone, a
  terminal's Ctrl-C every process of the foreground process group.

Every rank must stop after the same step, ``last.ckpt`` must be written once and resuming from it must give
the run that was never interrupted (final weights). A tiny MobileNetV2 classifier on per-rank synthetic
batches keeps each run short; rank 0 pauses at a step until the signal arrives (tests.ddp_probes), so the
signal lands mid-training however loaded the machine is, and the tests wait for that marker, not a sleep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from ssd_lightning.callbacks.interrupt import INTERRUPTED_FILE
from tests.helpers import ProcessGroup, last_checkpoint, launch_train_py, metric_by_epoch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.no_dali]  # synthetic data

TIMEOUT_S = 300  # a hang, not a slow machine: a run takes 20-60 s on 2 loaded cores
STEPS_PER_EPOCH, EPOCHS, PAUSE_STEP = 20, 2, 6
TOTAL = STEPS_PER_EPOCH * EPOCHS

TRAIN = [
    "data=synthetic_cls",
    "model=mobilenetv2",
    "callbacks=classification",
    "data._target_=tests.ddp_probes.PerRankSyntheticClassification",  # the ranks see different batches
    "data.image_size=32",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    f"data.steps_per_epoch={STEPS_PER_EPOCH}",
    "model.net.num_classes=4",
    "model.net.dropout=0.0",  # no RNG in the step: a resumed run can be compared weight by weight
    "model.lr_scaling.rule=none",
    "model.optimizer.lr=0.05",
    "trainer=ddp_cpu",
    f"trainer.max_epochs={EPOCHS}",
    "+trainer.limit_val_batches=0",
    "eval_epochs=[]",
    "logger=csv",
    "seed=0",
    "+trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
TORCHRUN = ["--standalone", "--nproc-per-node", "2"]


def _start(launcher: str, run_dir: Path, *extra: str, env: dict | None = None) -> ProcessGroup:
    """``train.py`` with :data:`TRAIN` under torchrun or Lightning's launcher, in a process group of its own
    (as a terminal's foreground job: a hang can be killed whole)."""
    torchrun = TORCHRUN if launcher == "torchrun" else None
    return launch_train_py(*TRAIN, f"hydra.run.dir={run_dir}", *extra, torchrun=torchrun, env=env)


def _finish(run: ProcessGroup) -> str:
    """The run's output (stdout and stderr); a run still going after ``TIMEOUT_S`` fails the test."""
    return run.finish(timeout=TIMEOUT_S).stdout


@pytest.fixture(scope="module")
def straight_dir(tmp_path_factory) -> Path:
    """The uninterrupted run's directory."""
    run_dir = tmp_path_factory.mktemp("straight")
    with _start("torchrun", run_dir) as run:
        out = _finish(run)
    assert run.proc.returncode == 0, out[-4000:]
    return run_dir


@pytest.fixture(scope="module")
def straight(straight_dir) -> dict:
    """The uninterrupted run's final checkpoint."""
    return last_checkpoint(straight_dir)


EPOCH_MEANS = ("train/loss_epoch", "train/acc1_epoch")


def _assert_same_epoch_means(straight_dir: Path, *parts: Path) -> None:
    """The epoch means (over both ranks' batches) of the run in ``parts`` (interrupted, then resumed) are
    the uninterrupted run's: the mid-epoch checkpoint carried the running sums of both ranks."""
    for key in EPOCH_MEANS:
        expected = metric_by_epoch(straight_dir, key)
        got = {}
        for part in parts:  # a run stopped early in its first epoch may have written no CSV yet
            if (part / "csv" / "metrics.csv").is_file():
                got.update(metric_by_epoch(part, key))
        assert sorted(got) == sorted(expected) == list(range(EPOCHS)), key
        for epoch, value in expected.items():
            assert got[epoch] == pytest.approx(value, rel=1e-5), (key, epoch)


def _interrupt(
    launcher: str, signum: signal.Signals, run_dir: Path, *, to_group: bool = False, env: dict | None = None
):
    """Start a run, wait until rank 0 pauses mid-training, send ``signum``: (exit code, output, seconds)."""
    marks = run_dir / "marks"
    with _start(
        launcher,
        run_dir,
        "+callbacks.pause._target_=tests.ddp_probes.PauseForSignal",
        f"+callbacks.pause.directory={marks}",
        f"+callbacks.pause.step={PAUSE_STEP}",
        env=env,
    ) as run:
        run.wait_for(marks / "paused", timeout=TIMEOUT_S)  # rank 0 holds at PAUSE_STEP
        sent = time.monotonic()
        run.signal(signum, to_group=to_group)
        out = _finish(run)
        elapsed = time.monotonic() - sent
        left = run.leftovers(within_s=20)
    assert left == [], left  # no rank left behind
    return run.proc.returncode, out, elapsed


def _stopped_steps(out: str, name: str) -> dict[int, int]:
    """``{rank: global step}`` from the ``[rank r] SIGxxx: stopped at epoch E, step S; saved ...`` lines."""
    return {
        int(r): int(s)
        for r, s in re.findall(rf"\[rank (\d)\] {name}: stopped at epoch \d+, step (\d+); saved", out)
    }


def _check_stop_and_resume(
    run_dir: Path, out: str, name: str, straight: dict, straight_dir: Path, resume_with: str
) -> int:
    steps = _stopped_steps(out, name)
    assert sorted(steps) == [0, 1], out[-4000:]  # every rank saved ...
    assert steps[0] == steps[1], steps  # ... after the same step
    saved = last_checkpoint(run_dir)
    assert saved["global_step"] == steps[0]
    assert PAUSE_STEP < saved["global_step"] < TOTAL
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []  # no temporary file of an interrupted write

    resumed = run_dir.parent / f"{run_dir.name}_resumed"
    with _start(resume_with, resumed, f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}") as run:
        resumed_out = _finish(run)
    assert run.proc.returncode == 0, resumed_out[-4000:]
    final = last_checkpoint(resumed)
    assert final["global_step"] == straight["global_step"] == TOTAL
    for key, value in straight["state_dict"].items():
        torch.testing.assert_close(final["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    _assert_same_epoch_means(straight_dir, run_dir, resumed)
    return saved["global_step"]


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_torchrun_signal_saves_on_every_rank_and_resumes(signum, straight, straight_dir, tmp_path):
    name = signum.name
    run_dir = tmp_path / "killed"
    code, out, elapsed = _interrupt("torchrun", signum, run_dir)
    # torchrun itself ends with a SignalException traceback and status 1, whatever its workers did; they
    # saved and exited within the agent's grace period (no SIGKILL)
    assert code == 1 and f"got signal: {int(signum)}" in out, out[-4000:]
    assert "forcefully exiting" not in out and "Unable to shutdown" not in out, out[-4000:]
    assert out.count("Traceback") == 1, out[-6000:]  # the agent's only
    step = _check_stop_and_resume(run_dir, out, name, straight, straight_dir, resume_with="torchrun")
    print(f"torchrun {name}: saved at step {step}; torchrun exited {elapsed:.1f} s after the signal")


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize(
    ("signum", "to_group", "code"),
    [(signal.SIGTERM, False, 143), (signal.SIGINT, True, 130)],
    ids=["sigterm_to_rank0", "ctrl_c_to_group"],
)
def test_lightning_launcher_signal_saves_on_every_rank(
    signum, to_group, code, straight, straight_dir, tmp_path
):
    name = signum.name
    run_dir = tmp_path / "killed"
    got, out, elapsed = _interrupt("lightning", signum, run_dir, to_group=to_group)
    assert got == code, out[-4000:]
    assert "Traceback" not in out, out[-6000:]
    step = _check_stop_and_resume(run_dir, out, name, straight, straight_dir, resume_with="lightning")
    print(f"Lightning launcher {name}: saved at step {step}; exit {got} {elapsed:.1f} s after the signal")


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGUSR2], ids=["sigusr1", "sigusr2"])
def test_time_limit_signal_to_every_rank_saves_and_the_restarted_job_continues(
    signum, straight, straight_dir, tmp_path
):
    """SLURM's time-limit signals, sent to every task as SLURM does (here: the process group of Lightning's
    launcher): every rank stops after the same step and saves; the same job started again (same scheduler
    job id, as after a requeue, same run directory) continues from last.ckpt by itself."""
    name = signum.name
    run_dir = tmp_path / "job"
    job = {"SUBMITIT_LOCAL_JOB_ID": f"{os.getpid()}{int(signum)}"}  # what a requeue keeps
    code, out, _ = _interrupt("lightning", signum, run_dir, to_group=True, env=job)
    assert code == 128 + int(signum), out[-4000:]  # no scheduler handler here to requeue: 138 / 140
    assert "Traceback" not in out, out[-6000:]
    steps = _stopped_steps(out, name)
    assert sorted(steps) == [0, 1] and steps[0] == steps[1], out[-4000:]
    saved = last_checkpoint(run_dir)
    assert saved["global_step"] == steps[0] and PAUSE_STEP < steps[0] < TOTAL
    record = json.loads((run_dir / "checkpoints" / INTERRUPTED_FILE).read_text())
    assert (record["signal"], record["step"], record["job_id"]) == (
        name,
        steps[0],
        "local_" + job["SUBMITIT_LOCAL_JOB_ID"],
    )

    # the same command again, as the requeued job runs it: it continues in place, not from epoch 0
    with _start("lightning", run_dir, env=job) as run:
        again = _finish(run)
    assert run.proc.returncode == 0, again[-4000:]
    # a stop after the epoch's last step (step 20 under load) counts as the end of epoch 0 or the start of 1
    assert record["epoch"] in {(steps[0] - 1) // STEPS_PER_EPOCH, steps[0] // STEPS_PER_EPOCH}, record
    stopped = f"(stopped by {name} at epoch {record['epoch']}, step {steps[0]})"
    assert f"continuing {run_dir} from checkpoints/last.ckpt {stopped}" in again, again[-4000:]
    final = last_checkpoint(run_dir)
    assert final["global_step"] == straight["global_step"] == TOTAL
    for key, value in straight["state_dict"].items():
        torch.testing.assert_close(final["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    _assert_same_epoch_means(straight_dir, run_dir)  # one CSV, continued
    assert not (run_dir / "checkpoints" / INTERRUPTED_FILE).exists()
