"""NVIDIA DeepLearningExamples SSD300 v1.1 weights -> a state dict of :func:`ssd300`.

:class:`SSD300` keeps the reference module names (``feature_extractor.feature_extractor.*``,
``additional_blocks.*``, ``loc.*``, ``conf.*``), so the reference's keys, once free of their
DistributedDataParallel prefixes (:func:`ssd_lightning.io.weights.read_nvidia_state_dict` removes them),
map one to one.
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
    """Check that ``state`` (reference keys, no ``module.`` prefixes) fits ``ssd300(backbone, num_classes)``
    and return it in the model's key order, dtypes kept: ``model.load_state_dict(result, strict=True)``.

    Raises:
        ValueError: keys or shapes differ (:func:`ssd_lightning.models._loading.check_state_dict`).
    """
    with torch.device("meta"):
        expected = ssd300(backbone=backbone, num_classes=num_classes).state_dict()
    check_state_dict(
        expected,
        state,
        source=source,
        target=f"ssd300(backbone={backbone!r}, num_classes={num_classes})",
        hint="Check the backbone and num_classes arguments",
    )
    return {k: state[k] for k in expected}
