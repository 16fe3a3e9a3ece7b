"""SSDLitModule: the reference recipe's LR rule, warm-up, milestones and weight-decay groups, in a Trainer."""

from __future__ import annotations

import functools

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ssd_lightning.data.synthetic import SyntheticDetectionDataModule
from ssd_lightning.models import ssd300
from ssd_lightning.modules.ssd import SSDLitModule

BASE_LR = 2.6e-3


def _module(**kwargs) -> SSDLitModule:
    sgd = functools.partial(torch.optim.SGD, lr=BASE_LR, momentum=0.9, weight_decay=5e-4)
    return SSDLitModule(
        ssd300(backbone="resnet18", num_classes=5),
        optimizer=sgd,
        lr_scaling={"rule": "linear", "reference_batch_size": 32},
        scheduler={"name": "multistep", "milestones": [1], "gamma": 0.1, "warmup_steps": 4},
        **kwargs,
    )


class _RecordLR(pl.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.fixture(scope="module")
def fitted():
    torch.manual_seed(0)
    module = _module()
    record = _RecordLR()
    data = SyntheticDetectionDataModule(batch_size=4, num_classes=5, steps_per_epoch=3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, datamodule=data)
    return module, trainer, record.lrs


def test_lr_follows_scaling_warmup_and_milestones(fitted):
    _, trainer, lrs = fitted
    peak = BASE_LR * 1 * 4 / 32  # base x world_size x per-device batch / 32
    # 4 warm-up iterations (lr = peak * step / 4), then x0.1 from epoch 1 (step 3 onwards)
    expected = [0.0, 0.25 * peak, 0.5 * peak, 0.75 * peak * 0.1, peak * 0.1, peak * 0.1]
    assert lrs == pytest.approx(expected, rel=1e-6)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(peak * 0.1, rel=1e-6)


def test_no_weight_decay_on_batchnorm_or_bias(fitted):
    module, trainer, _ = fitted
    decay_of = {id(p): g["weight_decay"] for g in trainer.optimizers[0].param_groups for p in g["params"]}
    checked = 0
    for m in module.net.modules():
        for name, p in m.named_parameters(recurse=False):
            expected = 0.0 if isinstance(m, nn.BatchNorm2d) or name == "bias" else 5e-4
            assert decay_of[id(p)] == expected, (type(m).__name__, name)
            checked += 1
    assert checked == len(decay_of) == len(list(module.net.parameters()))


def test_detections_are_mapped_to_original_pixels():
    module = _module().eval()
    images = torch.randn(2, 3, 300, 300)
    batch = {
        "images": images,
        "image_ids": torch.tensor([7, 9]),
        "image_sizes": torch.tensor([[200, 400], [50, 60]]),
    }
    with torch.no_grad():
        out = module.validation_step(batch, 0)["detections"]
        locs, logits = module.net(images)
        raw = module.box_coder.decode(locs, logits, **module.decoder_settings)
    assert [d["image_id"] for d in out] == [7, 9]
    for det, ref, (h, w) in zip(out, raw, [(200, 400), (50, 60)], strict=True):
        torch.testing.assert_close(det["boxes"], ref["boxes"] * torch.tensor([w, h, w, h]))
        torch.testing.assert_close(det["scores"], ref["scores"])


def test_class_count_mismatch_names_the_key():
    module = _module()
    data = SyntheticDetectionDataModule(batch_size=2, num_classes=81, steps_per_epoch=1)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"model\.net\.num_classes=5 but the data has 81 classes"):
        trainer.fit(module, datamodule=data)


def test_nvidia_checkpoint_is_loaded_into_the_network(tmp_path):
    torch.manual_seed(1)
    trained = ssd300(backbone="resnet18", num_classes=5)
    path = tmp_path / "nvidia.pt"  # what the reference's `main.py --save` writes under DDP
    torch.save({"epoch": 3, "model": {f"module.{k}": v for k, v in trained.state_dict().items()}}, path)
    module = _module(nvidia_checkpoint=str(path))
    for key, value in trained.state_dict().items():
        torch.testing.assert_close(module.net.state_dict()[key], value)


def test_checkpoints_record_the_decoder_settings_used_not_nulls():
    """model.decoder keys left null take DecoderSettings' defaults; hparams (and so checkpoints, which
    predict and export read) hold the numbers the evaluation used."""
    net = ssd300(backbone="resnet18", num_classes=3)
    module = SSDLitModule(net=net, optimizer=None, decoder={"score_thresh": 0.2, "nms_iou": None})
    assert module.hparams["decoder"] == {
        "score_thresh": 0.2,
        "nms_iou": 0.5,
        "topk_per_class": 200,
        "max_detections": 200,
    }
