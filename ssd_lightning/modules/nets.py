"""Network builders that read weight files: ``model.net`` targets whose config names a file."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torchvision.models import MobileNetV2

from ssd_lightning.io.weights import network_state_dict, read_checkpoint
from ssd_lightning.models.mobilenetv2 import load_mobilenet_v2_state_dict, mobilenet_v2

__all__ = ["build_mobilenet_v2"]

log = logging.getLogger(__name__)


def build_mobilenet_v2(
    *, pretrained_path: str | os.PathLike | None = None, trust_checkpoint: bool = False, **kwargs: Any
) -> MobileNetV2:
    """:func:`ssd_lightning.models.mobilenet_v2` (``kwargs``), then the local file ``pretrained_path``'s state
    dict, strictly but for a classifier of another class count."""
    if kwargs.get("weights") is not None and pretrained_path is not None:
        raise ValueError(
            "give either weights= (torchvision download) or pretrained_path= (local file), not both"
        )
    model = mobilenet_v2(**kwargs)
    if pretrained_path is not None:
        path = Path(pretrained_path).expanduser()
        checkpoint = read_checkpoint(path, trust_checkpoint=trust_checkpoint, what="pretrained_path")
        state, left_out = network_state_dict(checkpoint, source=f"pretrained_path={path}")
        if left_out:
            log.info("%s: ignoring %d entries outside the network (e.g. EMA copies)", path, len(left_out))
        load_mobilenet_v2_state_dict(model, state, source=str(path))
    return model
