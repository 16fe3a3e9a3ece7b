"""NVIDIA DeepLearningExamples SSD300 v1.1 weights -> a state dict of :func:`ssd300`.

:class:`SSD300` keeps the reference module names, so its keys (DDP prefixes removed) map one to one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ssd_lightning.models._loading import check_state_dict
from ssd_lightning.models.ssd300 import ssd300

__all__ = ["nvidia_state_dict"]


def nvidia_state_dict(
    state: Mapping[str, Tensor],
    *,
    backbone: str = "resnet50",
    num_classes: int = 81,
    source: str = "checkpoint",
) -> dict[str, Tensor]:
    """``state`` checked against ``ssd300(backbone, num_classes)`` (ValueError), in the model's key order."""
    with torch.device("meta"):
        expected = ssd300(backbone=backbone, num_classes=num_classes).state_dict()
    target = f"ssd300(backbone={backbone!r}, num_classes={num_classes})"
    hint = "Check the backbone and num_classes arguments"
    check_state_dict(expected, state, source=source, target=target, hint=hint)
    return {k: state[k] for k in expected}
