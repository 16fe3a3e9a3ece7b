"""No loader of weight files runs code from the file unless told to trust it (issue #17, item 6).

The payload is real: :class:`CreatesFile` unpickles as ``open(path, "w")``, and a control test shows that full
unpickling does create the file. Each loader then gets a checkpoint carrying it and must refuse it, naming
``trust_checkpoint``, with no file created; with ``trust_checkpoint=True`` a harmless checkpoint that also
needs full unpickling loads.
"""

from __future__ import annotations

import argparse
import functools
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ssd_lightning.inference.detector import load_detector, load_nvidia_checkpoint
from ssd_lightning.io.checkpoint_io import AtomicCheckpointIO
from ssd_lightning.io.weights import (
    CheckpointNotFoundError,
    CheckpointReadError,
    UntrustedCheckpointError,
    init_from_checkpoint,
    read_checkpoint,
)
from ssd_lightning.models import mobilenet_v2, ssd300
from ssd_lightning.modules.nets import build_mobilenet_v2
from ssd_lightning.modules.ssd import SSDLitModule
from tests.helpers import REPO_ROOT


class CreatesFile:
    """Unpickles as ``open(path, "w")``: a stand-in for any code a crafted checkpoint could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.fixture(scope="module")
def small_ssd() -> torch.nn.Module:
    torch.manual_seed(0)
    return ssd300(backbone="resnet18", num_classes=3)


@pytest.fixture(scope="module")
def small_mobilenet() -> torch.nn.Module:
    torch.manual_seed(0)
    return mobilenet_v2(width_mult=0.25, num_classes=4)


def _malicious(tmp_path: Path, state: dict) -> tuple[Path, Path]:
    """``state`` plus the payload in one file; returns (the file, the file the payload would create)."""
    marker = tmp_path / "pwned"
    path = tmp_path / "crafted.pt"
    torch.save({**state, "args": CreatesFile(marker)}, path)
    return path, marker


def _harmless(tmp_path: Path, state: dict) -> Path:
    """Needs full unpickling (a partial optimizer, as older Lightning hparams held) but runs nothing."""
    path = tmp_path / "trusted.pt"
    torch.save({**state, "hyper_parameters": {"optimizer": functools.partial(torch.optim.SGD, lr=0.1)}}, path)
    return path


def _assert_refused(error: pytest.ExceptionInfo, path: Path, marker: Path) -> None:
    message = str(error.value)
    assert str(path) in message and "trust_checkpoint=true" in message, message
    assert "builtins.open" in message or "io.open" in message, message  # names what the file wanted to call
    assert not marker.exists(), "the crafted checkpoint ran code while loading"


def test_the_payload_really_creates_a_file_when_unpickled(tmp_path):
    path, marker = _malicious(tmp_path, {"model": {}})
    torch.load(path, weights_only=False)
    assert marker.exists()


# ------------------------------------------------------------------------------------------ each loader
def test_read_checkpoint(tmp_path):
    path, marker = _malicious(tmp_path, {"state_dict": {"w": torch.ones(2)}})
    with pytest.raises(UntrustedCheckpointError) as error:
        read_checkpoint(path, what="model.init_from")
    _assert_refused(error, path, marker)
    assert "model.init_from=" in str(error.value)
    loaded = read_checkpoint(_harmless(tmp_path, {"state_dict": {"w": torch.ones(2)}}), trust_checkpoint=True)
    assert loaded["hyper_parameters"]["optimizer"].keywords == {"lr": 0.1}


def test_nvidia_checkpoint(tmp_path, small_ssd):
    layout = {"epoch": 3, "model": {f"module.{k}": v for k, v in small_ssd.state_dict().items()}}
    path, marker = _malicious(tmp_path, layout)
    with pytest.raises(UntrustedCheckpointError) as error:
        load_nvidia_checkpoint(path, backbone="resnet18", num_classes=3)
    _assert_refused(error, path, marker)
    state = load_nvidia_checkpoint(
        _harmless(tmp_path, layout), backbone="resnet18", num_classes=3, trust_checkpoint=True
    )
    assert all(torch.equal(state[k], v) for k, v in small_ssd.state_dict().items())


def test_nvidia_checkpoint_through_the_lightning_module(tmp_path, small_ssd):
    path, marker = _malicious(tmp_path, {"model": small_ssd.state_dict()})
    with pytest.raises(UntrustedCheckpointError) as error:
        SSDLitModule(small_ssd, optimizer=torch.optim.SGD, nvidia_checkpoint=path)
    _assert_refused(error, path, marker)


def test_nvidia_main_py_checkpoint_loads_without_trust(tmp_path, small_ssd):
    """What the reference's main.py --save writes (optimizer, MultiStepLR, label map, its args Namespace)."""
    optimizer = torch.optim.SGD(small_ssd.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[43, 54], gamma=0.1)
    path = tmp_path / "epoch_3.pt"
    checkpoint = {
        "epoch": 4,
        "iteration": 1000,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),  # milestones: a collections.Counter
        "label_map": {1: "person", 2: "bicycle"},
        "args": argparse.Namespace(backbone="resnet18", multistep=[43, 54], amp=True),
        "model": small_ssd.state_dict(),
    }
    torch.save(checkpoint, path)
    assert read_checkpoint(path)["args"].multistep == [43, 54]
    state = load_nvidia_checkpoint(path, backbone="resnet18", num_classes=3)
    assert set(state) == set(small_ssd.state_dict())


