"""Where the DALI pipelines run: ``data.device=auto`` follows the trainer's device, not CUDA's presence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ssd_lightning.data.dali_datamodule import pipeline_device


def _module(root_device: str | None):
    trainer = (
        None
        if root_device is None
        else SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(root_device)))
    )
    return SimpleNamespace(trainer=trainer)


@pytest.fixture
def cuda_machine(monkeypatch):
    """Pretend this is a machine with CUDA, current device 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize(
    ("root_device", "expected"),
    [
        ("cpu", ("cpu", None)),  # trainer=cpu / ddp_cpu on a GPU machine: never GPU pipelines, never device 1
        ("cuda:3", ("gpu", 3)),  # rank on GPU 3 decodes on GPU 3
        ("cuda", ("gpu", 0)),  # no index: the current device
        (None, ("gpu", 0)),  # no trainer: CUDA's presence decides
    ],
)
def test_auto_follows_the_trainer(cuda_machine, root_device, expected):
    assert pipeline_device(_module(root_device), "auto") == expected


def test_explicit_devices(cuda_machine):
    assert pipeline_device(_module("cuda:1"), "cpu") == ("cpu", None)
    assert pipeline_device(_module("cuda:1"), "gpu") == ("gpu", 1)
    assert pipeline_device(_module(None), "gpu") == ("gpu", 0)
    with pytest.raises(ValueError, match="the trainer runs on the CPU"):
        pipeline_device(_module("cpu"), "gpu")


def test_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pipeline_device(_module(None), "auto") == ("cpu", None)
    assert pipeline_device(_module("cpu"), "auto") == ("cpu", None)
    with pytest.raises(ValueError, match="data.device='gpu' needs CUDA"):
        pipeline_device(_module("cpu"), "gpu")
    with pytest.raises(ValueError, match="device must be"):
        pipeline_device(_module(None), "cuda")
