"""What a checkpoint of this project records about its model, so that the file alone rebuilds and names it.

Every checkpoint a LightningModule here writes holds, under :data:`MODEL_KEY`, a dict of plain values
(``RecipeModule.save_model_record`` writes it; ``torch.load(weights_only=True)`` reads it)::

    {"format_version": 1,
     "kind": "detector" | "classifier",
     "architecture": {"builder": "ssd300", "args": {"backbone": ..., "num_classes": 5, ...}},
     "weights": "net." | "ema.module.",   # the state_dict prefix of the weights that are the model
     "classes": {"names": [...], "category_ids": [...]},
     "input": {"image_size": 300, "resize": None, "mean": [...], "std": [...]},
     "decoder": {...},                      # detectors: the decoder settings validation used
     "training": {...}}                     # informative: scaled LR, global batch, precision, epoch

Detectors: ``names[0]`` is ``"background"``, ``category_ids[k - 1]`` the dataset's id of label ``k``;
classifiers: ``names[k]`` is label ``k``'s, ``category_ids`` ``None``. ``input``: shorter side to ``resize``
then centre crop (classifiers), or squashed to ``image_size`` (detectors); then ``(pixel - mean) / std``.
Older checkpoints have no record; their readers fall back to the run's ``.hydra/config.yaml``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ssd_lightning.io.weights import CheckpointReadError

MODEL_KEY = "ssd_lightning_model"
FORMAT_VERSION = 1
KINDS = ("detector", "classifier")
_REQUIRED = ("kind", "architecture", "weights", "classes", "input")


def read_model_record(checkpoint: object, *, source: str) -> dict[str, Any] | None:
    """A loaded checkpoint's model record (``None`` in older ones); CheckpointReadError for no checkpoint
    dict, or a record of a newer format or incomplete."""
    if not isinstance(checkpoint, Mapping):
        raise CheckpointReadError(f"{source} is not a checkpoint (a {type(checkpoint).__name__}, not a dict)")
    if (record := checkpoint.get(MODEL_KEY)) is None:
        return None
    version = record.get("format_version") if isinstance(record, Mapping) else None
    if not isinstance(version, int):
        raise CheckpointReadError(f"{source}: its '{MODEL_KEY}' entry has no format_version; is it damaged?")
    if version > FORMAT_VERSION:
        raise CheckpointReadError(
            f"{source} was written by a newer ssd_lightning (model record format {version}; this one reads "
            f"up to {FORMAT_VERSION}): upgrade ssd_lightning to use it"
        )
    missing = [key for key in _REQUIRED if key not in record]
    if missing or record["kind"] not in KINDS:
        raise CheckpointReadError(
            f"{source}: its '{MODEL_KEY}' entry lacks {missing or 'a known kind'}; is it damaged?"
        )
    return dict(record)


def model_weights(checkpoint: Mapping[str, Any], prefix: str, *, source: str) -> dict[str, Tensor]:
    """``checkpoint["state_dict"]``'s tensors under ``prefix``, unprefixed; CheckpointReadError if none."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping):
        raise CheckpointReadError(
            f"{source} has no 'state_dict': not a Lightning checkpoint of this project (an NVIDIA SSD300 "
            "checkpoint loads with nvidia_checkpoint=)"
        )
    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not weights:
        raise CheckpointReadError(
            f"{source}: no '{prefix}*' weights in its state_dict; not a checkpoint of this project's modules"
        )
    return weights
