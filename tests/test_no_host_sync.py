"""The training step never waits for the device: no sync-prone call outside the logging interval.

On a CPU nothing really syncs, so the test counts the calls that would (``.item()``, ``.tolist()``,
``bool(tensor)``, ``torch.tensor(python value)`` ...) with a TorchFunctionMode during a short fit of each
module, through the configs' callbacks (progress bar, NaN guard, LR monitor, checkpointing).

One process only: under DDP, Lightning 2.6 itself broadcasts a SIGTERM flag and reads it back before every
training step (``_broadcast_sigterm_tensor``), one small sync per step that this project cannot remove.
"""

from __future__ import annotations

import collections

import pytest
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from torch.overrides import TorchFunctionMode

from ssd_lightning.train import train
from tests.conftest import compose_config

SYNC_PRONE = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "unique", "cpu"}
FROM_PYTHON = {"tensor", "as_tensor", "scalar_tensor"}  # a host-to-device copy that waits on CUDA
STEPS, LOG_EVERY = 8, 4


class _CountSyncs(TorchFunctionMode, pl.Callback):
    """Counts sync-prone torch calls per training batch index while a batch runs."""

    def __init__(self) -> None:
        super().__init__()
        self.batch: int | None = None
        self.calls: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.batch is not None and (name in SYNC_PRONE or name in FROM_PYTHON):
            self.calls[self.batch][name] += 1
        return func(*args, **(kwargs or {}))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch = batch_idx

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.batch = None  # epoch-end work (checkpoint, epoch metrics) may sync once per epoch


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["data=synthetic", "model.net.backbone=resnet18", "model.net.num_classes=5", "~callbacks.coco_map"],
        ["data=synthetic_cls", "model=mobilenetv2", "callbacks=classification", "data.image_size=64"],
    ],
    ids=["ssd300", "mobilenetv2"],
)
def test_only_logging_steps_touch_the_host(overrides, tmp_path, monkeypatch):
    counter = _CountSyncs()
    cfg = compose_config(
        [
            *overrides,
            "data.batch_size=2",
            f"data.steps_per_epoch={STEPS}",
            "trainer=cpu",
            "trainer.max_epochs=1",
            f"trainer.log_every_n_steps={LOG_EVERY}",
            "+trainer.limit_val_batches=0",
            "eval_epochs=[]",
            "precision=bf16",
            "logger=csv",
            f"paths.output_dir={tmp_path}",
        ]
    )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    import ssd_lightning.train as train_module

    real = train_module.instantiate_group
    monkeypatch.setattr(
        train_module,
        "instantiate_group",
        lambda group: [*real(group), counter] if group is cfg.callbacks else real(group),
    )
    with counter:
        train(cfg)
    # Lightning logs at batches 3 and 7, the LR monitor the batch before; the first batch sets up the
    # logged-metric buffers once; the last one runs the epoch-end hooks. Ordinary batches: 1, 4, 5.
    logging_batches = {0, STEPS - 1} | {b for b in range(STEPS) if (b + 1) % LOG_EVERY in (0, LOG_EVERY - 1)}
    assert set(range(STEPS)) - logging_batches == {1, 4, 5}
    busy = {b: dict(c) for b, c in counter.calls.items() if b not in logging_batches}
    assert busy == {}, f"sync-prone calls on ordinary steps: {busy}"
    assert counter.calls, "the counter saw nothing: the test is not measuring"
