"""SSD300 backbones by name (:data:`SSD_BACKBONES`), and the ResNet ones (conv4_x at stride 8, as in NVIDIA
SSD300 v1.1).

A backbone's ``forward(images)`` returns the first SSD levels (``list[Tensor]``), ``out_channels`` their
channels, ``stages()`` its parts in order (``model.freeze``); a new one calls :func:`register_backbone`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn
from torchvision.models import get_model_weights, resnet
from torchvision.models.resnet import BasicBlock, Bottleneck

__all__ = ["RESNET_NAMES", "SSD_BACKBONES", "ResNetBackbone", "SSDBackbone", "register_backbone",
           "resnet_backbone", "zero_init_resnet_blocks"]  # fmt: skip


@dataclass(frozen=True)
class SSDBackbone:
    """What ``ssd300()`` needs to know about a backbone: ``build(weights=, width_mult=)`` -> the module;
    ``level_channels`` of the six SSD levels (the backbone's own first, then extra blocks'); ``zero_init``
    zeroes each residual branch's last norm, returning how many (``None``: none to zero); ``width``:
    whether ``width_mult`` applies."""

    build: Callable[..., nn.Module]
    level_channels: tuple[int, ...]
    zero_init: Callable[[nn.Module], int] | None = None
    width: bool = False


#: Backbone name (``model.net.backbone``) -> its :class:`SSDBackbone`, in registration order.
SSD_BACKBONES: dict[str, SSDBackbone] = {}


def register_backbone(name: str, backbone: SSDBackbone) -> None:
    """Make ``ssd300(backbone=name)`` build ``backbone``; a name is registered once."""
    if name in SSD_BACKBONES:
        raise ValueError(f"SSD backbone {name!r} is registered already")
    SSD_BACKBONES[name] = backbone


#: Accepted ResNet names and the channels of the six SSD levels with each: conv4_x (layer3), then extras.
RESNET_NAMES: dict[str, tuple[int, ...]] = {
    "resnet18": (256, 512, 512, 256, 256, 128),
    "resnet34": (256, 512, 512, 256, 256, 256),
    "resnet50": (1024, 512, 512, 256, 256, 256),
    "resnet101": (1024, 512, 512, 256, 256, 256),
    "resnet152": (1024, 512, 512, 256, 256, 256),
}


class ResNetBackbone(nn.Module):
    """ResNet up to conv4_x, its first block at stride 1: (N, 3, 300, 300) -> [(N, C, 38, 38)], C = 256 or
    1024; ``feature_extractor`` as in the NVIDIA reference."""

    def __init__(self, net: resnet.ResNet) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(*list(net.children())[:7])
        first_block = self.feature_extractor[-1][0]
        # BasicBlock strides in conv1, Bottleneck (torchvision >= 0.5, "ResNet v1.5") in conv2.
        for conv in (first_block.conv1, first_block.conv2, first_block.downsample[0]):
            conv.stride = (1, 1)
        self.out_channels: list[int] = [first_block.downsample[0].out_channels]

    def forward(self, images: Tensor) -> list[Tensor]:
        return [self.feature_extractor(images)]

    def stages(self) -> list[list[nn.Module]]:
        """For ``model.freeze``: the stem (conv1, bn1), conv2_x, conv3_x, conv4_x."""
        conv1, bn1, _relu, _maxpool, layer1, layer2, layer3 = self.feature_extractor
        return [[conv1, bn1], [layer1], [layer2], [layer3]]


def resnet_backbone(name: str, *, weights: str | None = None) -> ResNetBackbone:
    """A :class:`ResNetBackbone` of torchvision's ``name``, ``weights`` e.g. ``"IMAGENET1K_V2"``."""
    if name not in RESNET_NAMES:
        raise ValueError(f"unknown ResNet backbone {name!r}; expected one of {sorted(RESNET_NAMES)}")
    builder = getattr(resnet, name)
    if weights is not None:
        enum = get_model_weights(builder)
        try:
            weights = enum[weights]
        except KeyError:
            raise ValueError(
                f"weights_backbone={weights!r} is not a weights name of {name}; "
                f"expected one of {[w.name for w in enum]} or None"
            ) from None
    return ResNetBackbone(builder(weights=weights))


def zero_init_resnet_blocks(module: nn.Module) -> int:
    """Zero every ResNet block's last BatchNorm scale (torchvision's ``zero_init_residual``); how many."""
    blocks = [b for b in module.modules() if isinstance(b, BasicBlock | Bottleneck)]
    norms = [b.bn2 if isinstance(b, BasicBlock) else b.bn3 for b in blocks]
    for norm in norms:
        nn.init.zeros_(norm.weight)
    return len(norms)


for _name, _levels in RESNET_NAMES.items():
    register_backbone(
        _name,
        SSDBackbone(
            build=lambda weights=None, width_mult=1.0, name=_name: resnet_backbone(name, weights=weights),
            level_channels=_levels,
            zero_init=zero_init_resnet_blocks,
        ),
    )
