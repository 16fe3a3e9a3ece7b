"""Import of NVIDIA SSD300 checkpoints: every saved layout round-trips into ssd300() with strict=True."""

from __future__ import annotations

import pytest
import torch
from reference_ssd import RefResNet, RefSSD300, ref_unwrap_distributed

from ssd_lightning.inference.detector import load_nvidia_checkpoint
from ssd_lightning.models import ssd300


def _randomised_reference(backbone: str) -> RefSSD300:
    torch.manual_seed(0)
    model = RefSSD300(RefResNet(backbone), label_num=81)
    with torch.no_grad():  # non-trivial BN statistics and weights everywhere
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5 if "running_var" in name else torch.randn_like(t) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def reference_resnet18():
    model = _randomised_reference("resnet18")
    x = torch.randn(1, 3, 300, 300)
    with torch.no_grad():
        out = model(x)
    return model, x, out


def _layouts(sd: dict) -> dict[str, object]:
    return {
        "plain state dict": sd,
        "main.py --save": {
            "epoch": 3,
            "iteration": 100,
            "optimizer": {},
            "scheduler": {},
            "label_map": {},
            "model": sd,
        },
        "DDP module. prefix": {"model": {f"module.{k}": v for k, v in sd.items()}},
        "hub module.1. prefix": {"model": {f"module.1.{k}": v for k, v in sd.items()}},
    }


@pytest.mark.parametrize(
    "layout", ["plain state dict", "main.py --save", "DDP module. prefix", "hub module.1. prefix"]
)
def test_round_trip_resnet18(reference_resnet18, layout, tmp_path):
    ref, x, (ref_locs, ref_logits) = reference_resnet18
    path = tmp_path / "ckpt.pt"
    torch.save(_layouts(ref.state_dict())[layout], path)
    state = load_nvidia_checkpoint(path, backbone="resnet18")
    model = ssd300(backbone="resnet18", num_classes=81).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        locs, logits = model(x)
    torch.testing.assert_close(locs, ref_locs, rtol=0, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)


def test_round_trip_resnet50_hub_format():
    ref = _randomised_reference("resnet50")
    sd = {f"module.{k}": v.half() if v.is_floating_point() else v for k, v in ref.state_dict().items()}
    ckpt = {"model": sd}  # as torch.hub nvidia_ssd reads it: ckpt["model"], unwrap_distributed
    # Our prefix handling agrees with the reference's unwrap_distributed.
    assert set(load_nvidia_checkpoint(ckpt)) == set(ref_unwrap_distributed(sd))
    model = ssd300(backbone="resnet50").eval()
    model.load_state_dict(load_nvidia_checkpoint(ckpt), strict=True)
    ref.load_state_dict(ref_unwrap_distributed(sd))  # the same fp16-rounded weights
    x = torch.randn(1, 3, 300, 300)
    with torch.no_grad():
        for a, b in zip(model(x), ref(x), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_mismatches_raise_clear_errors(reference_resnet18, tmp_path):
    ref = reference_resnet18[0]
    with pytest.raises(
        ValueError,
        match=r"does not fit ssd300\(backbone='resnet50'.*missing \(\d+\).*unexpected \(\d+\).*backbone",
    ):
        load_nvidia_checkpoint(ref.state_dict(), backbone="resnet50")
    with pytest.raises(ValueError, match=r"does not fit ssd300.*shape mismatch \(\d+\).*conf\.0\.weight"):
        load_nvidia_checkpoint(ref.state_dict(), backbone="resnet18", num_classes=21)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_nvidia_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="expected a checkpoint dict"):
        load_nvidia_checkpoint([1, 2])  # type: ignore[arg-type]
