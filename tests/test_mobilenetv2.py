"""MobileNetV2 builder and SSD backbone: parameter counts, torchvision equivalence, weight loading, taps."""

from __future__ import annotations

import logging

import pytest
import torch
import torchvision
from torchvision.models import MobileNet_V2_Weights

from ssd_lightning.models.mobilenetv2 import (
    DEFAULT_INVERTED_RESIDUAL_SETTING,
    MobileNetV2SSDBackbone,
    mobilenet_v2,
    resolve_weights,
)
from ssd_lightning.modules.nets import build_mobilenet_v2


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    ("width_mult", "expected"),
    [(1.0, 3_504_872), (0.75, 2_636_424), (0.5, 1_968_680), (1.4, 6_108_776)],
)
def test_parameter_counts(width_mult, expected):
    assert _num_params(mobilenet_v2(width_mult=width_mult)) == expected


def test_default_table_is_the_papers():
    # Table 2 of Sandler et al. 2018, rows of t (expansion), c (channels), n (repeats), s (first stride)
    paper = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2]]
    paper += [[6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]
    assert paper == DEFAULT_INVERTED_RESIDUAL_SETTING
    model = mobilenet_v2()
    assert isinstance(model, torchvision.models.MobileNetV2)
    assert model.features[0][0].out_channels == 32 and model.last_channel == 1280
    assert sum(isinstance(m, torch.nn.ReLU6) for m in model.modules()) == 35  # 1 stem + 2*16 blocks + 1 head
    # An explicit copy of the default table builds the same network.
    explicit = mobilenet_v2(inverted_residual_setting=[list(r) for r in DEFAULT_INVERTED_RESIDUAL_SETTING])
    assert {k: v.shape for k, v in explicit.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()
    }


def test_torchvision_state_dict_round_trip_gives_same_outputs():
    torch.manual_seed(0)
    reference = torchvision.models.mobilenet_v2().eval()
    ours = mobilenet_v2().eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=0)


def test_pretrained_path_with_ddp_prefix(tmp_path):
    torch.manual_seed(1)
    reference = torchvision.models.mobilenet_v2(num_classes=7).eval()
    path = tmp_path / "ddp.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in reference.state_dict().items()}}, path)
    ours = build_mobilenet_v2(num_classes=7, pretrained_path=path).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=0)


def test_pretrained_path_lightning_checkpoint_picks_net_not_ema(tmp_path):
    torch.manual_seed(2)
    net = torchvision.models.mobilenet_v2(width_mult=0.5, num_classes=4)
    other = torchvision.models.mobilenet_v2(width_mult=0.5, num_classes=4)
    state = {f"net.{k}": v for k, v in net.state_dict().items()}
    state |= {f"ema.module.{k}": v for k, v in other.state_dict().items()}
    state |= {"ema.n_averaged": torch.tensor(3), "acc1_best": torch.tensor(0.5)}
    path = tmp_path / "last.ckpt"
    # a class in the hyper-parameters: loads only when trusted
    torch.save({"state_dict": state, "hyper_parameters": {"optimizer": torch.optim.SGD}}, path)
    ours = build_mobilenet_v2(width_mult=0.5, num_classes=4, pretrained_path=path, trust_checkpoint=True)
    for key, value in net.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def test_pretrained_path_other_class_count_skips_classifier(tmp_path, caplog):
    torch.manual_seed(3)
    reference = torchvision.models.mobilenet_v2(width_mult=0.5)  # 1000 classes
    path = tmp_path / "imagenet.pth"
    torch.save(reference.state_dict(), path)
    with caplog.at_level(logging.INFO, logger="ssd_lightning.models.mobilenetv2"):
        ours = build_mobilenet_v2(width_mult=0.5, num_classes=10, pretrained_path=path)
    assert "1000-class classifier" in caplog.text and "10 classes" in caplog.text
    assert ours.classifier[1].out_features == 10
    for key, value in reference.features.state_dict().items():
        assert torch.equal(ours.features.state_dict()[key], value), key


def test_pretrained_path_mismatch_lists_keys(tmp_path):
    path = tmp_path / "wide.pth"
    state = torchvision.models.mobilenet_v2(width_mult=0.5).state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["features.0.0.weight"]
    torch.save(state, path)
    with pytest.raises(ValueError) as err:
        build_mobilenet_v2(width_mult=1.0, pretrained_path=path)
    message = str(err.value)
    assert "missing (1): ['features.0.0.weight']" in message
    assert "unexpected (1): ['extra.weight']" in message
    assert "shape mismatch" in message and "features.0.1.weight: checkpoint (16,) vs model (32,)" in message


def test_pretrained_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="pretrained_path="):
        build_mobilenet_v2(pretrained_path=tmp_path / "nope.pth")
    bad = tmp_path / "bad.pth"
    torch.save({"epoch": 3}, bad)
    with pytest.raises(ValueError, match="holds no state dict"):
        build_mobilenet_v2(pretrained_path=bad)


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ([], r"must not be empty"),
        ("1,16,1,1", r"list of \[t, c, n, s\] rows"),
        (
            [[1, 16, 1, 1], [6, 24, 2]],
            r"inverted_residual_setting\[1\] must be a .* list of 4 ints",
        ),
        ([[1, 16, 1, 1], [6, 24.0, 2, 2]], r"inverted_residual_setting\[1\] must be .* 4 ints"),
        ([[1, 16, 1, 1], 6], r"inverted_residual_setting\[1\] must be"),
        ([[0, 16, 1, 1]], r"inverted_residual_setting\[0\] = \[0, 16, 1, 1\].*positive"),
        ([[1, 16, 0, 1]], r"inverted_residual_setting\[0\].*positive"),
        (
            [[1, 16, 1, 1], [6, 24, 2, 3]],
            r"setting\[1\] = \[6, 24, 2, 3\].*stride s must be 1 or 2",
        ),
    ],
)
def test_inverted_residual_setting_validation(setting, match):
    with pytest.raises(ValueError, match=match):
        mobilenet_v2(inverted_residual_setting=setting)


