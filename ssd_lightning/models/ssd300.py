"""SSD300 v1.1: a backbone, extra feature blocks and per-level 3x3 prediction heads.

Submodule names follow the NVIDIA reference, so its checkpoints load key for key (:mod:`.nvidia`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ssd_lightning.models.backbones import SSD_BACKBONES

__all__ = ["SSD300", "ssd300", "EXTRA_MID_CHANNELS", "NUM_DEFAULTS"]

log = logging.getLogger(__name__)

#: Default boxes per location on each of the six levels.
NUM_DEFAULTS: tuple[int, ...] = (4, 6, 6, 6, 4, 4)
#: Mid (1x1 conv) channels of the extra block that produces level i, for i = 1..5.
EXTRA_MID_CHANNELS: tuple[int, ...] = (256, 256, 128, 128, 128)


def _extra_block(in_channels: int, mid_channels: int, out_channels: int, level: int) -> nn.Sequential:
    """1x1 conv + BN + ReLU, then 3x3 conv + BN + ReLU (stride 2 for levels 1-3, valid for 4-5)."""
    stride, padding = (2, 1) if level <= 3 else (1, 0)
    return nn.Sequential(
        nn.Conv2d(in_channels, mid_channels, kernel_size=1, bias=False),
        nn.BatchNorm2d(mid_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(mid_channels, out_channels, kernel_size=3, stride=stride, padding=padding, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class SSD300(nn.Module):
    """SSD300 over a backbone of :mod:`.backbones` (its maps are the first levels), ``extra_channels`` for
    the extra blocks' levels: images (N, 3, 300, 300) -> ``(locs (N, 4, 8732), logits (N, num_classes,
    8732))`` in :func:`dboxes300_coco` order; ``num_classes`` includes background. ``background_prior``:
    initial background probability through the class heads' biases (RetinaNet's prior; ``None``: the
    reference's), lowering the first steps' loss from scratch.
    """

    def __init__(
        self,
        backbone: nn.Module,
        extra_channels: Sequence[int],
        num_classes: int,
        extra_mid_channels: Sequence[int] = EXTRA_MID_CHANNELS,
        background_prior: float | None = None,
    ) -> None:
        super().__init__()
        backbone_channels = list(getattr(backbone, "out_channels", []))
        if not backbone_channels:
            raise ValueError("backbone must have a non-empty attribute out_channels: list[int]")
        channels = backbone_channels + list(extra_channels)
        if len(channels) != len(NUM_DEFAULTS):
            raise ValueError(
                f"backbone levels ({len(backbone_channels)}) + extra_channels ({len(extra_channels)}) "
                f"must equal the number of levels, {len(NUM_DEFAULTS)}"
            )
        if len(extra_mid_channels) != len(NUM_DEFAULTS) - 1:
            raise ValueError(
                f"extra_mid_channels needs {len(NUM_DEFAULTS) - 1} entries, got {len(extra_mid_channels)}"
            )
        if num_classes < 2:
            raise ValueError(f"num_classes counts the background too and must be >= 2, got {num_classes}")
        if background_prior is not None and not (
            isinstance(background_prior, float | int) and 0 < background_prior < 1
        ):
            raise ValueError(f"background_prior must be in (0, 1) or None, got {background_prior!r}")
        self.num_classes = num_classes
        self.num_defaults = list(NUM_DEFAULTS)
        self.out_channels = channels
        self.feature_extractor = backbone

        self.additional_blocks = nn.ModuleList(
            _extra_block(channels[level - 1], extra_mid_channels[level - 1], channels[level], level)
            for level in range(len(backbone_channels), len(channels))
        )
        levels = list(zip(channels, self.num_defaults, strict=True))
        self.loc = nn.ModuleList(nn.Conv2d(c, nd * 4, 3, padding=1) for c, nd in levels)
        self.conf = nn.ModuleList(nn.Conv2d(c, nd * num_classes, 3, padding=1) for c, nd in levels)
        for module in (self.additional_blocks, self.loc, self.conf):
            for param in module.parameters():
                if param.dim() > 1:
                    nn.init.xavier_uniform_(param)
        if background_prior is not None:
            # softmax(b, 0, ..., 0)[0] = background_prior for b = log(prior * (C - 1) / (1 - prior))
            background_bias = math.log(background_prior * (num_classes - 1) / (1 - background_prior))
            for head, nd in zip(self.conf, self.num_defaults, strict=True):
                bias = head.bias.data.view(num_classes, nd)  # channel = class * nd + default (see forward)
                bias.zero_()
                bias[0] = background_bias

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(N, 3, 300, 300) -> (locs (N, 4, B), logits (N, num_classes, B)), B = 8732."""
        features = list(self.feature_extractor(images))
        x = features[-1]
        for block in self.additional_blocks:
            x = block(x)
            features.append(x)
        n = images.shape[0]
        locs, logits = [], []
        for feature, loc_head, conf_head in zip(features, self.loc, self.conf, strict=True):
            # (N, nd*4, H, W) -> (N, 4, nd*H*W): the reference's plain view, which fixes the box order.
            locs.append(loc_head(feature).reshape(n, 4, -1))
            logits.append(conf_head(feature).reshape(n, self.num_classes, -1))
        return torch.cat(locs, dim=2).contiguous(), torch.cat(logits, dim=2).contiguous()


def ssd300(
    *,
    backbone: str = "resnet50",
    num_classes: int = 81,
    weights_backbone: str | None = None,
    background_prior: float | None = None,
    zero_init_residual: bool = False,
    width_mult: float = 1.0,
) -> SSD300:
    """SSD300 v1.1 on the backbone named ``backbone`` in :data:`~.backbones.SSD_BACKBONES`.
    ``zero_init_residual``: a random backbone's residual blocks start as the identity (the CPU demo: AP@0.5
    0.44, not 0.33, after 948 steps); ``width_mult``: ``mobilenet_v2``'s channel multiplier (others: full)."""
    spec = SSD_BACKBONES.get(backbone)
    if spec is None:
        raise ValueError(f"unknown backbone {backbone!r}; expected one of {list(SSD_BACKBONES)}")
    if not isinstance(num_classes, int) or isinstance(num_classes, bool):  # checked before any weight is read
        raise ValueError(f"num_classes must be an integer (background included), got {num_classes!r}")
    if width_mult != 1.0 and not spec.width:  # e.g. experiment=demo model.net.backbone=resnet18
        log.warning("width_mult=%s does not apply to the %s backbone: it is built at full width",
                    width_mult, backbone)  # fmt: skip
        width_mult = 1.0
    if not isinstance(zero_init_residual, bool):
        raise ValueError(f"zero_init_residual must be True or False, got {zero_init_residual!r}")
    if zero_init_residual and spec.zero_init is None:
        raise ValueError(f"zero_init_residual=True: the {backbone} backbone has no residual branches to zero")
    net = spec.build(weights=weights_backbone, width_mult=width_mult)
    if zero_init_residual and weights_backbone is None:
        spec.zero_init(net)
    elif zero_init_residual:
        log.info("zero_init_residual skipped: the backbone starts from weights %s", weights_backbone)
    extra = spec.level_channels[len(net.out_channels) :]
    model = SSD300(net, extra, num_classes, background_prior=background_prior)
    model.backbone_name = backbone  # recorded for checkpoint import and benchmark reports
    # what rebuilds it (models/registry.py); the arguments that only initialise weights are left out
    args = {"backbone": backbone, "num_classes": int(num_classes), "width_mult": float(width_mult)}
    model.architecture = {"builder": "ssd300", "args": args}
    return model
