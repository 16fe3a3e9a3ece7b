"""EvalSchedule: validation (forward passes included) only after the listed epochs, also after a resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ssd_lightning.callbacks.eval_schedule import EvalSchedule
from tests.helpers import quiet_trainer


class TinyModule(pl.LightningModule):
    """Records the epoch of every validation_step call (sanity check separately)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.val_steps: list[int] = []
        self.sanity_steps = 0

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        if self.trainer.sanity_checking:
            self.sanity_steps += 1
        else:
            self.val_steps.append(self.current_epoch)
        self.log("val/score", float(self.current_epoch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)  # 4 batches

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2)  # 3 batches


class ValidationEpochs(Callback):
    def __init__(self):
        self.epochs: list[int] = []

    def on_validation_epoch_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.epochs.append(trainer.current_epoch)


class SaveAndStop(Callback):
    """Saves a checkpoint at (epoch, batch_idx); stops the run there when ``stop``."""

    def __init__(self, path: Path, epoch: int, batch_idx: int, stop: bool = False):
        self.path, self.epoch, self.batch_idx, self.stop = path, epoch, batch_idx, stop

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)
            if self.stop:
                trainer.should_stop = True


def _fit(tmp_path, callbacks, model=None, ckpt_path=None, **kwargs):
    model = model or TinyModule()
    trainer = quiet_trainer(tmp_path, callbacks, **{"max_epochs": 6, "num_sanity_val_steps": 1, **kwargs})
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def test_validates_only_scheduled_epochs(tmp_path):
    rec = ValidationEpochs()
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/score", mode="max", save_top_k=-1)
    every = ModelCheckpoint(dirpath=tmp_path / "every", save_top_k=-1, save_on_train_epoch_end=True)
    trainer, model = _fit(tmp_path, [EvalSchedule([1, 4]), rec, best, every])
    assert rec.epochs == [1, 4, 5]  # 5: the last epoch (always_last)
    assert model.val_steps == [1] * 3 + [4] * 3 + [5] * 3  # no forward passes on other epochs
    assert model.sanity_steps == 1  # the sanity check still runs and is not counted
    assert trainer.current_epoch == 6 and trainer.global_step == 24

    # ModelCheckpoint(monitor=val/...) saves after each scheduled validation, never in between
    def saved(name):
        return sorted(int(p.name.split("-")[0][6:]) for p in (tmp_path / name).glob("*.ckpt"))

    assert saved("ckpt") == [1, 4, 5]
    assert saved("every") == [0, 1, 2, 3, 4, 5]
    assert trainer.check_val_every_n_epoch == 1  # the trainer's own value is restored after fit


def test_without_last_and_with_val_check_interval(tmp_path):
    rec = ValidationEpochs()
    plain = ModelCheckpoint(dirpath=tmp_path / "plain", save_top_k=-1)
    _, model = _fit(tmp_path, [EvalSchedule([0, 3], always_last=False), rec, plain], max_epochs=5)
    assert rec.epochs == [0, 3]
    # without monitor and with the default save_on_train_epoch_end, checkpoints follow validation
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "plain").glob("*.ckpt")) == ["epoch=0", "epoch=3"]
    rec = ValidationEpochs()
    _, model = _fit(tmp_path, [EvalSchedule([2]), rec], max_epochs=4, val_check_interval=0.5)
    assert rec.epochs == [2, 2, 3, 3]  # twice per scheduled epoch (every 2 of the 4 batches), never elsewhere


def test_resume_after_unscheduled_epoch_end(tmp_path):
    """A run stopped after epoch 2 and resumed from its checkpoint validates after 4 and 5, like an
    uninterrupted run."""
    ckpt = tmp_path / "epoch2.ckpt"
    rec = ValidationEpochs()
    _fit(tmp_path, [EvalSchedule([1, 4]), rec, SaveAndStop(ckpt, epoch=2, batch_idx=3, stop=True)])
    assert rec.epochs == [1]
    assert ckpt.is_file()
    rec = ValidationEpochs()
    trainer, model = _fit(tmp_path, [EvalSchedule([1, 4]), rec], ckpt_path=str(ckpt))
    assert rec.epochs == [4, 5]
    assert model.val_steps == [4] * 3 + [5] * 3
    assert trainer.global_step == 24


def test_resume_mid_scheduled_epoch(tmp_path):
    """Resuming in the middle of epoch 4 (Lightning skips on_train_epoch_start then) still validates it."""
    ckpt = tmp_path / "mid4.ckpt"
    rec = ValidationEpochs()
    _fit(tmp_path, [EvalSchedule([1, 4]), rec, SaveAndStop(ckpt, epoch=4, batch_idx=1)])
    assert rec.epochs == [1, 4, 5]
    rec = ValidationEpochs()
    _fit(tmp_path, [EvalSchedule([1, 4]), rec], ckpt_path=str(ckpt))
    assert rec.epochs == [4, 5]


def test_resume_mid_unscheduled_epoch(tmp_path):
    ckpt = tmp_path / "mid3.ckpt"
    _fit(tmp_path, [EvalSchedule([1, 4], always_last=False), SaveAndStop(ckpt, epoch=3, batch_idx=1)])
    rec = ValidationEpochs()
    _fit(tmp_path, [EvalSchedule([1, 4], always_last=False), rec], ckpt_path=str(ckpt))
    assert rec.epochs == [4]


def test_should_validate_reference_schedule():
    schedule = EvalSchedule([21, 31, 37, 42, 48, 53, 59, 64])
    assert [e for e in range(65) if schedule.should_validate(e, last_epoch=64)] == [
        21,
        31,
        37,
        42,
        48,
        53,
        59,
        64,
    ]
    assert EvalSchedule([3]).should_validate(9, last_epoch=9)
    assert not EvalSchedule([3], always_last=False).should_validate(9, last_epoch=9)
    assert not EvalSchedule([3]).should_validate(9, last_epoch=None)


@pytest.mark.parametrize("epochs", [[-1, 3], [3, 2], [2, 2], [1.5], [True]])
def test_bad_eval_epochs(epochs):
    with pytest.raises(ValueError, match="eval_epochs"):
        EvalSchedule(epochs)


def test_epochs_past_the_end_are_skipped_with_one_warning(tmp_path):
    """A first quick try (trainer.max_epochs=2) on a recipe's schedule trains and validates the last epoch."""
    rec = ValidationEpochs()
    with pytest.warns(UserWarning, match=r"eval_epochs \[21, 31\] lie past the last epoch \(1,") as caught:
        _fit(tmp_path, [EvalSchedule([0, 21, 31]), rec], max_epochs=2)
    assert rec.epochs == [0, 1]
    assert sum("lie past the last epoch" in str(w.message) for w in caught) == 1


def test_errors_at_fit_start(tmp_path):
    with pytest.raises(ValueError, match="check_val_every_n_epoch=None"):
        _fit(tmp_path, [EvalSchedule([1])], check_val_every_n_epoch=None, val_check_interval=2)
