"""ClassifierLitModule: metrics on known logits, parameter groups, run-time LR rule, EMA, learnability."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.accelerators import CPUAccelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ssd_lightning.models.mobilenetv2 import mobilenet_v2
from ssd_lightning.modules.classifier import ClassifierLitModule
from ssd_lightning.modules.ema import ExponentialMovingAverage
from tests.helpers import load_checkpoint


@pytest.fixture(autouse=True)
def one_thread():
    """Small convolutions gain nothing from a second thread, and lose a lot when the cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    images, labels = zip(*items, strict=True)
    return {"images": torch.stack(images), "labels": torch.stack(labels).long()}


class TensorDataModule(pl.LightningDataModule):
    """Plain tensors as ``{"images", "labels"}`` batches; exposes the per-device ``batch_size``."""

    def __init__(self, train, val, *, batch_size: int, shuffle: bool = True) -> None:
        super().__init__()
        self.train_set, self.val_set = TensorDataset(*train), TensorDataset(*val)
        self.batch_size = batch_size
        self.shuffle = shuffle

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(
            self.train_set, self.batch_size, shuffle=self.shuffle, collate_fn=_collate, generator=generator
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, collate_fn=_collate)


def _trainer(**kwargs) -> pl.Trainer:
    defaults = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**(defaults | kwargs))


def _sgd(lr: float = 0.1, weight_decay: float = 4e-5) -> functools.partial:
    return functools.partial(torch.optim.SGD, lr=lr, momentum=0.9, weight_decay=weight_decay)


def _random_images(n: int, num_classes: int, size: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, num_classes, (n,), generator=g)


