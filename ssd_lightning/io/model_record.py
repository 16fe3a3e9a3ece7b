"""What a checkpoint of this project records about its model, so that the file alone rebuilds and names it.

Every checkpoint a LightningModule here writes holds, under :data:`MODEL_KEY`, a dict of plain values
(``torch.load(weights_only=True)`` reads it)::

    {"format_version": 1,
     "kind": "detector" | "classifier",
     "architecture": {"builder": "ssd300", "args": {"backbone": ..., "num_classes": 5, ...}},
     "weights": "net." | "ema.module.",   # the state_dict prefix of the weights that are the model
     "classes": {"names": [...], "category_ids": [...]},
     "input": {"image_size": 300, "resize": None, "mean": [...], "std": [...]},
     "decoder": {...},                      # detectors: the decoder settings validation used
     "training": {...}}                     # informative: scaled LR, global batch, precision, epoch

Detectors: ``names[0]`` is ``"background"`` and ``category_ids[k - 1]`` is the dataset's id of label ``k``.
Classifiers: ``names[k]`` is label ``k``'s class and ``category_ids`` is ``None``. ``input``: resize the
shorter side to ``resize`` then centre-crop ``image_size`` (classifiers), or squash to ``image_size``
square (``resize`` ``None``, detectors); then ``(pixel - mean) / std`` per RGB channel, 0..255 scale.
Checkpoints of earlier versions have no record; their readers fall back to the run's ``.hydra/config.yaml``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from ssd_lightning.io.weights import CheckpointReadError

MODEL_KEY = "ssd_lightning_model"
FORMAT_VERSION = 1
KINDS = ("detector", "classifier")
_REQUIRED = ("kind", "architecture", "weights", "classes", "input")


def make_model_record(
    *,
    kind: str,
    architecture: Mapping[str, Any],
    weights: str,
    class_names: Sequence[str],
    category_ids: Sequence[int] | None,
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    resize: int | None = None,
    decoder: Mapping[str, Any] | None = None,
    training: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The record of one model, as plain values (see the module docstring for the fields)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    record: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "architecture": {"builder": str(architecture["builder"]), "args": dict(architecture["args"])},
        "weights": weights,
        "classes": {
            "names": [str(n) for n in class_names],
            "category_ids": None if category_ids is None else [int(i) for i in category_ids],
        },
        "input": {
            "image_size": int(image_size),
            "resize": None if resize is None else int(resize),
            "mean": [float(m) for m in mean],
            "std": [float(s) for s in std],
        },
    }
    if decoder is not None:
        record["decoder"] = dict(decoder)
    if training:
        record["training"] = dict(training)
    return record


def read_model_record(checkpoint: object, *, source: str) -> dict[str, Any] | None:
    """The model record of a loaded checkpoint; ``None`` for a checkpoint written before records existed.
    CheckpointReadError when ``source`` (how the caller names the file) is not a checkpoint dict, or its
    record is of a newer format or incomplete."""
    if not isinstance(checkpoint, Mapping):
        raise CheckpointReadError(f"{source} is not a checkpoint (a {type(checkpoint).__name__}, not a dict)")
    record = checkpoint.get(MODEL_KEY)
    if record is None:
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
    """The tensors of ``checkpoint["state_dict"]`` under ``prefix`` (``net.``/``ema.module.``), unprefixed;
    CheckpointReadError when there is no ``state_dict`` or nothing under ``prefix``."""
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
