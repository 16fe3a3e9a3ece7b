"""SSD300 model: shapes, parameter counts, builder errors, and a tiny end-to-end overfit."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ssd_lightning.models import SSD300, BoxCoder, SSDLoss, dboxes300_coco, ssd300
from ssd_lightning.models.backbones import SSD_BACKBONES
from ssd_lightning.models.boxes import box_iou
from tests.helpers import encode_images


@pytest.mark.parametrize(("backbone", "params"), [("resnet50", 22_894_902), ("resnet18", 14_048_310)])
def test_parameter_counts(backbone, params):
    model = ssd300(backbone=backbone, num_classes=81)
    assert sum(p.numel() for p in model.parameters()) == params


@pytest.mark.parametrize(
    ("backbone", "channels"),
    [
        ("resnet18", [256, 512, 512, 256, 256, 128]),
        ("resnet34", [256, 512, 512, 256, 256, 256]),
        ("resnet50", [1024, 512, 512, 256, 256, 256]),
    ],
)
def test_level_channels_and_feature_sizes(backbone, channels):
    model = ssd300(backbone=backbone, num_classes=5).eval()
    assert model.out_channels == channels
    sizes = []
    hooks = [h.register_forward_hook(lambda m, i, o: sizes.append(tuple(o.shape[1:]))) for h in model.loc]
    hooks += [
        model.feature_extractor.register_forward_hook(lambda m, i, o: sizes.append(tuple(o[0].shape[1:])))
    ]
    with torch.no_grad():
        locs, logits = model(torch.randn(2, 3, 300, 300))
    for h in hooks:
        h.remove()
    assert locs.shape == (2, 4, 8732) and logits.shape == (2, 5, 8732)
    assert sizes[0] == (channels[0], 38, 38)  # conv4_x at stride 8
    assert [s[1:] for s in sizes[1:]] == [(38, 38), (19, 19), (10, 10), (5, 5), (3, 3), (1, 1)]
    assert [s[0] for s in sizes[1:]] == [nd * 4 for nd in (4, 6, 6, 6, 4, 4)]


def test_box_order_matches_reference_view():
    # Output box b of level 0 is channel (b // (H*W)) ... the reference's plain view of (N, nd*4, H, W).
    model = ssd300(backbone="resnet18", num_classes=3).eval()
    feats = {}
    model.loc[0].register_forward_hook(lambda m, i, o: feats.setdefault("loc0", o))
    with torch.no_grad():
        locs, _ = model(torch.randn(1, 3, 300, 300))
    expected = feats["loc0"].reshape(1, 4, -1)
    assert torch.equal(locs[:, :, : expected.shape[2]], expected)


def test_builder_errors_and_mobilenet():
    with pytest.raises(ValueError, match="unknown backbone 'vgg16'.*resnet50.*mobilenet_v2"):
        ssd300(backbone="vgg16")
    with pytest.raises(ValueError, match="weights_backbone='NOPE'"):
        ssd300(backbone="resnet18", weights_backbone="NOPE")
    pytest.importorskip("ssd_lightning.models.mobilenetv2")
    model = ssd300(backbone="mobilenet_v2", num_classes=4).eval()
    with torch.no_grad():
        locs, logits = model(torch.randn(1, 3, 300, 300))
    assert locs.shape == (1, 4, 8732) and logits.shape == (1, 4, 8732)
    assert model.out_channels[2:] == [512, 256, 256, 256]


def test_mobilenet_width_mult_thins_the_backbone_only(caplog):
    """width_mult=0.5: backbone taps of 6 x 16 and 6 x 48 channels (torchvision's rounding to multiples of 8),
    the same extra layers, heads per level and 8732 boxes; ResNets ignore it with a warning."""
    full = ssd300(backbone="mobilenet_v2", num_classes=5)
    half = ssd300(backbone="mobilenet_v2", num_classes=5, width_mult=0.5).eval()
    assert full.out_channels[:2] == [192, 576] and half.out_channels[:2] == [96, 288]
    assert half.out_channels[2:] == full.out_channels[2:]
    assert [h.out_channels for h in half.conf] == [h.out_channels for h in full.conf]

    def count(m):
        return sum(p.numel() for p in m.parameters())

    assert count(half.feature_extractor) < 0.35 * count(full.feature_extractor)
    assert count(half.additional_blocks) < count(full.additional_blocks)  # only the first extra block's input
    with torch.no_grad():
        locs, logits = half(torch.randn(1, 3, 300, 300))
    assert locs.shape == (1, 4, 8732) and logits.shape == (1, 5, 8732)
    # ResNets have no width multiplier (experiment=demo model.net.backbone=resnet18 carries the demo's 0.5)
    with caplog.at_level(logging.WARNING, logger="ssd_lightning.models.ssd300"):
        resnet = ssd300(backbone="resnet18", num_classes=5, width_mult=0.5)
    assert "width_mult=0.5 does not apply to the resnet18 backbone" in caplog.text
    assert resnet.out_channels == ssd300(backbone="resnet18", num_classes=5).out_channels


class _TinyBackbone(nn.Module):
    """A small backbone following the protocol: one 38x38 map for a 300x300 input."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.AvgPool2d(4),  # 300 -> 75
            nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),  # -> 38
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )  # fmt: skip
        self.out_channels = [64]

    def forward(self, x):
        return [self.body(x)]

    def stages(self):
        return [list(self.body[:4]), list(self.body[4:])]


