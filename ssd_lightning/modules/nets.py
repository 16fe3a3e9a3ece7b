"""Network builders that read weight files: ``model.net`` targets whose config names a file."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from torchvision.models import MobileNetV2

from ssd_lightning.io.weights import network_state_dict, read_checkpoint
from ssd_lightning.models.mobilenetv2 import load_mobilenet_v2_state_dict, mobilenet_v2

__all__ = ["build_mobilenet_v2"]

log = logging.getLogger(__name__)


def build_mobilenet_v2(
    *,
    num_classes: int = 1000,
    width_mult: float = 1.0,
    inverted_residual_setting: Sequence[Sequence[int]] | None = None,
    round_nearest: int = 8,
    dropout: float = 0.2,
    weights: str | None = None,
    pretrained_path: str | os.PathLike | None = None,
    trust_checkpoint: bool = False,
) -> MobileNetV2:
    """:func:`ssd_lightning.models.mobilenet_v2`, then the weights of ``pretrained_path`` if given.

    Args:
        num_classes, width_mult, inverted_residual_setting, round_nearest, dropout, weights: as in
            :func:`~ssd_lightning.models.mobilenet_v2`.
        pretrained_path: a local file with a state dict (plain, or under ``state_dict``/``model``, keys
            possibly prefixed ``module.``/``model.``/``net.``), loaded strictly; with another class count
            the classifier keeps its initialisation (logged). Read with ``torch.load(weights_only=True)``.
        trust_checkpoint: unpickle ``pretrained_path`` fully instead, which can run code from the file.

    Raises:
        ValueError: both ``weights`` and ``pretrained_path``; the file does not fit the network.
        CheckpointNotFoundError, UntrustedCheckpointError, CheckpointReadError: see
            :func:`ssd_lightning.io.weights.read_checkpoint`.
    """
    if weights is not None and pretrained_path is not None:
        raise ValueError(
            "give either weights= (torchvision download) or pretrained_path= (local file), not both"
        )
    model = mobilenet_v2(
        num_classes=num_classes,
        width_mult=width_mult,
        inverted_residual_setting=inverted_residual_setting,
        round_nearest=round_nearest,
        dropout=dropout,
        weights=weights,
    )
    if pretrained_path is not None:
        path = Path(pretrained_path).expanduser()
        checkpoint = read_checkpoint(path, trust_checkpoint=trust_checkpoint, what="pretrained_path")
        state, left_out = network_state_dict(checkpoint, source=f"pretrained_path={path}")
        if left_out:
            log.info("%s: ignoring %d entries outside the network (e.g. EMA copies)", path, len(left_out))
        load_mobilenet_v2_state_dict(model, state, source=str(path))
    return model
