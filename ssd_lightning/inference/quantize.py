"""INT8 for CPU deployment: calibrate an fp32 ONNX export on the user's images and quantize it statically
(:func:`quantize_onnx`), and measure how far the INT8 file is from PyTorch (:func:`compare_int8`).

onnxruntime's ``quantize_static`` in QDQ format (``QuantizeLinear``/``DequantizeLinear`` pairs around the
network's compute ops, fused into integer kernels when onnxruntime loads the file). Calibration images are
preprocessed as ``predict.py`` reads them, so the ranges are those seen in use; the metadata is copied, so
``predict.py onnx=<int8 file>`` runs it as it runs the fp32 export.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ssd_lightning.errors import ConfigError, DataError
from ssd_lightning.inference.classifier import Classifier
from ssd_lightning.inference.detector import Detector
from ssd_lightning.inference.onnx_format import END_TO_END_OUTPUTS
from ssd_lightning.inference.predict import READ_ERRORS, open_image, preprocess
from ssd_lightning.inference.sources import InputImage, collect_inputs
from ssd_lightning.io.atomic import atomic_write
from ssd_lightning.models.boxes import box_iou

__all__ = [
    "COMPUTE_OP_TYPES",
    "QUANTIZED_OP_TYPES",
    "Int8Comparison",
    "calibration_tensors",
    "compare_int8",
    "image_transform",
    "network_nodes",
    "quantize_onnx",
]

log = logging.getLogger(__name__)

#: The ops whose inputs define the network part of a graph: it is everything upstream of them.
COMPUTE_OP_TYPES: tuple[str, ...] = ("Conv", "MatMul", "Gemm")
#: Ops of the network part that get QuantizeLinear/DequantizeLinear (element-wise ones between two
#: convolutions, so onnxruntime can keep the activations in int8 from one to the next).
QUANTIZED_OP_TYPES: tuple[str, ...] = (
    *COMPUTE_OP_TYPES, "Add", "Relu", "Clip", "MaxPool", "AveragePool", "GlobalAveragePool"
)  # fmt: skip


def image_transform(model: Detector | Classifier) -> tuple[Callable[[Image.Image], Tensor], int]:
    """``(transform, min_side)`` with which ``predict.py`` reads images for ``model``: decoded image ->
    (3, S, S) input, and :func:`open_image`'s reduced JPEG decoding (``fast_decode``, on for detectors)."""
    if isinstance(model, Classifier):
        return model.preprocess, 0
    return partial(preprocess, size=model.image_size), 2 * model.image_size


def calibration_tensors(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    count: int,
    transform: Callable[[Image.Image], Tensor],
    *,
    min_side: int = 0,
) -> tuple[list[Tensor], list[InputImage]]:
    """The first ``count`` readable images of ``source`` (as ``predict.py``'s ``input=``) through
    ``transform``, and their inputs; unreadable ones skipped (logged; DataError when none is readable)."""
    if count < 1:
        raise ConfigError(f"calibration_images={count}: give how many images to calibrate on (>= 1)")
    try:
        items = collect_inputs(source)
    except FileNotFoundError as e:  # collect_inputs names the key input=; this is calibration=
        raise type(e)(str(e).replace("input=", "calibration=", 1)) from None
    tensors, used, skipped = [], [], []
    for item in items:
        if len(tensors) == count:
            break
        try:
            image, _ = open_image(item.path, min_side)
        except READ_ERRORS as e:
            skipped.append(f"{item.name} ({type(e).__name__})")
            continue
        tensors.append(transform(image))
        used.append(item)
    if skipped:
        log.warning("calibration: skipped %d unreadable file(s): %s", len(skipped), ", ".join(skipped[:5]))
    if not tensors:
        raise DataError(
            f"calibration={source}: none of its {len(items)} image file(s) could be read (e.g. "
            f"{skipped[0]}); give images like those the model will see"
        )
    return tensors, used


