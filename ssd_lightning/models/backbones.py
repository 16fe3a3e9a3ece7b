"""SSD300 backbones by name (:data:`SSD_BACKBONES`), and the ResNet ones (conv4_x at stride 8, as in NVIDIA
SSD300 v1.1).

A backbone is an ``nn.Module`` whose ``forward(images)`` returns a ``list[Tensor]`` of feature maps (the
first SSD levels), whose attribute ``out_channels: list[int]`` lists their channels and whose ``stages()``
lists its parts in forward order (for ``model.freeze``). A new one is a module under ``models/`` that
calls :func:`register_backbone` when imported (and an import in ``models/__init__.py``); ``ssd300()``
finds it by name.
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
    """What ``ssd300()`` needs to know about a backbone.

    Attributes:
        build: ``build(weights=<torchvision weights name or None>, width_mult=...)`` -> the backbone module.
        level_channels: channels of the six SSD levels; the first ``len(module.out_channels)`` come from
            the backbone, the others from extra blocks of these widths.
        zero_init: zeroes the last normalisation of every residual branch of the module and returns how
            many (``model.net.zero_init_residual``); ``None``: the backbone has none, asking is an error.
        width: whether ``width_mult`` changes the backbone; one without is built at full width, warned.
    """

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
    """ResNet stem + conv2_x..conv4_x with the first conv4_x block at stride 1: (N, 3, 300, 300) -> one
    (N, C, 38, 38) map, C = 256 (ResNet-18/34) or 1024 (ResNet-50/101/152).

    It keeps the NVIDIA reference name ``feature_extractor`` (an ``nn.Sequential`` of the torchvision
    children ``conv1, bn1, relu, maxpool, layer1..layer3``) so reference checkpoints map onto it key for key.
    """

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
        """For freezing the first ones: the stem (conv1, bn1), conv2_x, conv3_x, conv4_x."""
        conv1, bn1, _relu, _maxpool, layer1, layer2, layer3 = self.feature_extractor
        return [[conv1, bn1], [layer1], [layer2], [layer3]]


def resnet_backbone(name: str, *, weights: str | None = None) -> ResNetBackbone:
    """A :class:`ResNetBackbone` of torchvision's ``name`` (a key of :data:`RESNET_NAMES`), with the
    torchvision weights enum member ``weights`` (e.g. ``"IMAGENET1K_V2"``, downloaded on first use) or
    random initialisation."""
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
    """Zero the scale of the last BatchNorm of every ``BasicBlock``/``Bottleneck`` branch (torchvision's
    ``zero_init_residual``, Goyal et al. 2017): each block starts as the identity. Returns how many."""
    norms = [
        b.bn2 if isinstance(b, BasicBlock) else b.bn3
        for b in module.modules()
        if isinstance(b, BasicBlock | Bottleneck)
    ]
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
