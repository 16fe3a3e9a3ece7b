"""``model.init_from``: a fit starts from the matching weights of a file (issue #17, item 1a).

Unit tests load into freshly built networks and compare tensor by tensor: what matches by name and shape
equals the file exactly, what does not (class heads of another class count) equals the network's own
initialisation. The end-to-end tests go through ``train(cfg)`` and read the module's weights at
``on_train_start``, after Lightning has set everything up and before the first step.
"""

from __future__ import annotations

import logging
import re
from typing import ClassVar

import hydra
import pytest
import pytorch_lightning as pl
import torch

from ssd_lightning.cli.train import train
from ssd_lightning.errors import ConfigError
from ssd_lightning.io.weights import CheckpointNotFoundError, init_from_checkpoint
from ssd_lightning.models import mobilenet_v2, ssd300
from tests.helpers import SYNTHETIC_SSD_RUN, compose_config, last_checkpoint, load_checkpoint, train_config

HEAD_KEYS = {f"conf.{i}.{p}" for i in range(6) for p in ("weight", "bias")}


def _randomised(net: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every float tensor random (BN statistics included), so equality can only come from a copy."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in net.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
    return net


def _clone(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def source_ssd() -> torch.nn.Module:
    return _randomised(ssd300(backbone="resnet18", num_classes=5), seed=0)


@pytest.mark.parametrize(
    "layout",
    ["lightning", "nvidia main.py", "nvidia hub", "state dict"],
)
def test_other_class_count_loads_all_but_the_class_heads(source_ssd, layout, tmp_path, caplog):
    sd = source_ssd.state_dict()
    checkpoint = {
        "lightning": {"state_dict": {f"net.{k}": v for k, v in sd.items()}, "epoch": 3},
        "nvidia main.py": {"epoch": 3, "iteration": 9, "label_map": {1: "a"}, "model": sd},
        "nvidia hub": {"model": {f"module.1.{k}": v for k, v in sd.items()}},
        "state dict": {f"module.{k}": v for k, v in sd.items()},
    }[layout]
    path = tmp_path / "source.pt"
    torch.save(checkpoint, path)
    torch.manual_seed(1)
    net = ssd300(backbone="resnet18", num_classes=3)
    initial = _clone(net)

    with caplog.at_level(logging.INFO, logger="ssd_lightning.io.weights"):
        report = init_from_checkpoint(net, path)

    after = net.state_dict()
    assert set(report.other_shape) == HEAD_KEYS and report.absent == [] and report.unused == []
    for key, value in after.items():
        if key in HEAD_KEYS:  # re-initialised: the new shape, the network's own (reference) init
            assert value.shape[0] == sd[key].shape[0] // 5 * 3
            assert torch.equal(value, initial[key]), key
        else:  # backbone, extra blocks, loc heads: exactly the file's
            assert torch.equal(value, sd[key]), key
    n = len(after)
    assert f"loaded {n - 12}/{n} tensors" in caplog.text
    assert "re-initialised 12 whose shape differs in the file (conf.0.weight, conf.0.bias" in caplog.text


def test_same_class_count_loads_everything(source_ssd, tmp_path):
    path = tmp_path / "source.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in source_ssd.state_dict().items()}}, path)
    net = ssd300(backbone="resnet18", num_classes=5)
    report = init_from_checkpoint(net, path)
    assert report.loaded_fraction == 1.0 and not report.other_shape
    for key, value in source_ssd.state_dict().items():
        assert torch.equal(net.state_dict()[key], value), key
    x = torch.randn(1, 3, 300, 300)
    with torch.no_grad():
        for a, b in zip(net.eval()(x), source_ssd.eval()(x), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_classifier_from_a_lightning_checkpoint_takes_net_not_ema(tmp_path):
    source = _randomised(mobilenet_v2(width_mult=0.25, num_classes=4), seed=2)
    ema = _randomised(mobilenet_v2(width_mult=0.25, num_classes=4), seed=3)
    state = {f"net.{k}": v for k, v in source.state_dict().items()}
    state |= {f"ema.module.{k}": v for k, v in ema.state_dict().items()} | {"acc1_best": torch.tensor(0.5)}
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": {"num_classes": 4}}, path)
    torch.manual_seed(4)
    net = mobilenet_v2(width_mult=0.25, num_classes=6)
    initial = _clone(net)
    report = init_from_checkpoint(net, path)
    assert report.other_shape == ["classifier.1.weight", "classifier.1.bias"]
    assert len(report.left_out) == len(ema.state_dict()) + 1
    for key, value in source.features.state_dict().items():
        assert torch.equal(net.features.state_dict()[key], value), key
    assert torch.equal(net.classifier[1].weight, initial["classifier.1.weight"])
    assert net.classifier[1].weight.shape == (6, 1280)


def test_a_file_of_another_architecture_is_an_error(tmp_path):
    path = tmp_path / "classifier.ckpt"
    net = mobilenet_v2(width_mult=0.25, num_classes=4)
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}}, path)
    detector = ssd300(backbone="mobilenet_v2", num_classes=5)
    before = _clone(detector)
    with pytest.raises(ConfigError, match=r"model\.init_from=.*classifier\.ckpt: none of the network's"):
        init_from_checkpoint(detector, path)
    assert all(torch.equal(v, before[k]) for k, v in detector.state_dict().items())


def test_missing_file_names_the_key(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"model\.init_from=.*nope\.ckpt not found"):
        init_from_checkpoint(ssd300(backbone="resnet18", num_classes=3), tmp_path / "nope.ckpt")


