"""NaN/inf losses: a bad batch does not poison the weights, a diverged run stops with a clear message."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ssd_lightning.callbacks import NonFiniteGuard
from ssd_lightning.cli.train import train
from ssd_lightning.errors import NonFiniteLossError
from tests.fault_injection import NaNImagesAt
from tests.helpers import quiet_trainer

BATCHES = 10


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return ((self.layer(batch["images"]) - 1.0) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        batches = [{"images": torch.randn(8, 4, generator=g)} for _ in range(BATCHES)]
        return torch.utils.data.DataLoader(batches, batch_size=None)  # the dicts as they are


def _fit(callbacks: list, max_epochs: int = 1) -> tuple[pl.Trainer, _Regression]:
    torch.manual_seed(0)
    module = _Regression()
    trainer = quiet_trainer(callbacks=callbacks, max_epochs=max_epochs, log_every_n_steps=2)
    trainer.fit(module)
    return trainer, module


def _finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_one_bad_batch_is_skipped_and_counted():
    trainer, module = _fit([NaNImagesAt([3]), NonFiniteGuard(patience=3)])
    assert _finite(module)
    assert trainer.global_step == BATCHES
    assert float(trainer.callback_metrics["train/nonfinite_losses"]) == 1.0
    assert float(trainer.callback_metrics["train/nonfinite_grad_steps"]) == 1.0


def test_without_zeroing_one_bad_batch_poisons_the_weights():
    """The control: what the guard prevents really happens."""
    _, module = _fit([NaNImagesAt([3]), NonFiniteGuard(patience=100, zero_nonfinite_grads=False)])
    assert not _finite(module)


def test_persistent_nans_stop_the_run_naming_the_first_bad_batch(caplog):
    guard = NonFiniteGuard(patience=3, check_every_n_steps=2)
    with pytest.raises(NonFiniteLossError) as info:
        _fit([NaNImagesAt(list(range(15, 100))), guard], max_epochs=5)
    message = str(info.value)
    # bad from global batch 15 = epoch 1, batch 5; 3 in a row at batch 7, seen at the check after batch 7
    assert "first at epoch 1, batch 5" in message and "3+ consecutive steps" in message
    assert "model.optimizer.lr" in message
    assert "(first at epoch 1, batch 5; 3 in a row now)" in caplog.text  # the warning before the stop


def test_guard_arguments_are_checked():
    with pytest.raises(ValueError, match="patience must be >= 1"):
        NonFiniteGuard(patience=0)
    with pytest.raises(ValueError, match="check_every_n_steps must be >= 1"):
        NonFiniteGuard(check_every_n_steps=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_diverging_ssd_run_stops_with_a_clear_error(tmp_path, make_cfg):
    """The real thing: SSD300 with an absurd learning rate, through train() and the configs' callbacks."""
    cfg = make_cfg(  # outputs in tmp_path
        [
            "data=synthetic",
            "data.batch_size=2",
            "data.steps_per_epoch=30",
            "model.net.backbone=resnet18",
            "model.net.num_classes=5",
            "model.optimizer.lr=1e6",
            "model.lr_scaling.rule=none",
            "model.scheduler.warmup_steps=0",
            "trainer=cpu",
            "trainer.max_epochs=1",
            "trainer.log_every_n_steps=5",
            "+trainer.limit_val_batches=0",
            "+trainer.enable_progress_bar=false",
            "~callbacks.coco_map",
            "callbacks.nonfinite.patience=5",
            "eval_epochs=[]",
            "logger=csv",
        ]
    )
    with pytest.raises(NonFiniteLossError, match="consecutive steps"):
        train(cfg)
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # no checkpoint of a diverged net
