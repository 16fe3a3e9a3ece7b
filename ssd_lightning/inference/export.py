"""ONNX export of a detector: the network alone (:func:`export_network`) or with decoding and NMS in the
graph (:class:`EndToEndSSD`, :func:`export_end_to_end`); :func:`export_detector` does either.

:class:`EndToEndSSD` computes what :meth:`BoxCoder.decode <ssd_lightning.models.boxes.BoxCoder.decode>`
computes into fixed-size tensors with ONNX ops only (``TopK``, ``Gather``, ``NonMaxSuppression``,
``ScatterND``; opset 11+), class names and decoder settings in the file's metadata; both use the
TorchScript-based exporter (``dynamo=False``). ``NonMaxSuppression`` follows the decoder's rules: every
(image, class) pair is one NMS "batch" row of its top-k candidates (the operator's own per-class loop would
see all 8732 boxes); it suppresses at IoU ``>`` its threshold, the decoder at ``>=`` ``nms_iou``, so it gets
the float32 just below ``nms_iou``; ties: onnxruntime's ``TopK`` puts the smaller index first, the decoder the
larger, so rows are reversed before each ``TopK``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ssd_lightning.inference.classifier import CLASSIFIER_OUTPUTS, Classifier
from ssd_lightning.inference.detector import Detector
from ssd_lightning.inference.onnx_format import (
    END_TO_END_OUTPUTS,
    NETWORK_OUTPUTS,
    metadata_entry,
    read_metadata,
)
from ssd_lightning.models.boxes import BoxCoder, DecoderSettings, _batched_greedy_nms, _topk_rows

__all__ = [
    "END_TO_END_OUTPUTS",
    "EndToEndSSD",
    "compare_with_decoder",
    "detection_difference",
    "export_classifier",
    "export_detector",
    "export_end_to_end",
    "export_network",
    "network_difference",
    "read_metadata",
    "select_detections",
]


class _ClasswiseNMS(torch.autograd.Function):
    """Greedy NMS inside every row of boxes (G, K, 4) ltrb sorted by score, scores (G, 1, K) -> selected
    (M, 3) int64 ``[row, 0, candidate]``; exported as one ONNX ``NonMaxSuppression`` node."""

    @staticmethod
    def forward(
        ctx, boxes: Tensor, scores: Tensor, score_thresh: float, nms_iou: float, max_per_row: int
    ) -> Tensor:
        if torch.jit.is_tracing():  # exporting: only ``symbolic`` matters, the traced value is unused
            return torch.zeros(0, 3, dtype=torch.int64, device=boxes.device)
        valid = scores[:, 0] > score_thresh
        keep = _batched_greedy_nms(boxes, valid, nms_iou)  # the decoder's own NMS
        rows, cols = keep.nonzero().unbind(1)
        return torch.stack([rows, torch.zeros_like(rows), cols], dim=1)

    @staticmethod
    def symbolic(g, boxes, scores, score_thresh: float, nms_iou: float, max_per_row: int):
        # ONNX suppresses when IoU > threshold; the float32 just below nms_iou gives IoU >= nms_iou.
        iou_below = np.nextafter(np.float32(nms_iou), np.float32(-np.inf))
        max_per_row = g.op("Constant", value_t=torch.tensor([max_per_row]))
        iou = g.op("Constant", value_t=torch.tensor([float(iou_below)], dtype=torch.float32))
        score = g.op("Constant", value_t=torch.tensor([score_thresh], dtype=torch.float32))
        # center_point_box=0: (l, t, r, b) read as (y1, x1, y2, x2) swaps the axes, no IoU changes
        return g.op("NonMaxSuppression", boxes, scores, max_per_row, iou, score, center_point_box_i=0)


def _topk_later_first(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``topk`` along the last dim, best first, ties to the larger index (the decoder's rule). Eager: the
    decoder's ``_topk_rows`` (``torch.topk`` on the CPU has no tie order); exporting: the row reversed."""
    length = values.shape[-1]
    if not torch.jit.is_tracing():
        top, idx = _topk_rows(values.reshape(-1, length), k)
        return top.view(*values.shape[:-1], -1), idx.view(*values.shape[:-1], -1)
    top, idx = values.flip(-1).topk(k, dim=-1)
    return top, (length - 1) - idx


