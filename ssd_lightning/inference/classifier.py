"""One classifier: a trained MobileNetV2 (Lightning checkpoint) or its ONNX export, with its class names.

:meth:`Classifier.classify` maps preprocessed images to class probabilities; the checkpoint's model record
says how to rebuild the network, name its classes and prepare images (:meth:`Classifier.preprocess`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from ssd_lightning.io.model_record import model_weights, read_model_record
from ssd_lightning.io.weights import CheckpointReadError, read_checkpoint
from ssd_lightning.models import IMAGENET_MEAN, IMAGENET_STD, build_network

__all__ = ["CLASSIFIER_OUTPUTS", "Classifier", "classifier_from_onnx", "load_classifier"]

#: Output names of an exported classifier graph, in order: logits (N, K).
CLASSIFIER_OUTPUTS: tuple[str, ...] = ("logits",)


@dataclass
class Classifier:
    """A network (images (N, 3, S, S) -> logits (N, K)) or an onnxruntime ``session`` of its export, with
    its class names and validation transform: shorter side to ``resize``, centre ``image_size`` crop,
    ``mean``/``std`` on the 0..255 scale; ``source``: where the weights came from (for messages)."""

    class_names: tuple[str, ...]
    image_size: int = 224
    resize: int = 256
    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    net: nn.Module | None = None
    session: Any = None
    source: str = ""

    def __post_init__(self) -> None:
        if (self.net is None) == (self.session is None):
            raise ValueError("a Classifier runs either a net or an onnxruntime session")

    @property
    def runs_on(self) -> str:
        if self.session is not None:
            return "onnxruntime " + self.session.get_providers()[0]
        return str(next(self.net.parameters()).device)

    def preprocess(self, image: Image.Image) -> Tensor:
        """PIL image -> (3, S, S) float32: the ImageFolder data's validation transform (Pillow bilinear)."""
        rgb = image.convert("RGB")
        scale = self.resize / min(rgb.width, rgb.height)
        width, height = max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale))
        rgb = rgb.resize((width, height), Image.BILINEAR)
        left, top = (width - self.image_size) // 2, (height - self.image_size) // 2
        rgb = rgb.crop((left, top, left + self.image_size, top + self.image_size))
        array = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1)
        mean, std = (torch.tensor(v, dtype=torch.float32).view(3, 1, 1) for v in (self.mean, self.std))
        return (array - mean) / std

    @torch.inference_mode()
    def classify(self, images: Tensor) -> Tensor:
        """(N, 3, S, S) from :meth:`preprocess` -> (N, K) float32 softmax probabilities on the CPU."""
        if self.session is None:
            logits = self.net(images.to(next(self.net.parameters()).device)).float().cpu()
        else:
            (logits,) = self.session.run(list(CLASSIFIER_OUTPUTS), {"images": images.float().cpu().numpy()})
            logits = torch.from_numpy(logits)
        return logits.softmax(dim=1)

    def metadata(self) -> dict[str, Any]:
        """What an ONNX export stores (read back by :func:`classifier_from_onnx`)."""
        return {
            "kind": "classifier",
            "class_names": list(self.class_names),
            "image_size": self.image_size,
            "resize": self.resize,
            "mean": [float(m) for m in self.mean],
            "std": [float(s) for s in self.std],
        }


def load_classifier(
    ckpt_path: str | os.PathLike, *, device: str | torch.device = "cpu", trust_checkpoint: bool = False
) -> Classifier:
    """A :class:`Classifier` from a ``ClassifierLitModule`` checkpoint, ``eval()`` on ``device`` (``auto``:
    CUDA when available); CheckpointReadError for a file without a model record or of another kind."""
    checkpoint = read_checkpoint(ckpt_path, trust_checkpoint=trust_checkpoint, what="ckpt_path")
    source = f"ckpt_path={ckpt_path}"
    record = read_model_record(checkpoint, source=source)
    if record is None or record["kind"] != "classifier":
        what = "records no model (written before checkpoints did)" if record is None else "is a detector"
        raise CheckpointReadError(f"{source} {what}; a classifier checkpoint of this version is needed")
    net = build_network(record["architecture"])
    net.load_state_dict(model_weights(checkpoint, record["weights"], source=source), strict=True)
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    size = record["input"]
    inputs = {**size, "resize": size["resize"] or round(size["image_size"] * 256 / 224)}
    return _classifier(record["classes"]["names"], inputs, net=net.eval().to(device), source=str(ckpt_path))


def classifier_from_onnx(session: Any, meta: Mapping[str, Any], path: Path) -> Classifier:
    """A :class:`Classifier` running an exported classifier (``open_onnx``'s session and metadata)."""
    outputs = tuple(o.name for o in session.get_outputs())
    if outputs != CLASSIFIER_OUTPUTS:
        raise ValueError(f"onnx={path} has outputs {', '.join(outputs)}, not {', '.join(CLASSIFIER_OUTPUTS)}")
    return _classifier(meta["class_names"], meta, session=session, source=str(path))


def _classifier(names: Sequence[str], inputs: Mapping[str, Any], **model: Any) -> Classifier:
    """``inputs``: a model record's ``input`` or an export's metadata; ``model``: the net or session."""
    size, resize, mean, std = (inputs[k] for k in ("image_size", "resize", "mean", "std"))
    return Classifier(tuple(names), int(size), int(resize), tuple(mean), tuple(std), **model)
