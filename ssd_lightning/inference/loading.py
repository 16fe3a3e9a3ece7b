"""Load whatever model a file holds: a detector or a classifier, from a checkpoint or an ONNX export."""

from __future__ import annotations

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

__all__ = ["load_model_from_settings"]


def load_model_from_settings(settings: Mapping[str, Any]) -> Detector | Classifier:
    """The model of ``settings`` (``configs/predict.yaml``): a classifier when the file says so, else
    :func:`~.detector.load_detector_from_settings`."""
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
    if ckpt and not settings.get("run_config"):  # run_config= rebuilds a detector from its run
        checkpoint = read_checkpoint(ckpt, trust_checkpoint=trust, what="ckpt_path")
        record = read_model_record(checkpoint, source=f"ckpt_path={ckpt}")  # none: an earlier detector
        if record is not None and record["kind"] == "classifier":
            return load_classifier(ckpt, device=device, trust_checkpoint=trust)
    return load_detector_from_settings(settings)
