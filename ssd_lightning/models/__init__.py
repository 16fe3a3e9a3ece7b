"""Pure nn.Modules and builders for SSD300 v1.1 (config-agnostic, torchvision style)."""

from ssd_lightning.models.boxes import DefaultBoxes, dboxes300_coco

__all__ = ["DefaultBoxes", "dboxes300_coco"]