def test_mobilenet_pretrained_path(tmp_path, small_mobilenet):
    layout = {"state_dict": {f"net.{k}": v for k, v in small_mobilenet.state_dict().items()}}
    path, marker = _malicious(tmp_path, layout)
    with pytest.raises(UntrustedCheckpointError) as error:
        build_mobilenet_v2(width_mult=0.25, num_classes=4, pretrained_path=path)
    _assert_refused(error, path, marker)
    assert "pretrained_path=" in str(error.value)
    net = build_mobilenet_v2(
        width_mult=0.25, num_classes=4, pretrained_path=_harmless(tmp_path, layout), trust_checkpoint=True
    )
    assert torch.equal(net.classifier[1].weight, small_mobilenet.classifier[1].weight)


def test_init_from(tmp_path, small_ssd):
    layout = {"state_dict": {f"net.{k}": v for k, v in small_ssd.state_dict().items()}}
    path, marker = _malicious(tmp_path, layout)
    torch.manual_seed(1)
    net = ssd300(backbone="resnet18", num_classes=3)
    with pytest.raises(UntrustedCheckpointError) as error:
        init_from_checkpoint(net, path)
    _assert_refused(error, path, marker)
    report = init_from_checkpoint(net, _harmless(tmp_path, layout), trust_checkpoint=True)
    assert report.loaded_fraction == 1.0
    assert torch.equal(net.conf[0].weight, small_ssd.conf[0].weight)


def _run_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    net = {"_target_": "ssd_lightning.models.ssd300", "backbone": "resnet18", "num_classes": 3}
    path.write_text(OmegaConf.to_yaml({"model": {"net": net}}))
    return path


def test_predict_ckpt_path(tmp_path, small_ssd):
    layout = {"state_dict": {f"net.{k}": v for k, v in small_ssd.state_dict().items()}}
    path, marker = _malicious(tmp_path, layout)
    with pytest.raises(UntrustedCheckpointError) as error:
        load_detector(path, run_config=_run_config(tmp_path))
    _assert_refused(error, path, marker)
    assert "ckpt_path=" in str(error.value)
    detector = load_detector(
        _harmless(tmp_path, layout), run_config=_run_config(tmp_path), trust_checkpoint=True
    )
    assert torch.equal(detector.net.conf[0].weight, small_ssd.conf[0].weight)


def test_predict_nvidia_checkpoint(tmp_path, small_ssd):
    path, marker = _malicious(tmp_path, {"model": small_ssd.state_dict()})
    with pytest.raises(UntrustedCheckpointError) as error:
        load_detector(nvidia_checkpoint=path, backbone="resnet18", num_classes=3)
    _assert_refused(error, path, marker)


def test_export_onnx_script(tmp_path, small_ssd, monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the error itself, not its one-line message
    spec = spec_from_file_location("export_onnx", REPO_ROOT / "scripts" / "export_onnx.py")
    script = module_from_spec(spec)
    spec.loader.exec_module(script)
    path, marker = _malicious(tmp_path, {"model": small_ssd.state_dict()})
    args = [
        f"nvidia_checkpoint={path}",
        "backbone=resnet18",
        "num_classes=3",
        f"output={tmp_path / 'm.onnx'}",
    ]
    with pytest.raises(UntrustedCheckpointError) as error:
        script.main(args)
    _assert_refused(error, path, marker)
    assert not (tmp_path / "m.onnx").exists()


def test_resume_checkpoint_io(tmp_path):
    path, marker = _malicious(tmp_path, {"state_dict": {"w": torch.ones(2)}, "epoch": 1})
    with pytest.raises(UntrustedCheckpointError) as error:
        AtomicCheckpointIO().load_checkpoint(path)
    _assert_refused(error, path, marker)
    assert "ckpt_path=" in str(error.value)
    trusted = AtomicCheckpointIO(trust_checkpoint=True).load_checkpoint(_harmless(tmp_path, {"epoch": 1}))
    assert trusted["epoch"] == 1


def test_resume_through_train_refuses_a_crafted_checkpoint(tmp_path, make_cfg):
    """``ckpt_path=`` goes through the Trainer's checkpoint IO: refused before anything of the file runs."""
    path, marker = _malicious(tmp_path, {"state_dict": {}, "epoch": 0, "global_step": 0})
    cfg = make_cfg(
        [
            "data=synthetic",
            "data.batch_size=2",
            "data.steps_per_epoch=1",
            "model.net.backbone=resnet18",
            "model.net.num_classes=3",
            "trainer=cpu",
            "trainer.max_epochs=1",
            "+trainer.limit_val_batches=0",
            "~callbacks.coco_map",
            "eval_epochs=[]",
            "logger=csv",
            f"ckpt_path={path}",
        ]
    )
    from ssd_lightning.cli.train import train

    with pytest.raises(UntrustedCheckpointError) as error:
        train(cfg)
    _assert_refused(error, path, marker)


# ------------------------------------------------------------------------------------------ other errors
def test_missing_and_unreadable_files_say_which(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"model\.init_from=.*nope\.pt not found"):
        read_checkpoint(tmp_path / "nope.pt", what="model.init_from")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointReadError, match=r"model\.init_from=.*garbage\.pt is not a checkpoint"):
        read_checkpoint(garbage, what="model.init_from")