def test_config_check_fails_early_on_a_missing_file_unless_resuming(tmp_path):
    """The file is read at fit start; validate_config raises then what reading it would raise later."""
    from ssd_lightning.cli.config_checks import validate_config

    missing = tmp_path / "nope.ckpt"
    cfg = compose_config([f"model.init_from={missing}"])
    with pytest.raises(
        CheckpointNotFoundError, match=r"model\.init_from=.*nope\.ckpt.*no such file"
    ) as early:
        validate_config(cfg, cuda_device_count=0)
    assert "point model.init_from at a .ckpt of a run of this project" in str(early.value)
    with pytest.raises(CheckpointNotFoundError) as late:
        init_from_checkpoint(ssd300(backbone="resnet18", num_classes=3), missing)
    assert str(late.value) == str(early.value)
    validate_config(compose_config([f"model.init_from={missing}", "ckpt_path=x.ckpt"]), cuda_device_count=0)


def test_nvidia_checkpoint_and_init_from_together_fail_in_the_constructor(tmp_path):
    """SSDLitModule refuses both files before reading either (validate_config leaves it to the module)."""
    from hydra.errors import InstantiationException

    from ssd_lightning.cli.config_checks import validate_config

    both = compose_config(
        [
            f"model.init_from={tmp_path / 'nope.ckpt'}",
            f"model.nvidia_checkpoint={tmp_path / 'n.pt'}",
            "ckpt_path=x.ckpt",
            "model.net.backbone=resnet18",
        ]
    )
    validate_config(both, cuda_device_count=0)
    with pytest.raises(InstantiationException) as info:
        hydra.utils.instantiate(both.model)
    assert isinstance(info.value.__cause__, ConfigError)
    assert re.search(
        r"model\.nvidia_checkpoint and model\.init_from are both set: .*; keep one", str(info.value.__cause__)
    )


# ------------------------------------------------------------------------------------------ through train()
class WeightsAtTrainStart(pl.Callback):
    """Records the module's state dict when training starts (after init_from / a resume, before step 1)."""

    seen: ClassVar[list[dict[str, torch.Tensor]]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        WeightsAtTrainStart.seen.append(
            {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        )


PROBE = f"+callbacks.probe._target_={__name__}.WeightsAtTrainStart"

SSD_RUN = [
    *SYNTHETIC_SSD_RUN,
    "data.steps_per_epoch=1",
    "model.lr_scaling.rule=none",
    "model.scheduler.warmup_steps=0",
    "seed=0",
]


def _net(state: dict[str, torch.Tensor], prefix: str = "net.") -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


@pytest.mark.slow
def test_fit_starts_from_the_file_and_a_resume_ignores_it(tmp_path):
    WeightsAtTrainStart.seen.clear()
    # 1. a real checkpoint of this project: 5 classes, one step
    source_run = [*SSD_RUN, "model.net.num_classes=5", "trainer.max_epochs=1"]
    train(train_config(source_run, output_dir=tmp_path / "source"))
    source_file = tmp_path / "source" / "checkpoints" / "last.ckpt"
    source = _net(load_checkpoint(source_file)["state_dict"])

    # 2. fine-tune it on 3 classes: the first step starts from the file's weights, heads re-initialised
    finetune = tmp_path / "finetune"
    init = [*SSD_RUN, "model.net.num_classes=3", f"model.init_from={source_file}", PROBE]
    train(train_config([*init, "trainer.max_epochs=1"], output_dir=finetune))
    at_start = _net(WeightsAtTrainStart.seen[-1])
    for key, value in at_start.items():
        if key in HEAD_KEYS:
            assert value.shape[0] == source[key].shape[0] // 5 * 3, key
        else:
            assert torch.equal(value, source[key]), key
    saved = last_checkpoint(finetune)
    assert saved["epoch"] == 0 and saved["global_step"] == 1  # no epoch/step state taken from the file
    assert saved["hyper_parameters"]["init_from"] == str(source_file)

    # 3. resume the fine-tuning run with the init file gone: the checkpoint's weights, not the file's
    source_file.unlink()
    resume = f"ckpt_path={finetune / 'checkpoints' / 'last.ckpt'}"
    train(train_config([*init, "trainer.max_epochs=2", resume], output_dir=finetune))
    resumed = _net(WeightsAtTrainStart.seen[-1])
    for key, value in _net(saved["state_dict"]).items():
        assert torch.equal(resumed[key], value), key
    assert last_checkpoint(finetune)["global_step"] == 2


def test_classifier_fit_starts_from_a_state_dict_and_ema_follows(tmp_path):
    WeightsAtTrainStart.seen.clear()
    source = _randomised(mobilenet_v2(width_mult=0.25, num_classes=10), seed=5)
    path = tmp_path / "imagenet_like.pth"
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, path)  # a DDP state dict
    overrides = [
        "data=synthetic_cls",
        "model=mobilenetv2",
        "callbacks=classification",
        "data.image_size=32",
        "data.batch_size=2",
        "data.steps_per_epoch=1",
        "model.net.num_classes=4",
        "model.net.width_mult=0.25",
        "model.ema_decay=0.9",
        f"model.init_from={path}",
        "trainer=cpu",
        "trainer.max_epochs=1",
        "+trainer.limit_val_batches=0",
        "+trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "eval_epochs=[]",
        "logger=csv",
        "seed=0",
        PROBE,
    ]
    train(train_config(overrides, output_dir=tmp_path / "run"))
    at_start = WeightsAtTrainStart.seen[-1]
    net, ema = _net(at_start), _net(at_start, "ema.module.")
    for key, value in source.state_dict().items():
        if key.startswith("classifier."):
            assert net[key].shape[0] == 4, key
        else:
            assert torch.equal(net[key], value), key
    assert all(torch.equal(ema[k], v) for k, v in net.items())  # the average starts from the loaded weights
