"""Load whatever model a file holds: a detector or a classifier, from a checkpoint or an ONNX export."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ssd_lightning.inference.classifier import Classifier, classifier_from_onnx, load_classifier
from ssd_lightning.inference.detector import (
    Detector,
    detector_from_onnx,
    load_detector_from_settings,
    open_onnx,
)
from ssd_lightning.io.model_record import read_model_record
from ssd_lightning.io.weights import read_checkpoint

__all__ = ["checkpoint_kind", "load_model_from_settings"]


def checkpoint_kind(path: str | os.PathLike, *, trust_checkpoint: bool = False) -> str:
    """``detector`` or ``classifier``, from the file's model record (no record: an earlier detector)."""
    checkpoint = read_checkpoint(path, trust_checkpoint=trust_checkpoint, what="ckpt_path")
    record = read_model_record(checkpoint, source=f"ckpt_path={path}")
    return "detector" if record is None else record["kind"]


def load_model_from_settings(settings: Mapping[str, Any]) -> Detector | Classifier:
    """The model of ``settings`` (``configs/predict.yaml``, the export command's keys): a classifier when the
    checkpoint or ONNX file says so, else :func:`~.detector.load_detector_from_settings`."""
    if sum(bool(settings.get(key)) for key in ("ckpt_path", "nvidia_checkpoint", "onnx")) != 1:
        return load_detector_from_settings(settings)  # its error says which sources there are
    device = settings.get("device", "cpu")
    if settings.get("onnx"):
        path = Path(settings["onnx"])
        session, meta = open_onnx(path, device)
        if meta["kind"] == "classifier":
            return classifier_from_onnx(session, meta, path)
        return detector_from_onnx(session, meta, path, settings.get("decoder"))
    ckpt, trust = settings.get("ckpt_path"), bool(settings.get("trust_checkpoint", False))
    by_record = ckpt and not settings.get("run_config")  # run_config= rebuilds a detector from its run
    if by_record and checkpoint_kind(ckpt, trust_checkpoint=trust) == "classifier":
        return load_classifier(ckpt, device=device, trust_checkpoint=trust)
    return load_detector_from_settings(settings)
