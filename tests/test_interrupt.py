"""SIGTERM (preemption) and Ctrl-C: the step finishes, last.ckpt is written, the run exits 143/130 cleanly,
and resuming from that checkpoint gives the run that was never interrupted.

Synthetic SSD300 batches, resumable mid-epoch, with the schedule of tests/test_resume.py (momentum, a warm-up
still running, an epoch milestone), 3 steps per epoch and the kill at steps drawn at random (seeded).
"""

from __future__ import annotations

import random
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    TRAIN_PY,
    ProcessGroup,
    last_checkpoint,
    metric_by_epoch,
    metric_by_step,
    run_train_py,
)
from tests.test_resume import COMMON as RESUME_COMMON
from tests.test_resume import _run as run_with_resume_settings

# synthetic batches only: nothing here depends on the DALI line
pytestmark = pytest.mark.no_dali


STEPS_PER_EPOCH = 3
TOTAL = 2 * STEPS_PER_EPOCH
COMMON = [o for o in RESUME_COMMON if not o.startswith("data.steps_per_epoch=")]
COMMON.append(f"data.steps_per_epoch={STEPS_PER_EPOCH}")
KILL_STEPS = sorted(random.Random(2026).sample(range(1, TOTAL), 2))


def _run(out_dir: Path, *extra: str) -> dict[str, float]:
    return run_with_resume_settings(out_dir, *extra, common=COMMON)


def _signal_at(step: int, signum: signal.Signals) -> list[str]:
    return [
        "+callbacks.fault._target_=tests.fault_injection.SignalAtStep",
        f"+callbacks.fault.step={step}",
        f"+callbacks.fault.signum={int(signum)}",
    ]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight")
    _run(out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill_step", KILL_STEPS)
def test_sigterm_saves_the_step_and_resuming_gives_the_uninterrupted_run(kill_step, straight, tmp_path):
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    with pytest.raises(SystemExit) as info:
        _run(killed, *_signal_at(kill_step, signal.SIGTERM))
    assert info.value.code == 143
    saved = last_checkpoint(killed)
    assert saved["global_step"] == kill_step  # the step in flight finished; nothing after it ran

    _run(resumed, f"ckpt_path={killed / 'checkpoints' / 'last.ckpt'}")
    expected_loss = metric_by_step(straight, "train/loss_step")
    got_loss = {**metric_by_step(killed, "train/loss_step"), **metric_by_step(resumed, "train/loss_step")}
    assert sorted(got_loss) == list(range(TOTAL))
    for step in range(TOTAL):  # same batches, same LR, same optimizer state at every step
        assert got_loss[step] == pytest.approx(expected_loss[step], rel=1e-5, abs=1e-6), step
    # the epoch's running mean went into last.ckpt: the resumed epoch averages all its batches, not only
    # those after the resume
    expected_mean = metric_by_epoch(straight, "train/loss_epoch")
    got_mean = {**metric_by_epoch(killed, "train/loss_epoch"), **metric_by_epoch(resumed, "train/loss_epoch")}
    assert sorted(got_mean) == sorted(expected_mean) == [0, 1]
    for epoch, value in expected_mean.items():
        assert got_mean[epoch] == pytest.approx(value, rel=1e-5), epoch
    a, b = last_checkpoint(straight), last_checkpoint(resumed)
    assert a["global_step"] == b["global_step"] == TOTAL
    for key, value in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_first_ctrl_c_saves_and_exits_130(tmp_path):
    # Python's default_int_handler, or SIG_IGN where the shell started this process in the background
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as info:
        _run(tmp_path, *_signal_at(2, signal.SIGINT))
    assert info.value.code == 130
    assert last_checkpoint(tmp_path)["global_step"] == 2
    # the handler is gone after the run: Ctrl-C is handled as before it
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_sigterm_from_outside(tmp_path):
    """`kill <pid>` on `python train.py`: one message, exit 143, a last.ckpt to resume from."""
    marks = tmp_path / "marks"
    argv = [
        sys.executable,
        TRAIN_PY,
        *COMMON,
        "data.steps_per_epoch=1000",
        f"paths.output_dir={tmp_path / 'run'}",
        "+callbacks.marks._target_=tests.fault_injection.TouchEachStep",
        f"+callbacks.marks.directory={marks}",
    ]
    with ProcessGroup(argv, merge_stderr=False) as run:
        run.wait_for(marks / "step_2", timeout=240)
        # the folder has one owner: a second train.py there (a resume, a requeue) refuses, naming it
        second = run_train_py(f"resume={tmp_path / 'run'}", timeout=240)
        run.signal(signal.SIGTERM)
        result = run.finish(timeout=120)
    assert second.returncode == 1, second.stderr[-3000:]
    assert f"is in use by pid {run.proc.pid} on host {socket.gethostname()}" in second.stderr
    assert second.stderr.count("Error: ") == 1 and "Traceback" not in second.stderr
    stdout, stderr = result.stdout, result.stderr
    assert result.returncode == 143, stderr
    assert "Traceback" not in stderr
    assert "SIGTERM: stopped at epoch 0" in stdout and "ckpt_path=" in stdout  # Hydra logs to stdout
    saved = last_checkpoint(tmp_path / "run")
    assert 2 <= saved["global_step"] < 1000