def test_custom_backbone_and_argument_errors():
    with pytest.raises(ValueError, match="must equal the number of levels"):
        SSD300(_TinyBackbone(), [128, 128], num_classes=3)
    with pytest.raises(ValueError, match="num_classes"):
        SSD300(_TinyBackbone(), [128] * 5, num_classes=1)
    with pytest.raises(ValueError, match="background_prior must be in"):
        SSD300(_TinyBackbone(), [128] * 5, num_classes=3, background_prior=1.0)


def test_a_registered_backbone_is_built_by_name_frozen_by_stage_and_refuses_what_it_lacks():
    """One registration, nothing else: ssd300() builds it with its extra levels, the checkpoint record names
    it, model.freeze finds its stages; zero_init_residual on a backbone without residual branches is an
    error, not a silent no-op."""
    from ssd_lightning.models.backbones import SSDBackbone, register_backbone
    from ssd_lightning.modules.freezing import freeze_backbone

    register_backbone(
        "tiny", SSDBackbone(build=lambda **_: _TinyBackbone(), level_channels=(64, 96, 96, 64, 64, 32))
    )
    try:
        with pytest.raises(ValueError, match="registered already"):
            register_backbone("tiny", SSD_BACKBONES["tiny"])
        model = ssd300(backbone="tiny", num_classes=3).eval()
        assert model.out_channels == [64, 96, 96, 64, 64, 32]
        assert model.architecture["args"]["backbone"] == "tiny"
        with torch.no_grad():
            locs, logits = model(torch.randn(1, 3, 300, 300))
        assert locs.shape == (1, 4, 8732) and logits.shape == (1, 3, 8732)
        frozen = freeze_backbone(model, 1)
        assert frozen and not any(p.requires_grad for m in frozen for p in m.parameters())
        with pytest.raises(ValueError, match="zero_init_residual=True: the tiny backbone has no residual"):
            ssd300(backbone="tiny", num_classes=3, zero_init_residual=True)
    finally:
        SSD_BACKBONES.pop("tiny")