# Four samples, six classes. Ranks of the true class: 1, 5, 6, 5 -> acc1 = 1/4, acc5 = 3/4.
HAND_LOGITS = torch.tensor(
    [
        [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # label 0: top-1
        [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # label 4: 5th
        [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # label 5: 6th
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # label 1: 5th
    ]
)
HAND_LABELS = torch.tensor([0, 4, 5, 1])


def _identity_module(num_classes: int, **kwargs) -> ClassifierLitModule:
    net = nn.Linear(num_classes, num_classes, bias=True)
    with torch.no_grad():
        net.weight.copy_(torch.eye(num_classes))
        net.bias.zero_()
    return ClassifierLitModule(net, optimizer=_sgd(lr=0.0, weight_decay=0.0), **kwargs)


def test_topk_metrics_on_hand_made_logits():
    module = _identity_module(6)
    # Unequal batches (3 + 1): a mean of per-batch accuracies would give acc1 1/6 and acc5 5/6.
    batches = [
        {"images": HAND_LOGITS[:3], "labels": HAND_LABELS[:3]},
        {"images": HAND_LOGITS[3:], "labels": HAND_LABELS[3:]},
    ]
    metrics = _trainer().validate(module, dataloaders=DataLoader(batches, batch_size=None), verbose=False)[0]
    assert metrics["val/acc1"] == pytest.approx(0.25)
    assert metrics["val/acc5"] == pytest.approx(0.75)
    assert metrics["val/loss"] == pytest.approx(F.cross_entropy(HAND_LOGITS, HAND_LABELS).item(), rel=1e-6)
    assert module.acc1_best.item() == 0.0  # only fitting updates the best epoch

    test_metrics = _trainer().test(module, dataloaders=DataLoader(batches, batch_size=None), verbose=False)[0]
    assert test_metrics["test/acc1"] == pytest.approx(0.25)
    assert test_metrics["test/acc5"] == pytest.approx(0.75)


def test_top5_falls_back_to_num_classes_when_fewer_than_five():
    module = _identity_module(3)
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    batch = {"images": logits, "labels": torch.tensor([2, 0])}
    metrics = _trainer().validate(module, dataloaders=DataLoader([batch], batch_size=None), verbose=False)[0]
    assert metrics["val/acc1"] == pytest.approx(0.5)
    assert metrics["val/acc5"] == pytest.approx(1.0)  # top-3 of 3 classes


def test_training_loss_uses_label_smoothing():
    module = _identity_module(6, label_smoothing=0.1)  # lr 0: the identity net never changes
    data = TensorDataModule(
        (HAND_LOGITS, HAND_LABELS), (HAND_LOGITS, HAND_LABELS), batch_size=4, shuffle=False
    )
    trainer = _trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    expected = F.cross_entropy(HAND_LOGITS, HAND_LABELS, label_smoothing=0.1).item()
    assert trainer.callback_metrics["train/loss_step"].item() == pytest.approx(expected, rel=1e-6)
    assert trainer.callback_metrics["train/acc1_step"].item() == pytest.approx(0.25)
    no_host_sync = {"train/loss_step", "train/loss_epoch", "lr"}  # not read back by the bar every step
    assert trainer.progress_bar_metrics.keys().isdisjoint(no_host_sync)


def _count_mobilenet_tensors(setting: list[list[int]]) -> dict[str, int]:
    """Hand count for torchvision's MobileNetV2: every conv has a BatchNorm; only the Linear has a bias."""
    blocks = sum(n for _, _, n, _ in setting)
    expansions = sum(n for t, _, n, _ in setting if t != 1)
    convs = 1 + expansions + 2 * blocks + 1  # stem, (expansion), depthwise, projection, head
    return {"norm": 2 * convs, "bias": 1, "depthwise": blocks, "other": convs - blocks + 1}


@pytest.mark.parametrize(("depthwise_weight_decay", "dw_expected"), [(None, 4e-5), (0.0, 0.0)])
def test_param_groups_and_lr_scaling_at_run_time(depthwise_weight_decay, dw_expected):
    setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2]]
    net = mobilenet_v2(num_classes=4, width_mult=0.35, inverted_residual_setting=setting)
    module = ClassifierLitModule(
        net,
        optimizer=_sgd(lr=0.1, weight_decay=4e-5),
        lr_scaling={"rule": "linear", "reference_batch_size": 32},
        depthwise_weight_decay=depthwise_weight_decay,
    )
    data = TensorDataModule(_random_images(8, 4), _random_images(8, 4), batch_size=8)
    trainer = _trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)

    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
    groups = {g["name"]: g for g in optimizer.param_groups}
    counts = {name: len(g["params"]) for name, g in groups.items()}
    assert counts == _count_mobilenet_tensors(setting) == {"norm": 38, "bias": 1, "depthwise": 6, "other": 14}
    assert sum(counts.values()) == len(list(net.parameters()))
    assert {name: g["weight_decay"] for name, g in groups.items()} == {
        "norm": 0.0,
        "bias": 0.0,
        "depthwise": dw_expected,
        "other": 4e-5,
    }
    # Linear rule at run time: 1 device x batch 8 / reference 32.
    assert all(g["lr"] == pytest.approx(0.1 * 8 / 32) for g in optimizer.param_groups)


