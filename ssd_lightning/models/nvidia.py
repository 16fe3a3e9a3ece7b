"""Import NVIDIA DeepLearningExamples SSD300 v1.1 checkpoints into :class:`SSD300`.

Accepted inputs (a path or an already loaded object):

* ``main.py --save`` checkpoints: ``{"model": state_dict, "epoch": ..., "optimizer": ..., ...}``;
* the torch.hub ``nvidia_ssd`` checkpoint: the same ``{"model": state_dict, ...}`` layout, whose keys
  may carry DistributedDataParallel prefixes (``module.`` or ``module.1.``), which the reference's
  ``unwrap_distributed`` removes;
* a bare state dict, with or without those prefixes.

Our :class:`SSD300` keeps the reference module names (``feature_extractor.feature_extractor.*``,
``additional_blocks.*``, ``loc.*``, ``conf.*``), so after the prefixes are gone the keys map one to one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import Tensor

from ssd_lightning.io.weights import read_checkpoint
from ssd_lightning.models.ssd300 import ssd300

__all__ = ["load_nvidia_checkpoint", "unwrap_distributed_key"]

_PREFIXES = ("module.1.", "module.")


def unwrap_distributed_key(key: str) -> str:
    """``module.1.conf.0.weight`` / ``module.conf.0.weight`` -> ``conf.0.weight`` (the reference's
    ``unwrap_distributed``, one key at a time)."""
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def load_nvidia_checkpoint(
    path_or_dict: str | os.PathLike | Mapping[str, object],
    *,
    backbone: str = "resnet50",
    num_classes: int = 81,
    trust_checkpoint: bool = False,
) -> dict[str, Tensor]:
    """Read an NVIDIA SSD300 checkpoint and return a state dict for ``ssd300(backbone=..., num_classes=...)``.

    The result loads with ``model.load_state_dict(state_dict, strict=True)``. Tensors keep their dtype
    (``load_state_dict`` copies them into the model's parameters).

    Args:
        path_or_dict: checkpoint file, or the loaded checkpoint / state dict.
        backbone: backbone the checkpoint was trained with (the reference default is resnet50).
        num_classes: classes including background (81 for COCO).
        trust_checkpoint: unpickle the file fully (``torch.load(weights_only=False)``), which can run code
            from the file. By default it is read with ``weights_only=True``: tensors, plain values and the
            reference's ``argparse.Namespace`` only (:func:`ssd_lightning.io.weights.read_checkpoint`).

    Raises:
        FileNotFoundError: the path does not exist.
        pickle.UnpicklingError: the file holds other objects and ``trust_checkpoint`` is false (the
            message says how to load it); nothing from the file has run.
        ValueError: the keys or shapes do not match the model; the message names the missing and
            unexpected keys (or mismatched shapes).
    """
    if isinstance(path_or_dict, (str, os.PathLike)):
        checkpoint = read_checkpoint(
            path_or_dict, trust_checkpoint=trust_checkpoint, what="NVIDIA SSD checkpoint"
        )
    else:
        checkpoint = path_or_dict
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"expected a checkpoint dict or a state dict, got {type(checkpoint).__name__}")
    state = checkpoint.get("model", checkpoint)
    if not isinstance(state, Mapping):
        raise ValueError(f"checkpoint['model'] must be a state dict, got {type(state).__name__}")
    state = {unwrap_distributed_key(k): v for k, v in state.items() if isinstance(v, Tensor)}

    with torch.device("meta"):
        expected = ssd300(backbone=backbone, num_classes=num_classes).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not fit ssd300(backbone={backbone!r}, num_classes={num_classes}): "
            f"{len(missing)} missing keys {_preview(missing)}, {len(unexpected)} unexpected keys "
            f"{_preview(unexpected)}. Check the backbone and num_classes arguments."
        )
    wrong = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if tuple(state[k].shape) != tuple(v.shape)
    ]
    if wrong:
        raise ValueError(
            f"checkpoint does not fit ssd300(backbone={backbone!r}, num_classes={num_classes}): "
            f"{len(wrong)} shape mismatches, e.g. {wrong[:5]}"
        )
    return {k: state[k] for k in expected}


def _preview(keys: list[str], n: int = 8) -> str:
    return str(keys[:n])[:-1] + (", ...]" if len(keys) > n else "]")