def test_custom_inverted_residual_setting_builds_and_runs():
    model = mobilenet_v2(num_classes=3, inverted_residual_setting=[[1, 16, 1, 1], [6, 24, 2, 2]]).eval()
    assert len(model.features) == 1 + 3 + 1
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_other_argument_validation():
    for kwargs, match in [
        ({"num_classes": 0}, "num_classes"),
        ({"width_mult": 0.0}, "width_mult"),
        ({"dropout": 1.0}, "dropout"),
        ({"round_nearest": 0}, "round_nearest"),
    ]:
        with pytest.raises(ValueError, match=match):
            mobilenet_v2(**kwargs)


def test_weights_name_resolution_without_download(tmp_path):
    assert resolve_weights(None) is None
    assert resolve_weights("IMAGENET1K_V1") is MobileNet_V2_Weights.IMAGENET1K_V1
    assert resolve_weights("IMAGENET1K_V2") is MobileNet_V2_Weights.IMAGENET1K_V2
    assert resolve_weights("MobileNet_V2_Weights.IMAGENET1K_V1") is MobileNet_V2_Weights.IMAGENET1K_V1
    with pytest.raises(ValueError, match=r"weights='IMAGENET1K_V3'.*IMAGENET1K_V1"):
        resolve_weights("IMAGENET1K_V3")
    # Checks that need no download fail before torchvision is asked for the file.
    with pytest.raises(ValueError, match="width_mult=1.0"):
        mobilenet_v2(weights="IMAGENET1K_V1", width_mult=0.5)
    with pytest.raises(ValueError, match="not both"):
        build_mobilenet_v2(weights="IMAGENET1K_V1", pretrained_path=tmp_path / "x.pth")
    with pytest.raises(ValueError, match="weights="):
        MobileNetV2SSDBackbone(weights="imagenet")


@pytest.mark.parametrize(("width_mult", "channels"), [(1.0, [192, 576]), (0.5, [96, 288])])
def test_ssd_backbone_taps(width_mult, channels):
    backbone = MobileNetV2SSDBackbone(width_mult=width_mult).eval()
    assert backbone.out_channels == channels
    with torch.no_grad():
        maps = backbone(torch.randn(2, 3, 300, 300))
    assert [tuple(m.shape) for m in maps] == [(2, channels[0], 38, 38), (2, channels[1], 19, 19)]
    assert all((m >= 0).all() and (m <= 6).all() for m in maps)  # taps are ReLU6 expansion outputs


def test_ssd_backbone_matches_classifier_features(tmp_path):
    """Taps equal the expansion outputs computed through torchvision's own modules."""
    torch.manual_seed(4)
    reference = torchvision.models.mobilenet_v2().eval()
    path = tmp_path / "tv.pth"
    torch.save(reference.state_dict(), path)
    backbone = MobileNetV2SSDBackbone(classifier=build_mobilenet_v2(pretrained_path=path)).eval()
    x = torch.randn(1, 3, 300, 300)
    with torch.no_grad():
        f = reference.features
        tap1 = f[7].conv[0](f[:7](x))
        tap2 = f[14].conv[0](f[8:14](f[7](f[:7](x))))
        got = backbone(x)
    torch.testing.assert_close(got[0], tap1, rtol=0, atol=0)
    torch.testing.assert_close(got[1], tap2, rtol=0, atol=0)
    # Only the layers up to the second tap are kept.
    assert _num_params(backbone) < _num_params(reference.features) / 2


def test_ssd300_with_mobilenet_v2_backbone():
    ssd300_module = pytest.importorskip("ssd_lightning.models.ssd300")
    model = ssd300_module.ssd300(backbone="mobilenet_v2", num_classes=5).eval()
    with torch.no_grad():
        locs, logits = model(torch.randn(2, 3, 300, 300))
    assert locs.shape == (2, 4, 8732)
    assert logits.shape == (2, 5, 8732)


def test_weights_are_loaded_through_torchvision_enum(monkeypatch):
    """The torchvision download is replaced by a local state dict; the loading path is ours."""
    torch.manual_seed(5)
    fake = torchvision.models.mobilenet_v2().state_dict()  # 1000 classes, like the real file
    calls = []

    def fake_get_state_dict(self, *args, **kwargs):
        calls.append(self.name)
        return fake

    monkeypatch.setattr(MobileNet_V2_Weights, "get_state_dict", fake_get_state_dict)
    model = mobilenet_v2(weights="IMAGENET1K_V2", num_classes=10)
    assert calls == ["IMAGENET1K_V2"]
    assert model.classifier[1].out_features == 10
    for key, value in fake.items():
        if not key.startswith("classifier."):
            assert torch.equal(model.state_dict()[key], value), key
    backbone = MobileNetV2SSDBackbone(weights="IMAGENET1K_V1")
    assert calls[-1] == "IMAGENET1K_V1"
    assert torch.equal(backbone.stage1[0][0].weight, fake["features.0.0.weight"])