def select_detections(
    boxes: Tensor,
    class_scores: Tensor,
    *,
    score_thresh: float,
    nms_iou: float,
    topk_per_class: int,
    max_detections: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decoder's selection as fixed-size tensors: ``boxes`` (N, B, 4) relative ltrb
    (:meth:`BoxCoder.decode_boxes`) and foreground softmax ``class_scores`` (N, C - 1, B) -> ``boxes``
    (N, K, 4) clipped to [0, 1], ``scores`` (N, K), ``labels`` (N, K) int64 in 1..C-1, ``num_detections``
    (N,), K = ``max_detections``; best first, rows past ``num_detections`` zero (label 0 = padding)."""
    # static sizes (only the batch is dynamic in the exported graph)
    n_fg, n_box = int(class_scores.shape[1]), int(class_scores.shape[2])
    k = min(topk_per_class, n_box)
    m = min(max_detections, n_fg * k)

    # 1. Per (image, class) the k best candidates (the NMS drops those <= score_thresh).
    cand_scores, cand_idx = _topk_later_first(class_scores, k)  # (N, C-1, k)
    image_offset = torch.arange(boxes.shape[0], device=boxes.device).view(-1, 1, 1) * n_box
    cand_boxes = boxes.reshape(-1, 4)[(cand_idx + image_offset).reshape(-1)]  # (N * (C-1) * k, 4)

    # 2. Greedy NMS inside each (image, class) row -> kept mask (N, (C-1) * k).
    selected = _ClasswiseNMS.apply(
        cand_boxes.view(-1, k, 4), cand_scores.reshape(-1, 1, k), float(score_thresh), float(nms_iou), k
    )
    kept = torch.zeros(cand_scores.numel(), dtype=cand_scores.dtype, device=boxes.device)
    kept = kept.index_put(
        (selected[:, 0] * k + selected[:, 2],), torch.ones_like(selected[:, 0], dtype=kept.dtype)
    )
    kept_scores = torch.where(kept.view_as(cand_scores) > 0, cand_scores, float("-inf"))

    # 3. Per image the best m over (class, rank); ties go to the later entry, as in the decoder.
    det_scores, pos = _topk_later_first(kept_scores.flatten(1), m)  # (N, m)
    present = det_scores > float("-inf")
    det_boxes = cand_boxes.view(-1, n_fg * k, 4).gather(1, pos.unsqueeze(-1).expand(-1, -1, 4))
    det_boxes = torch.where(present.unsqueeze(-1), det_boxes.clamp(0, 1), 0.0)
    det_scores = torch.where(present, det_scores, 0.0)
    det_labels = torch.where(present, pos // k + 1, 0)
    if m < max_detections:  # fewer candidates than max_detections: pad to the promised K
        pad = max_detections - m
        det_boxes = nn.functional.pad(det_boxes, (0, 0, 0, pad))
        det_scores, det_labels = (nn.functional.pad(t, (0, pad)) for t in (det_scores, det_labels))
    return det_boxes, det_scores, det_labels, present.sum(dim=1)


class EndToEndSSD(nn.Module):
    """Images -> :func:`select_detections`' four tensors (``net``: images -> ``(locs (N, 4, B), logits
    (N, C, B))``, decoded by ``box_coder``); exportable (:func:`export_end_to_end`). ValueError for
    ``topk_per_class`` or ``max_detections`` < 1, ``nms_iou`` not in (0, 1], ``score_thresh`` not in [0, 1).
    """

    def __init__(
        self,
        net: nn.Module,
        box_coder: BoxCoder,
        *,
        score_thresh: float = DecoderSettings.score_thresh,
        nms_iou: float = DecoderSettings.nms_iou,
        topk_per_class: int = DecoderSettings.topk_per_class,
        max_detections: int = DecoderSettings.max_detections,
    ) -> None:
        super().__init__()
        settings = DecoderSettings(
            float(score_thresh), float(nms_iou), int(topk_per_class), int(max_detections)
        )
        if not 0 < settings.nms_iou <= 1:
            # at nms_iou <= 0 the decoder suppresses boxes that do not even touch; ONNX NMS never does
            raise ValueError(f"nms_iou must be in (0, 1] for the in-graph NMS, got {settings.nms_iou}")
        if not 0 <= settings.score_thresh < 1:
            raise ValueError(f"score_thresh must be in [0, 1), got {settings.score_thresh}")
        self.net = net
        self.box_coder = box_coder
        self.decoder_settings = settings  # what this module reproduces of BoxCoder.decode

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.decode(*self.net(images))

    def decode(self, locs: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        boxes = self.box_coder.decode_boxes(locs)  # (N, B, 4), as BoxCoder.decode
        class_scores = self.box_coder.foreground_scores(logits)  # (N, C-1, B)
        return select_detections(boxes, class_scores, **self.decoder_settings)


def export_end_to_end(
    model: EndToEndSSD,
    output: str | os.PathLike,
    *,
    image_size: int = 300,
    metadata: Mapping[str, Any] | None = None,
    opset: int = 17,
) -> Path:
    """Write ``model`` as ONNX: ``images`` (N, 3, S, S) -> :data:`END_TO_END_OUTPUTS`, N dynamic; ``metadata``
    (JSON-able: ``class_names``, ``category_ids``) stored with the decoder settings and ``image_size``."""
    if opset < 11:
        raise ValueError(f"opset must be >= 11 (NonMaxSuppression, ScatterND), got {opset}")
    output = _trace(model, output, END_TO_END_OUTPUTS, image_size=image_size, opset=opset)
    settings = {"decoder": dict(model.decoder_settings), "image_size": image_size}
    return _checked(output, {"kind": "detector", **dict(metadata or {}), **settings})


def _checked(output: Path, metadata: Mapping[str, Any]) -> Path:
    """``output`` checked by ``onnx.checker``, with the ``metadata`` entries (if any) added."""
    import onnx

    proto = onnx.load(str(output))
    onnx.helper.set_model_props(proto, dict(metadata_entry(key, value) for key, value in metadata.items()))
    onnx.checker.check_model(proto)
    if metadata:
        onnx.save(proto, str(output))
    return output


def export_classifier(classifier: Classifier, output: str | os.PathLike, *, opset: int = 17) -> Path:
    """Write ``classifier``'s network as ONNX: ``images`` (N, 3, S, S) -> ``logits`` (N, K), N dynamic; class
    names and input transform in the metadata (``predict.py onnx=<file>`` runs it as it is)."""
    if classifier.net is None:
        raise ValueError(f"{classifier.source} is already an ONNX export")
    output = _trace(classifier.net, output, CLASSIFIER_OUTPUTS, image_size=classifier.image_size, opset=opset)
    return _checked(output, classifier.metadata())


def _trace(
    model: nn.Module, output: str | os.PathLike, outputs: tuple[str, ...], *, image_size: int, opset: int
) -> Path:
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    model = model.eval().float().cpu()
    example = torch.zeros(2, 3, image_size, image_size)
    names = {"input_names": ["images"], "output_names": list(outputs)}
    dynamic = {name: {0: "batch"} for name in ("images", *outputs)}
    with torch.no_grad(), warnings.catch_warnings():
        # the legacy exporter's deprecation notice and tracer warnings about data-dependent shapes
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (example,), str(output), **names, dynamic_axes=dynamic, opset_version=opset, dynamo=False
        )  # do_constant_folding is on by default
    return output


def export_network(
    net: nn.Module, output: str | os.PathLike, *, opset: int = 17, image_size: int = 300
) -> Path:
    """Write ``net`` as ONNX: ``images`` (N, 3, S, S) -> ``locs`` (N, 4, B), ``logits`` (N, C, B)."""
    return _checked(_trace(net, output, NETWORK_OUTPUTS, image_size=image_size, opset=opset), {})


def network_difference(net: nn.Module, onnx_file: str | os.PathLike, *, image_size: int = 300) -> float:
    """Largest |PyTorch - onnxruntime (CPU)| over a network export's outputs on a random batch of 2."""
    import onnxruntime as ort

    images = torch.randn(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = net.eval()(images)
    expected = (expected,) if isinstance(expected, Tensor) else expected
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": images.numpy()})
    return max(float((torch.from_numpy(g) - e).abs().max()) for g, e in zip(got, expected, strict=True))


def export_detector(
    detector: Detector, output: str | os.PathLike, *, end_to_end: bool = False, opset: int = 17
) -> tuple[Path, nn.Module]:
    """Export ``detector``'s network alone, or with its decoder in the graph and names and ids as metadata
    (``end_to_end``). Returns the file and the exported module (``net`` or the :class:`EndToEndSSD`)."""
    if detector.net is None:
        raise ValueError(f"{detector.source} is already an ONNX export")
    if not end_to_end:
        return export_network(detector.net, output, opset=opset, image_size=detector.image_size), detector.net
    model = EndToEndSSD(detector.net, detector.box_coder, **detector.settings)
    metadata = {"class_names": list(detector.class_names), "category_ids": list(detector.category_ids)}
    path = export_end_to_end(model, output, image_size=detector.image_size, metadata=metadata, opset=opset)
    return path, model


def detection_difference(boxes_a, scores_a, labels_a, boxes_b, scores_b, labels_b) -> float:
    """Largest |difference| of box coordinates or scores between two sets of one image's detections (boxes
    (k, 4), scores (k,), labels (k,)), whatever their order; ``inf`` when the counts or labels differ. Each
    of ``a`` is paired with an unused one of ``b`` of its label, closest pairs first."""
    boxes_a, boxes_b = np.asarray(boxes_a, np.float64), np.asarray(boxes_b, np.float64)
    scores_a, scores_b = np.asarray(scores_a, np.float64), np.asarray(scores_b, np.float64)
    labels_a, labels_b = np.asarray(labels_a), np.asarray(labels_b)
    if len(labels_a) != len(labels_b) or not np.array_equal(np.sort(labels_a), np.sort(labels_b)):
        return float("inf")
    cost = np.maximum(
        np.abs(boxes_a[:, None] - boxes_b[None]).max(axis=-1, initial=0),
        np.abs(scores_a[:, None] - scores_b[None]),
    )
    cost[labels_a[:, None] != labels_b[None]] = np.inf
    used = np.zeros(len(labels_b), dtype=bool)
    worst = 0.0
    for i in np.argsort(cost.min(axis=1, initial=np.inf), kind="stable"):
        j = int(np.argmin(np.where(used, np.inf, cost[i])))
        used[j] = True
        worst = max(worst, float(cost[i, j]))
    return worst


def compare_with_decoder(model: EndToEndSSD, onnx_file: str | os.PathLike) -> float:
    """The largest :func:`detection_difference` between ``onnx_file`` (onnxruntime, CPU) and ``model.net`` +
    :meth:`BoxCoder.decode` (boxes clipped to [0, 1]) on a random batch of 2."""
    import onnxruntime as ort

    images = torch.randn(2, 3, 300, 300, generator=torch.Generator().manual_seed(0))
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    boxes, scores, labels, counts = session.run(list(END_TO_END_OUTPUTS), {"images": images.numpy()})
    with torch.no_grad():
        locs, logits = model.net.eval()(images)
    reference = model.box_coder.decode(locs, logits, **model.decoder_settings)
    return max(
        detection_difference(
            boxes[i, :n], scores[i, :n], labels[i, :n], ref["boxes"].clamp(0, 1), ref["scores"], ref["labels"]
        )
        for i, (n, ref) in enumerate(zip(counts, reference, strict=True))
    )
