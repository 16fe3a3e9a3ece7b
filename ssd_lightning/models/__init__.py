"""Pure nn.Modules and builders for SSD300 v1.1 and MobileNetV2 (config-agnostic, torchvision style)."""

from ssd_lightning.models.boxes import BoxCoder, DefaultBoxes, dboxes300_coco
from ssd_lightning.models.loss import SSDLoss
from ssd_lightning.models.mobilenetv2 import MobileNetV2SSDBackbone, mobilenet_v2
from ssd_lightning.models.nvidia import load_nvidia_checkpoint
from ssd_lightning.models.ssd300 import SSD300, ssd300

__all__ = [
    "SSD300",
    "BoxCoder",
    "DefaultBoxes",
    "MobileNetV2SSDBackbone",
    "SSDLoss",
    "dboxes300_coco",
    "load_nvidia_checkpoint",
    "mobilenet_v2",
    "ssd300",
]
