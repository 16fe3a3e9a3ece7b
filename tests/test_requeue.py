"""A job that hits its time limit keeps its progress: SIGUSR2 (submitit's time-limit signal) stops a sweep job
after the step in flight, ``last.ckpt`` is written, submitit requeues the job and the requeued job continues
from that checkpoint in its own directory (not from epoch 0).

The real ``python train.py -m`` with ``hydra/launcher=submitit_local`` (one task), on the synthetic SSD300
setup of tests/test_interrupt.py; the job signals itself at a chosen step (tests.fault_injection), as the
scheduler would. The multi-process variant (SIGUSR1/SIGUSR2 to every rank) is in
tests/test_signals_multiprocess.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ssd_lightning.callbacks.interrupt import INTERRUPTED_FILE, InterruptCheckpoint, scheduler_job_id
from ssd_lightning.cli.run_dir import requeued_run
from tests.helpers import csv_rows, last_checkpoint, metric_by_epoch, metric_by_step, run_train_py
from tests.test_interrupt import COMMON, STEPS_PER_EPOCH, TOTAL, _signal_at, straight  # noqa: F401 (fixture)

# synthetic batches only: nothing here depends on the DALI line
pytestmark = pytest.mark.no_dali

SIGNAL_STEP = STEPS_PER_EPOCH + 1  # in the middle of the last epoch


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_sigusr2_in_a_submitit_job_saves_and_the_requeued_job_continues(straight, tmp_path):  # noqa: F811
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[sweeps]'")
    # started from another directory, with Hydra's default sweep dir (multirun/<date>/<time> under it)
    result = run_train_py(
        "-m",
        *COMMON,
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        *_signal_at(SIGNAL_STEP, signal.SIGUSR2),
        cwd=tmp_path,
        timeout=540,
        full_error=True,
    )
    sweeps = list(tmp_path.glob("multirun/*/*"))
    assert len(sweeps) == 1, (sweeps, result.stderr[-3000:])
    sweep_dir = sweeps[0]
    assert (sweep_dir / "summary.csv").is_file(), result.stderr[-3000:]
    job = sweep_dir / "0"
    logs = "\n".join(p.read_text() for p in sorted((sweep_dir / ".submitit").rglob("*_log.*")))
    assert result.returncode == 0, result.stderr[-3000:] + logs[-3000:]

    # the first start stopped after the signalled step and saved it; submitit requeued the job ...
    assert f"SIGUSR2: stopped at epoch 1, step {SIGNAL_STEP}; saved" in logs, logs[-3000:]
    assert "Requeued job" in logs and logs.count("Starting with JobEnvironment") == 2, logs[-3000:]
    # ... whose second start continued from that checkpoint, in the same directory
    run_log = (job / "train.log").read_text()
    assert (
        f"continuing {job} from checkpoints/last.ckpt (stopped by SIGUSR2 at epoch 1, step {SIGNAL_STEP})"
        in (run_log)
    )
    assert not (job / "checkpoints" / INTERRUPTED_FILE).exists()  # finished: nothing left to continue

    # every optimizer step ran once (none repeated from epoch 0), with the uninterrupted run's losses
    rows = csv_rows(job / "csv" / "metrics.csv")
    logged_steps = [int(row["step"]) for row in rows if row.get("train/loss_step")]
    assert logged_steps == list(range(TOTAL))
    final, expected = last_checkpoint(job), last_checkpoint(straight)
    assert final["global_step"] == expected["global_step"] == TOTAL
    expected_loss = metric_by_step(straight, "train/loss_step")
    got_loss = metric_by_step(job, "train/loss_step")
    for step in range(TOTAL):
        assert got_loss[step] == pytest.approx(expected_loss[step], rel=1e-5, abs=1e-6), step
    expected_mean = metric_by_epoch(straight, "train/loss_epoch")
    got_mean = metric_by_epoch(job, "train/loss_epoch")
    assert sorted(got_mean) == sorted(expected_mean) == [0, 1]
    for epoch, value in expected_mean.items():
        assert got_mean[epoch] == pytest.approx(value, rel=1e-5), epoch
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(final["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # the sweep's summary has the job once, completed
    summary = json.loads((job / ".hydra" / "job_summary.json").read_text())
    assert summary["status"] == "COMPLETED"


# ------------------------------------------------------------------ what identifies a requeue (no training)
def _interrupted_run(run: Path, job_id: str | None) -> None:
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("task: fit\n")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    record = {"signal": "SIGUSR2", "epoch": 1, "step": 4, "checkpoint": "last.ckpt", "job_id": job_id}
    (run / "checkpoints" / INTERRUPTED_FILE).write_text(json.dumps(record))


def _cfg(run: Path, **keys):
    return OmegaConf.create(
        {
            "task": "fit",
            "resume": None,
            "run_dir": None,
            "ckpt_path": None,
            "paths": {"output_dir": str(run)},
            **keys,
        }
    )


@pytest.fixture
def no_scheduler(monkeypatch):
    for var in ("SUBMITIT_LOCAL_JOB_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_the_same_scheduler_job_in_the_same_directory_continues(no_scheduler, tmp_path):
    _interrupted_run(tmp_path / "run", "77_3")
    no_scheduler.setenv("SLURM_JOB_ID", "80")  # an array task: its own id is array job + task
    no_scheduler.setenv("SLURM_ARRAY_JOB_ID", "77")
    no_scheduler.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert scheduler_job_id() == "77_3"
    assert requeued_run(_cfg(tmp_path / "run")) == tmp_path / "run"


@pytest.mark.parametrize(
    ("env", "keys"),
    [
        ({}, {}),  # no scheduler: a plain run never continues by itself (resume= does that)
        ({"SLURM_JOB_ID": "78"}, {}),  # another job (a new submission) in the same directory
        ({"SLURM_JOB_ID": "77_3"}, {"ckpt_path": "/elsewhere/last.ckpt"}),  # what the command line says wins
        ({"SLURM_JOB_ID": "77_3"}, {"task": "validate"}),
    ],
    ids=["no_scheduler", "other_job", "explicit_ckpt_path", "not_fit"],
)
def test_anything_else_starts_fresh(no_scheduler, tmp_path, env, keys):
    _interrupted_run(tmp_path / "run", "77_3")
    for var, value in env.items():
        no_scheduler.setenv(var, value)
    assert requeued_run(_cfg(tmp_path / "run", **keys)) is None


def test_a_finished_or_never_interrupted_run_starts_fresh(no_scheduler, tmp_path):
    no_scheduler.setenv("SUBMITIT_LOCAL_JOB_ID", "123")
    assert requeued_run(_cfg(tmp_path / "empty")) is None
    _interrupted_run(tmp_path / "run", "local_123")
    (tmp_path / "run" / "checkpoints" / "last.ckpt").unlink()
    assert requeued_run(_cfg(tmp_path / "run")) is None


def test_sigusr1_under_slurm_requeues_with_scontrol(no_scheduler, tmp_path):
    """Lightning's SLURM auto-requeue (SIGUSR1) without submitit: after the save rank 0 runs
    ``scontrol requeue <job>`` itself (Lightning's handler, which would save again, is replaced)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "called"}\n')
    scontrol.chmod(0o755)
    no_scheduler.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    no_scheduler.setenv("SLURM_JOB_ID", "4242")
    callback = InterruptCheckpoint()
    # the state after a SIGUSR1 stop and save under SLURM with auto_requeue, no handler from before
    callback._agreed, callback._slurm_requeue = "SIGUSR1", True
    callback._before = {int(signal.SIGUSR1): signal.SIG_DFL, int(signal.SIGUSR2): signal.SIG_DFL}
    callback.saved_path = tmp_path / "last.ckpt"
    callback.hand_over()
    assert (tmp_path / "called").read_text().split() == ["requeue", "4242"]
