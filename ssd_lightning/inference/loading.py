"""Load whatever model a file holds: a detector or a classifier, from a checkpoint or an ONNX export."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ssd_lightning.inference.classifier import Classifier, classifier_from_onnx, load_classifier
from ssd_lightning.inference.detector import Detector, detector_from_onnx, load_detector, open_onnx
from ssd_lightning.io.model_record import read_model_record
from ssd_lightning.io.weights import read_checkpoint

__all__ = ["load_model_from_settings"]


def load_model_from_settings(settings: Mapping[str, Any]) -> Detector | Classifier:
    """The model of ``settings`` (``configs/predict.yaml``): a classifier when the file says so, else
    :func:`~.detector.load_detector` with the keys it takes."""
    one_source = sum(bool(settings.get(key)) for key in ("ckpt_path", "nvidia_checkpoint", "onnx")) == 1
    device, ckpt = settings.get("device", "cpu"), settings.get("ckpt_path")
    if one_source and settings.get("onnx"):
        path = Path(settings["onnx"])
        session, meta = open_onnx(path, device)
        if meta["kind"] == "classifier":
            return classifier_from_onnx(session, meta, path)
        return detector_from_onnx(session, meta, path, settings.get("decoder"))
    if one_source and ckpt and not settings.get("run_config"):  # run_config= rebuilds a detector from its run
        trust = bool(settings.get("trust_checkpoint", False))
        checkpoint = read_checkpoint(ckpt, trust_checkpoint=trust, what="ckpt_path")
        record = read_model_record(checkpoint, source=f"ckpt_path={ckpt}")  # none: an earlier detector
        if record is not None and record["kind"] == "classifier":
            return load_classifier(ckpt, device=device, trust_checkpoint=trust)
    names = inspect.signature(load_detector).parameters  # without one source: its error says which
    return load_detector(**{key: value for key, value in settings.items() if key in names})
