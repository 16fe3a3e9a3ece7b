"""Resuming `fit` from `last.ckpt` is the same run: 2 epochs straight == 1 epoch + resume 1 epoch.

Both runs go through `train(cfg)` (the configs' ModelCheckpoint, `ckpt_path=`, the CSV logger) on synthetic
SSD300 batches (no DALI) with a small ResNet-18 SSD300. The schedule is chosen so that resuming has
something to get wrong: SGD with momentum (optimizer state), a warm-up of 3 iterations that is still running
when the job stops after 2 (scheduler position), and an epoch milestone at epoch 1 (epoch counter).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssd_lightning.cli.train import train
from tests.helpers import SYNTHETIC_SSD_RUN, last_checkpoint, metric_by_step, train_config

# synthetic batches only: nothing here depends on the DALI line
pytestmark = pytest.mark.no_dali


STEPS_PER_EPOCH = 2
BASE_LR = 0.02
WARMUP = 3

COMMON = [
    *SYNTHETIC_SSD_RUN,
    "data.eval_batch_size=2",
    f"data.steps_per_epoch={STEPS_PER_EPOCH}",
    "model.net.num_classes=5",
    f"model.optimizer.lr={BASE_LR}",
    "model.lr_scaling.rule=none",
    f"model.scheduler.warmup_steps={WARMUP}",
    "model.scheduler.milestones=[1]",
    "trainer.max_epochs=2",
    "trainer.log_every_n_steps=1",
    "seed=0",
]


def _run(out_dir: Path, *extra: str, common: list[str] = COMMON) -> dict[str, float]:
    """``train()`` on ``common`` + ``extra`` overrides, writing into ``out_dir``."""
    return train(train_config([*common, *extra], output_dir=out_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    straight = tmp_path_factory.mktemp("straight")
    first = tmp_path_factory.mktemp("first_epoch")
    resumed = tmp_path_factory.mktemp("resumed")
    _run(straight)
    # the job "dies" after epoch 0 of the same 2-epoch plan (max_steps stops it; the schedule still spans
    # max_epochs=2, as in the killed job)
    _run(first, f"+trainer.max_steps={STEPS_PER_EPOCH}")
    _run(resumed, f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}")
    return straight, first, resumed


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resumed_run_has_the_same_loss_curve_and_lr(runs):
    straight, first, resumed = runs
    total = 2 * STEPS_PER_EPOCH
    loss_straight = metric_by_step(straight, "train/loss_step")
    loss_split = {**metric_by_step(first, "train/loss_step"), **metric_by_step(resumed, "train/loss_step")}
    assert sorted(loss_straight) == list(range(total))
    assert sorted(metric_by_step(resumed, "train/loss_step")) == list(range(STEPS_PER_EPOCH, total))
    for step in range(total):
        assert loss_split[step] == pytest.approx(loss_straight[step], rel=1e-6, abs=1e-7), step

    lr_straight = metric_by_step(straight, "lr-SGD/other")  # LearningRateMonitor, every step here
    lr_resumed = metric_by_step(resumed, "lr-SGD/other")
    # hand-computed: linear warm-up over 3 iterations, x0.1 from epoch 1 (step 2 is both)
    expected = [BASE_LR * min(1.0, s / WARMUP) * (0.1 if s >= STEPS_PER_EPOCH else 1.0) for s in range(total)]
    assert [lr_straight[s] for s in range(total)] == pytest.approx(expected, rel=1e-6)
    # the first resumed step: still in warm-up and past the milestone
    assert lr_resumed[STEPS_PER_EPOCH] == pytest.approx(BASE_LR * 2 / 3 * 0.1, rel=1e-6)
    assert [lr_resumed[s] for s in range(STEPS_PER_EPOCH, total)] == pytest.approx(expected[STEPS_PER_EPOCH:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resumed_run_ends_with_the_same_weights_optimizer_and_counters(runs):
    straight, first, resumed = runs
    a, b, mid = last_checkpoint(straight), last_checkpoint(resumed), last_checkpoint(first)
    # written at the end of epoch 0 (the loops' state says the epoch is complete)
    assert (mid["epoch"], mid["global_step"]) == (0, STEPS_PER_EPOCH)
    assert a["global_step"] == b["global_step"] == 2 * STEPS_PER_EPOCH

    assert a["state_dict"].keys() == b["state_dict"].keys()
    moved = 0
    for key, value in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        if value.is_floating_point() and not torch.equal(value, mid["state_dict"][key]):
            moved += 1
    assert moved > 0.5 * len(a["state_dict"])  # the second epoch really changed the weights

    # optimizer state (SGD momentum buffers) and scheduler position carried over
    opt_a, opt_b = a["optimizer_states"][0], b["optimizer_states"][0]
    assert opt_a["state"].keys() == opt_b["state"].keys() and len(opt_a["state"]) > 0
    for idx, state in opt_a["state"].items():
        torch.testing.assert_close(opt_b["state"][idx]["momentum_buffer"], state["momentum_buffer"])
    assert [g["lr"] for g in opt_a["param_groups"]] == pytest.approx([g["lr"] for g in opt_b["param_groups"]])
    sched_a, sched_b = a["lr_schedulers"][0], b["lr_schedulers"][0]
    assert sched_a["last_epoch"] == sched_b["last_epoch"] == 2 * STEPS_PER_EPOCH
    assert sched_b["_last_lr"] == pytest.approx(sched_a["_last_lr"])