def network_nodes(model: Any) -> set[str]:
    """Names of the ``onnx.ModelProto``'s network nodes: the :data:`COMPUTE_OP_TYPES` nodes and all upstream
    of one (decoding, NMS and the reshapes after the last convolutions are downstream of them all)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    found: set[str] = set()
    stack = [node for node in model.graph.node if node.op_type in COMPUTE_OP_TYPES]
    while stack:
        node = stack.pop()
        if node.name not in found:
            found.add(node.name)
            stack.extend(producer[name] for name in node.input if name in producer)
    return found


def quantize_onnx(
    fp32_file: str | os.PathLike,
    output: str | os.PathLike,
    calibration: Iterable[Tensor],
    *,
    reduce_range: bool = False,
) -> Path:
    """Write an INT8 (QDQ) version of the ONNX export ``fp32_file`` to ``output`` (atomically), calibrated on
    preprocessed (3, S, S) images: the :data:`QUANTIZED_OP_TYPES` nodes of :func:`network_nodes` (weights
    int8 per output channel, 7-bit with ``reduce_range`` for CPUs without VNNI where u8 x s8 products can
    saturate; activations uint8 per tensor, min/max calibration)."""
    import onnx
    from onnxruntime import quantization as q
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if not (tensors := list(calibration)):
        raise ValueError("no calibration images")
    metadata = onnx.load(str(fp32_file), load_external_data=False).metadata_props
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".quantize.", dir=output.parent) as tmp:
        # onnxruntime's graph optimisation first: folds the Identity nodes the exporter puts in front of
        # shared weights and biases (a bias behind one stays fp32 and its Conv is not fused)
        prepared = Path(tmp) / "fp32.onnx"
        quant_pre_process(str(fp32_file), str(prepared), skip_symbolic_shape=True)
        model = onnx.load(str(prepared))
        seen: set[str] = set()  # unique node names: nodes_to_exclude selects by name
        for index, node in enumerate(model.graph.node):
            if not node.name or node.name in seen:
                node.name = f"{node.op_type}_q{index}"
            seen.add(node.name)
        if not (inside := network_nodes(model)):
            raise ValueError(f"{fp32_file} has no {'/'.join(COMPUTE_OP_TYPES)} node to quantize")
        outside = [node.name for node in model.graph.node if node.name not in inside]
        (input_name,) = [i.name for i in model.graph.input]
        onnx.save(model, str(prepared))  # with the node names
        quantized = Path(tmp) / "int8.onnx"
        batches = iter([{input_name: t.unsqueeze(0).numpy()} for t in tensors])  # one image at a time

        class Reader(q.CalibrationDataReader):
            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(batches, None)

        q.quantize_static(
            str(prepared),
            str(quantized),
            Reader(),
            quant_format=q.QuantFormat.QDQ,
            op_types_to_quantize=list(QUANTIZED_OP_TYPES),
            per_channel=True,
            reduce_range=reduce_range,
            activation_type=q.QuantType.QUInt8,
            weight_type=q.QuantType.QInt8,
            nodes_to_exclude=outside,
            calibrate_method=q.CalibrationMethod.MinMax,
            # not CalibMaxIntermediateOutputs: onnxruntime 1.32 drops (does not merge) the ranges of each
            # full chunk, so only the last images would count
        )
        result = onnx.load(str(quantized))
        onnx.helper.set_model_props(result, {prop.key: prop.value for prop in metadata})
        onnx.checker.check_model(result)
        atomic_write(output, lambda f: f.write(result.SerializeToString()), binary=True)
    return output


@dataclass(frozen=True)
class Int8Comparison:
    """An INT8 file against PyTorch (fp32): ``top_match`` images with the same top-1 class, or top
    detection (label, IoU >= 0.5; or none in both), ``max_score_diff`` of that top score."""

    images: int
    top_match: int
    max_score_diff: float
    mean_detections: tuple[float, float] = (0.0, 0.0)

    def __str__(self) -> str:
        text = f"{self.top_match}/{self.images} images with PyTorch's top result, "
        text += f"max |top score diff| = {self.max_score_diff:.3f}"
        if self.mean_detections != (0.0, 0.0):
            ours, theirs = self.mean_detections
            text += f", detections/image {ours:.1f} (PyTorch) vs {theirs:.1f}"
        return text


def _top_agreement(reference: dict[str, Tensor], got: dict[str, Tensor]) -> tuple[bool, float]:
    ref_n, got_n = len(reference["scores"]), len(got["scores"])
    if ref_n == 0 or got_n == 0:
        score = float(reference["scores"][0]) if ref_n else float(got["scores"][0]) if got_n else 0.0
        return ref_n == got_n, score
    i, j = int(reference["scores"].argmax()), int(got["scores"].argmax())
    iou = box_iou(reference["boxes"][i : i + 1].clamp(0, 1), got["boxes"][j : j + 1].clamp(0, 1))[0, 0]
    same = int(reference["labels"][i]) == int(got["labels"][j]) and float(iou) >= 0.5
    return same, abs(float(reference["scores"][i]) - float(got["scores"][j]))


@torch.no_grad()
def compare_int8(
    model: Detector | Classifier, net: torch.nn.Module, int8_file: str | os.PathLike, images: Sequence[Tensor]
) -> Int8Comparison:
    """Compare ``int8_file`` (onnxruntime, CPU; a detector's network-only or end-to-end) with ``net`` (fp32,
    + ``BoxCoder.decode`` for a detector) on preprocessed ``images`` (calibration ones: random ones say
    little about a calibrated file)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(int8_file), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    net = net.eval().float().cpu()
    top, worst, counts = 0, 0.0, [0, 0]
    for image in images:
        batch = image.unsqueeze(0).float()
        got = session.run(None, {"images": batch.numpy()})
        if isinstance(model, Classifier):
            ref_p = net(batch).softmax(dim=1)[0]
            got_p = torch.from_numpy(got[0]).softmax(dim=1)[0]
            top += int(ref_p.argmax() == got_p.argmax())
            worst = max(worst, abs(float(ref_p.max()) - float(got_p[ref_p.argmax()])))
            continue
        coder, settings = model.box_coder, dict(model.settings)
        (reference,) = coder.decode(*net(batch), **settings)
        if tuple(outputs) == END_TO_END_OUTPUTS:
            boxes, scores, labels, n = (torch.as_tensor(np.asarray(a[0])) for a in got)
            found = {"boxes": boxes[: int(n)], "scores": scores[: int(n)], "labels": labels[: int(n)]}
        else:
            (found,) = coder.decode(torch.from_numpy(got[0]), torch.from_numpy(got[1]), **settings)
        same, diff = _top_agreement(reference, found)
        top, worst = top + int(same), max(worst, diff)
        counts = [counts[0] + len(reference["scores"]), counts[1] + len(found["scores"])]
    n = max(len(images), 1)
    return Int8Comparison(len(images), top, worst, (counts[0] / n, counts[1] / n))