@pytest.mark.parametrize("prior", [0.99, 0.6])
def test_background_prior_sets_every_default_box(prior):
    # With the heads' weights zeroed only the biases speak: every one of the 8732 boxes must start at
    # p(background) = prior and share the rest equally; a bias laid out against the forward's
    # (class, default) channel order would give some boxes another class's bias.
    torch.manual_seed(0)
    model = SSD300(_TinyBackbone(), [128] * 5, num_classes=4, background_prior=prior).eval()
    for head in model.conf:
        nn.init.zeros_(head.weight)
    with torch.no_grad():
        probs = model(torch.randn(2, 3, 300, 300))[1].softmax(dim=1)
    expected = torch.tensor([prior] + [(1 - prior) / 3] * 3)
    torch.testing.assert_close(probs, expected[None, :, None].expand_as(probs))
    reference = SSD300(_TinyBackbone(), [128] * 5, num_classes=4)  # PyTorch-default biases, as NVIDIA's
    assert not torch.allclose(reference.conf[0].bias, torch.zeros_like(reference.conf[0].bias))


@pytest.mark.slow  # ~30-80 s on a shared 2-core CPU
def test_tiny_overfit_recovers_boxes():
    """Model + BoxCoder.encode + SSDLoss + decode end to end: 2 images, a few boxes each."""
    torch.manual_seed(0)
    coder = BoxCoder(dboxes300_coco())
    model = SSD300(_TinyBackbone(), [64, 64, 32, 32, 32], num_classes=3, extra_mid_channels=[32] * 5)
    loss_fn = SSDLoss(coder.default_boxes)
    gts = [
        torch.tensor([[0.1, 0.1, 0.45, 0.5], [0.6, 0.55, 0.9, 0.95]]),
        torch.tensor([[0.3, 0.2, 0.8, 0.7]]),
    ]
    labels = [torch.tensor([1, 2]), torch.tensor([2])]
    images = torch.rand(2, 3, 300, 300) * 0.2
    for img, boxes, labs in zip(images, gts, labels, strict=True):
        for (x0, y0, x1, y1), lab in zip((boxes * 300).long().tolist(), labs.tolist(), strict=True):
            img[lab - 1, y0:y1, x0:x1] = 1.0  # class 1 red, class 2 green
    gt_boxes, gt_labels = encode_images(coder, gts, labels)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(80):
        locs, logits = model(images)
        loss = loss_fn(locs, logits, gt_boxes, gt_labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0]
    model.eval()
    with torch.no_grad():
        dets = coder.decode(*model(images))
    for det, boxes, labs in zip(dets, gts, labels, strict=True):
        for box, lab in zip(boxes, labs.tolist(), strict=True):
            same_class = det["labels"] == lab
            assert same_class.any()
            best = box_iou(box[None], det["boxes"][same_class])[0].max()
            assert best > 0.5
        # The top detections are the planted objects (score-sorted, right labels).
        assert sorted(det["labels"][: len(labs)].tolist()) == sorted(labs.tolist())


@pytest.mark.parametrize(("backbone", "blocks"), [("resnet18", 6), ("mobilenet_v2", 8)])
def test_zero_init_residual_starts_blocks_as_identity(backbone, blocks):
    from torchvision.models.mobilenetv2 import InvertedResidual
    from torchvision.models.resnet import BasicBlock

    def first_skip_block(model):  # a block whose output is input + branch (no projection on the skip)
        return next(
            m
            for m in model.feature_extractor.modules()
            if (isinstance(m, BasicBlock) and m.downsample is None)
            or (isinstance(m, InvertedResidual) and m.use_res_connect)
        )

    torch.manual_seed(0)
    zeroed, plain = (ssd300(backbone=backbone, num_classes=3, zero_init_residual=z) for z in (True, False))
    block = first_skip_block(zeroed)
    channels = block.conv1.in_channels if isinstance(block, BasicBlock) else block.out_channels
    x = torch.randn(2, channels, 20, 20).relu()  # non-negative: a BasicBlock ends in ReLU
    with torch.no_grad():
        torch.testing.assert_close(block(x), x)
        assert (first_skip_block(plain)(x) - x).abs().max() > 0.1  # the default init is not the identity
    assert SSD_BACKBONES[backbone].zero_init(zeroed) == blocks  # every residual branch, counted once