def test_sqrt_rule_and_scheduler_peak_lr():
    module = ClassifierLitModule(
        nn.Linear(4, 4),
        optimizer=_sgd(lr=0.2, weight_decay=0.0),
        lr_scaling={"rule": "sqrt", "reference_batch_size": 32},
        scheduler={"name": "step", "step_size": 1, "gamma": 0.5},
    )
    images = torch.randn(16, 4)
    labels = torch.randint(0, 4, (16,))
    data = TensorDataModule((images, labels), (images, labels), batch_size=8, shuffle=False)
    trainer = _trainer(max_epochs=2, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    group = trainer.optimizers[0].param_groups[0]
    assert group["initial_lr"] == pytest.approx(0.2 * (8 / 32) ** 0.5)
    # step schedule: x0.5 per epoch, per iteration (2 steps per epoch); after 4 steps epoch index is 2.
    assert group["lr"] == pytest.approx(group["initial_lr"] * 0.25)


def test_ema_update_math_on_a_tiny_network():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ema = ExponentialMovingAverage(net, decay=0.9)
    assert not any(p.requires_grad for p in ema.parameters())
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[1].running_mean.fill_(2.0)
        net[1].num_batches_tracked.fill_(5)
    ema.update_parameters(net)  # first update copies
    with torch.no_grad():
        net[0].weight.fill_(3.0)
        net[1].running_mean.fill_(4.0)
        net[1].num_batches_tracked.fill_(7)
    ema.update_parameters(net)
    torch.testing.assert_close(ema.module[0].weight, torch.full((2, 2), 0.9 * 1 + 0.1 * 3))
    torch.testing.assert_close(ema.module[1].running_mean, torch.full((2,), 0.9 * 2 + 0.1 * 4))
    assert ema.module[1].num_batches_tracked.item() == 7  # integer buffers are copied
    assert ema.n_averaged.item() == 2
    with pytest.raises(ValueError, match="ema_decay"):
        ExponentialMovingAverage(net, decay=1.0)


def test_ema_in_training_validation_and_checkpoint(tmp_path):
    torch.manual_seed(0)
    setting = [[1, 16, 1, 1], [6, 24, 1, 2]]
    net = mobilenet_v2(num_classes=4, width_mult=0.35, inverted_residual_setting=setting)
    module = ClassifierLitModule(
        net, optimizer=_sgd(lr=0.1), ema_decay=0.5, ema_every_n_steps=2, ema_decay_scaling="none"
    )
    data = TensorDataModule(_random_images(32, 4, seed=1), _random_images(8, 4, seed=2), batch_size=8)
    trainer = _trainer(max_epochs=1, enable_checkpointing=False)
    trainer.fit(module, datamodule=data)

    assert module.ema.n_averaged.item() == 2  # steps 2 and 4 of 4
    raw, averaged = module.net.state_dict(), module.ema.module.state_dict()
    assert raw.keys() == averaged.keys()
    assert any(not torch.equal(raw[k], averaged[k]) for k in raw if raw[k].is_floating_point())
    for key in ("val/acc1_ema", "val/acc5_ema", "val/loss_ema", "val/acc1_best", "val/acc1_ema_best"):
        assert key in trainer.callback_metrics, key

    path = tmp_path / "ema.ckpt"
    trainer.save_checkpoint(path)
    state = load_checkpoint(path)["state_dict"]  # plain values only
    assert state["ema.n_averaged"].item() == 2
    torch.testing.assert_close(state["ema.module.features.0.0.weight"], averaged["features.0.0.weight"])
    # Best accuracy is a buffer: it travels in the checkpoint and survives a resume.
    assert state["acc1_best"].item() == pytest.approx(trainer.callback_metrics["val/acc1_best"].item())
    assert state["acc1_best_epoch"].item() == 0
    resumed = ClassifierLitModule(
        mobilenet_v2(num_classes=4, width_mult=0.35, inverted_residual_setting=setting),
        optimizer=_sgd(lr=0.1),
        ema_decay=0.5,
        ema_every_n_steps=2,
        ema_decay_scaling="none",
    )
    _trainer(max_epochs=1).fit(resumed, datamodule=data, ckpt_path=path)  # nothing to run
    assert resumed.acc1_best.item() == pytest.approx(state["acc1_best"].item())
    assert resumed.ema.n_averaged.item() == 2
    torch.testing.assert_close(
        resumed.ema.module.state_dict()["features.0.0.weight"], averaged["features.0.0.weight"]
    )


def test_ema_restarts_during_warmup():
    torch.manual_seed(0)
    net = mobilenet_v2(num_classes=4, width_mult=0.35, inverted_residual_setting=[[1, 16, 1, 1]])
    module = ClassifierLitModule(
        net,
        optimizer=_sgd(lr=0.1),
        scheduler={"name": "constant", "warmup_steps": 3},
        ema_decay=0.9,
    )
    data = TensorDataModule(_random_images(32, 4, size=16), _random_images(8, 4, size=16), batch_size=8)
    trainer = _trainer(max_epochs=1, limit_val_batches=0)  # 4 steps
    trainer.fit(module, datamodule=data)
    # Updates after steps 1-3 restart the average; step 4's update copies the network once more.
    assert module.ema.n_averaged.item() == 1
    for key, value in module.net.state_dict().items():
        assert torch.equal(module.ema.module.state_dict()[key], value), key


def test_sync_batchnorm_only_with_several_gpu_processes():
    cases = [
        (1, SimpleNamespace(), nn.BatchNorm2d),  # one process: nothing to sync
        (2, CPUAccelerator(), nn.BatchNorm2d),  # torch's SyncBatchNorm refuses CPU modules
        (2, SimpleNamespace(), nn.SyncBatchNorm),  # stands for a GPU accelerator
    ]
    for world_size, accelerator, expected in cases:
        net = mobilenet_v2(num_classes=4, width_mult=0.35, inverted_residual_setting=[[1, 16, 1, 1]])
        module = ClassifierLitModule(net, optimizer=_sgd(), sync_batchnorm=True)
        params_before = [id(p) for p in module.net.parameters()]
        module._trainer = SimpleNamespace(world_size=world_size, accelerator=accelerator)
        module.configure_model()
        norms = [m for m in module.net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert norms and all(type(m) is expected for m in norms)
        assert [id(p) for p in module.net.parameters()] == params_before
        module._trainer = None


def test_bad_arguments():
    with pytest.raises(ValueError, match="label_smoothing"):
        _identity_module(4, label_smoothing=1.0)
    with pytest.raises(ValueError, match="ema_every_n_steps"):
        _identity_module(4, ema_every_n_steps=0)
    with pytest.raises(ValueError, match="num_classes"):
        ClassifierLitModule(nn.Identity(), optimizer=_sgd())


def coloured_shapes(n_per_class: int, *, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Four classes: red squares, green disks, blue horizontal bars, yellow vertical bars on noise.

    Returns images (N, 3, size, size) float32, normalised to about zero mean, and labels (N,) int64.
    """
    g = torch.Generator().manual_seed(seed)
    colours = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.2, 0.9], [0.9, 0.9, 0.1]])
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    images, labels = [], []
    for c in range(4):
        for _ in range(n_per_class):
            img = 0.5 * torch.rand(3, size, size, generator=g)
            r = int(torch.randint(size // 8, size // 4, (1,), generator=g))
            cy, cx = (int(v) for v in torch.randint(r, size - r, (2,), generator=g))
            if c == 0:
                mask = ((yy - cy).abs() <= r) & ((xx - cx).abs() <= r)
            elif c == 1:
                mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            elif c == 2:
                mask = ((yy - cy).abs() <= r // 3) & ((xx - cx).abs() <= 2 * r)
            else:
                mask = ((yy - cy).abs() <= 2 * r) & ((xx - cx).abs() <= r // 3)
            shade = 0.7 + 0.3 * torch.rand(1, generator=g)
            img[:, mask] = (colours[c] * shade)[:, None]
            images.append(img)
            labels.append(c)
    return (torch.stack(images) - 0.4) / 0.3, torch.tensor(labels)


def test_learns_coloured_shapes_well_above_chance():
    """A shallow MobileNetV2 (three stages, width 0.35) learns 4 classes of 32x32 shapes in 96 steps."""
    torch.manual_seed(0)
    setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 2, 2]]
    net = mobilenet_v2(num_classes=4, width_mult=0.35, dropout=0.0, inverted_residual_setting=setting)
    module = ClassifierLitModule(
        net,
        optimizer=functools.partial(torch.optim.AdamW, lr=2e-3, weight_decay=1e-4),
        scheduler={"name": "cosine", "warmup_epochs": 0.5},
        label_smoothing=0.1,
        ema_decay=0.8,
    )
    data = TensorDataModule(coloured_shapes(24, seed=0), coloured_shapes(10, seed=1), batch_size=8)
    history: list[float] = []

    class Record(pl.Callback):
        def on_validation_end(self, trainer, pl_module):  # after the module's epoch-end logging
            history.append(trainer.callback_metrics["val/acc1"].item())

    trainer = _trainer(max_epochs=8, callbacks=[Record()])
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert metrics["val/acc1"].item() >= 0.6, history  # chance is 0.25; ~0.9 measured
    assert metrics["val/acc1_ema"].item() >= 0.5
    assert metrics["val/acc1_best"].item() == pytest.approx(max(history))
    assert module.acc1_best_epoch.item() == history.index(max(history))


def test_ema_decay_follows_torchvisions_scaling_rule():
    from ssd_lightning.optim import scale_ema_decay

    # torchvision's recipes: --model-ema-decay 0.99998, --model-ema-steps 32; 8 x 32 images, 300 epochs
    adjust = 8 * 32 * 32 / 300
    assert scale_ema_decay(
        0.99998, world_size=8, batch_size=32, every_n_steps=32, epochs=300
    ) == pytest.approx(1 - 2e-5 * adjust, abs=1e-12)
    assert scale_ema_decay(0.9, world_size=8, batch_size=32, every_n_steps=32, epochs=300) == 0.0  # capped
    assert scale_ema_decay(0.99, scaling="none", batch_size=1, epochs=1) == 0.99
    with pytest.raises(ValueError, match="ema_decay_scaling"):
        scale_ema_decay(0.99, scaling="torchvison", batch_size=1, epochs=1)


@pytest.mark.parametrize(("scaling", "expected"), [("torchvision", 1 - 1e-3 * 8 * 2 / 3), ("none", 0.999)])
def test_the_module_applies_the_scaled_decay_from_the_run(scaling, expected, caplog):
    """Batch 8 per device, 1 process, an update every 2 steps, 3 epochs: the run decides the decay."""
    setting = [[1, 16, 1, 1]]
    net = mobilenet_v2(num_classes=4, width_mult=0.35, inverted_residual_setting=setting)
    module = ClassifierLitModule(
        net, optimizer=_sgd(lr=0.1), ema_decay=0.999, ema_every_n_steps=2, ema_decay_scaling=scaling
    )
    data = TensorDataModule(_random_images(16, 4, seed=1), _random_images(8, 4, seed=2), batch_size=8)
    trainer = _trainer(max_epochs=3, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    assert module.ema.decay == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="ema_decay_scaling"):
        ClassifierLitModule(net, optimizer=_sgd(lr=0.1), ema_decay=0.9, ema_decay_scaling="tv")


def test_confusion_matrix_picture_and_top_confusions(tmp_path, caplog):
    """Known predictions (identity net: the argmax of the input): the logged top confusions are counted
    by hand, the picture is written for the evaluated epoch only (not the sanity check)."""
    import logging

    from PIL import Image

    eye = torch.eye(3)
    images = eye[[0, 0, 0, 2, 0, 1]]  # predicted a, a, a, c, a, b
    labels = torch.tensor([0, 1, 1, 1, 2, 1])  # true      a, b, b, b, c, b
    data = TensorDataModule((images, labels), (images, labels), batch_size=4, shuffle=False)
    data.class_names = ["a", "b", "c"]
    module = _identity_module(3, confusion_matrix=True)
    trainer = _trainer(default_root_dir=tmp_path, max_epochs=1, num_sanity_val_steps=1, limit_train_batches=1)
    with caplog.at_level(logging.INFO, logger="ssd_lightning.modules.classifier"):
        trainer.fit(module, datamodule=data)
    lines = [r.getMessage() for r in caplog.records if "top confusions" in r.getMessage()]
    assert lines == ["Epoch 0: top confusions (true -> predicted): b -> a (2), b -> c (1), c -> a (1)"]
    picture = tmp_path / "analysis" / "epoch_0" / "classification_confusion.png"
    assert Image.open(picture).size[0] > 300
    assert module.val_confusion.confmat.sum() == 0  # reset after each validation

    off = _identity_module(3)  # off by default in Python (on in configs/model/mobilenetv2.yaml)
    assert off.val_confusion is None
    _trainer(default_root_dir=tmp_path / "off").validate(off, datamodule=data, verbose=False)
    assert not (tmp_path / "off" / "analysis").exists()


@pytest.mark.parametrize(("precision", "expected"), [("bf16-mixed", 2), ("32-true", 0)])
def test_cpu_bf16_runs_the_strided_depthwise_layers_in_float32(precision, expected):
    """Like the detector: on a CPU with bf16-mixed the classifier's stride-2 depthwise layers (two in this
    table) become Float32Conv2d, weights untouched; 32-true leaves them alone."""
    from ssd_lightning.models.cpu_bf16 import Float32Conv2d

    setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 1, 2]]
    net = mobilenet_v2(num_classes=4, width_mult=0.35, inverted_residual_setting=setting)
    module = ClassifierLitModule(net, optimizer=_sgd(lr=0.0, weight_decay=0.0))
    data = TensorDataModule(_random_images(8, 4), _random_images(8, 4), batch_size=4)
    keys = list(net.state_dict())
    _trainer(max_steps=1, limit_val_batches=0, precision=precision).fit(module, datamodule=data)
    assert sum(isinstance(m, Float32Conv2d) for m in module.net.modules()) == expected
    assert list(module.net.state_dict()) == keys
