"""Pure nn.Modules and builders for SSD300 v1.1 (config-agnostic, torchvision style)."""

from importlib.util import find_spec

from ssd_lightning.models.boxes import BoxCoder, DefaultBoxes, dboxes300_coco
from ssd_lightning.models.loss import SSDLoss
from ssd_lightning.models.nvidia import load_nvidia_checkpoint
from ssd_lightning.models.ssd300 import SSD300, ssd300

__all__ = [
    "BoxCoder",
    "DefaultBoxes",
    "SSD300",
    "SSDLoss",
    "dboxes300_coco",
    "load_nvidia_checkpoint",
    "ssd300",
]

# The MobileNetV2 module is written separately; import it when it is there (its own errors surface).
if find_spec("ssd_lightning.models.mobilenetv2") is not None:
    from ssd_lightning.models.mobilenetv2 import MobileNetV2SSDBackbone, mobilenet_v2

    __all__ += ["MobileNetV2SSDBackbone", "mobilenet_v2"]
