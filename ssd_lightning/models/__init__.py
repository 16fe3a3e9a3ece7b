"""Pure nn.Modules and builders for SSD300 v1.1 and MobileNetV2 (config-agnostic, torchvision style)."""

from ssd_lightning.models.boxes import BoxCoder, DecoderSettings, DefaultBoxes, dboxes300_coco
from ssd_lightning.models.loss import SSDLoss
from ssd_lightning.models.mobilenetv2 import MobileNetV2SSDBackbone, mobilenet_v2
from ssd_lightning.models.nvidia import nvidia_state_dict
from ssd_lightning.models.registry import IMAGENET_MEAN, IMAGENET_STD, NETWORK_BUILDERS, build_network
from ssd_lightning.models.ssd300 import SSD300, ssd300

__all__ = [
    "SSD300",
    "BoxCoder",
    "DecoderSettings",
    "DefaultBoxes",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NETWORK_BUILDERS",
    "MobileNetV2SSDBackbone",
    "SSDLoss",
    "build_network",
    "dboxes300_coco",
    "mobilenet_v2",
    "nvidia_state_dict",
    "ssd300",
]
