"""Default boxes (anchors) of SSD300 v1.1 and the box coder that maps ground truth onto them.

Box formats used throughout:

* ``xywh``: (cx, cy, w, h), relative to the image size, so in [0, 1] for boxes inside the image;
* ``ltrb``: (left, top, right, bottom), same units.

The default-box order is the NVIDIA reference order: per feature map (38, 19, 10, 5, 3, 1), per box
size, per location (row-major). The SSD300 heads produce their outputs in exactly this order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["BoxCoder", "DefaultBoxes", "dboxes300_coco", "xywh_to_ltrb", "ltrb_to_xywh", "box_iou"]


def xywh_to_ltrb(boxes: Tensor) -> Tensor:
    """(..., 4) (cx, cy, w, h) -> (..., 4) (l, t, r, b)."""
    cxcy, wh = boxes[..., :2], boxes[..., 2:]
    return torch.cat([cxcy - 0.5 * wh, cxcy + 0.5 * wh], dim=-1)


def ltrb_to_xywh(boxes: Tensor) -> Tensor:
    """(..., 4) (l, t, r, b) -> (..., 4) (cx, cy, w, h)."""
    lt, rb = boxes[..., :2], boxes[..., 2:]
    return torch.cat([0.5 * (lt + rb), rb - lt], dim=-1)


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU of every pair: (M, 4) ltrb x (K, 4) ltrb -> (M, K).

    Same arithmetic as the reference ``calc_iou_tensor`` (intersection clamped at 0, no epsilon).
    """
    lt = torch.maximum(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.minimum(boxes1[:, None, 2:], boxes2[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    return inter / (area1[:, None] + area2[None, :] - inter)


class DefaultBoxes:
    """The SSD default boxes for one input size.

    Args:
        fig_size: input image side in pixels (square input), e.g. 300.
        feat_size: side of each feature map, e.g. ``[38, 19, 10, 5, 3, 1]``.
        steps: pixel stride of each feature map; the box centres are at ``(j + 0.5) * step / fig_size``.
        scales: box sizes in pixels, one more than feature maps (the last is only used for the
            ``sqrt(s_k * s_{k+1})`` box of the last map).
        aspect_ratios: per feature map, the extra ratios; each ratio ``a`` adds the boxes
            ``(s*sqrt(a), s/sqrt(a))`` and ``(s/sqrt(a), s*sqrt(a))``.
        scale_xy: variance of the centre offsets (0.1 in SSD).
        scale_wh: variance of the log size offsets (0.2 in SSD).

    Attributes:
        xywh: (B, 4) float32 (cx, cy, w, h), clamped to [0, 1] as the reference does.
        ltrb: (B, 4) float32 (l, t, r, b) computed from the clamped ``xywh`` (so it may leave [0, 1]
            slightly for boxes at the border, exactly like the reference).
    """

    def __init__(
        self,
        fig_size: int,
        feat_size: Sequence[int],
        steps: Sequence[int],
        scales: Sequence[float],
        aspect_ratios: Sequence[Sequence[float]],
        scale_xy: float = 0.1,
        scale_wh: float = 0.2,
    ) -> None:
        n = len(feat_size)
        if len(steps) != n or len(aspect_ratios) != n:
            raise ValueError(
                f"feat_size, steps and aspect_ratios need one entry per feature map; got "
                f"{len(feat_size)}, {len(steps)} and {len(aspect_ratios)}"
            )
        if len(scales) != n + 1:
            raise ValueError(f"scales needs len(feat_size) + 1 = {n + 1} entries, got {len(scales)}")
        self.fig_size = fig_size
        self.feat_size = list(feat_size)
        self.steps = list(steps)
        self.scales = list(scales)
        self.aspect_ratios = [list(a) for a in aspect_ratios]
        self.scale_xy = float(scale_xy)
        self.scale_wh = float(scale_wh)

        boxes: list[tuple[float, float, float, float]] = []
        self.num_boxes_per_location: list[int] = []
        for idx, sfeat in enumerate(self.feat_size):
            fk = fig_size / self.steps[idx]
            sk1 = self.scales[idx] / fig_size
            sk2 = self.scales[idx + 1] / fig_size
            sk3 = math.sqrt(sk1 * sk2)
            sizes = [(sk1, sk1), (sk3, sk3)]
            for alpha in self.aspect_ratios[idx]:
                w, h = sk1 * math.sqrt(alpha), sk1 / math.sqrt(alpha)
                sizes += [(w, h), (h, w)]
            self.num_boxes_per_location.append(len(sizes))
            for w, h in sizes:
                for i, j in itertools.product(range(sfeat), repeat=2):
                    boxes.append(((j + 0.5) / fk, (i + 0.5) / fk, w, h))
        self.xywh: Tensor = torch.tensor(boxes, dtype=torch.float32).clamp_(min=0, max=1)
        self.ltrb: Tensor = xywh_to_ltrb(self.xywh)

    def __len__(self) -> int:
        return self.xywh.shape[0]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(fig_size={self.fig_size}, feat_size={self.feat_size}, "
            f"num_boxes={len(self)}, scale_xy={self.scale_xy}, scale_wh={self.scale_wh})"
        )


def dboxes300_coco() -> DefaultBoxes:
    """The 8732 default boxes of SSD300 v1.1 (NVIDIA reference ``dboxes300_coco``)."""
    return DefaultBoxes(
        fig_size=300,
        feat_size=[38, 19, 10, 5, 3, 1],
        steps=[8, 16, 32, 64, 100, 300],
        scales=[21, 45, 99, 153, 207, 261, 315],
        aspect_ratios=[[2], [2, 3], [2, 3], [2, 3], [2], [2]],
    )


class BoxCoder:
    """Maps ground truth onto default boxes (training targets) and network outputs back to detections.

    ``encode`` is the NVIDIA reference ``Encoder.encode``; ``decode`` gives the same detections as the
    reference ``decode_batch`` (per image, per class: score > threshold, top-k, greedy NMS; then top
    detections per image) but runs batched on tensors, without a Python loop over images or classes.

    Ties (equal scores) are resolved as a stable sort in the reference would: among equal scores the
    candidate with the larger default-box index ranks first inside a class, and in the final per-image
    cut the one from the larger class (then the later NMS pick) ranks first. The reference calls an
    unstable sort, so its own tie order is implementation-defined.

    Args:
        default_boxes: the :class:`DefaultBoxes` the network was built for.
    """

    def __init__(self, default_boxes: DefaultBoxes) -> None:
        self.default_boxes = default_boxes
        self.scale_xy = default_boxes.scale_xy
        self.scale_wh = default_boxes.scale_wh
        self._cache: dict[torch.device, tuple[Tensor, Tensor]] = {}

    @property
    def num_boxes(self) -> int:
        return len(self.default_boxes)

    def _dboxes(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(ltrb (B, 4), xywh (B, 4)) float32 on ``device``."""
        if device not in self._cache:
            self._cache[device] = (
                self.default_boxes.ltrb.to(device),
                self.default_boxes.xywh.to(device),
            )
        return self._cache[device]

    # ------------------------------------------------------------------ encode
    def encode(self, boxes_ltrb: Tensor, labels: Tensor, iou_threshold: float = 0.5) -> tuple[Tensor, Tensor]:
        """Match ground truth to default boxes.

        Args:
            boxes_ltrb: (M, 4) float ground-truth boxes, ltrb relative to the image (in [0, 1]).
            labels: (M,) integer labels (1..K; 0 is background).
            iou_threshold: a default box takes its best ground truth when their IoU is > this.

        Returns:
            ``boxes_xywh`` (B, 4) float32: per default box its matched ground truth as (cx, cy, w, h), or
            the default box itself when unmatched; ``labels`` (B,) int64, 0 where unmatched.

        Every ground truth is also forced onto its best default box (IoU to that box counted as 2); if
        two ground truths share the same best default box the later one gets it (as the reference).
        """
        if boxes_ltrb.ndim != 2 or boxes_ltrb.shape[-1] != 4:
            raise ValueError(f"boxes_ltrb must have shape (M, 4), got {tuple(boxes_ltrb.shape)}")
        if labels.shape != boxes_ltrb.shape[:1]:
            raise ValueError(
                f"labels must have shape ({boxes_ltrb.shape[0]},) to match boxes_ltrb, "
                f"got {tuple(labels.shape)}"
            )
        dboxes_ltrb, _ = self._dboxes(boxes_ltrb.device)
        boxes_ltrb = boxes_ltrb.float()
        num_gt = boxes_ltrb.shape[0]
        out_boxes = dboxes_ltrb.clone()
        out_labels = torch.zeros(self.num_boxes, dtype=torch.int64, device=boxes_ltrb.device)
        if num_gt > 0:
            ious = box_iou(boxes_ltrb, dboxes_ltrb)  # (M, B)
            best_gt_iou, best_gt = ious.max(dim=0)  # per default box
            best_dbox = ious.max(dim=1).indices  # per ground truth
            # Force each ground truth onto its best default box; the later ground truth wins a clash.
            forced = torch.full_like(best_gt, -1)
            forced.scatter_reduce_(0, best_dbox, torch.arange(num_gt, device=best_gt.device), reduce="amax")
            is_forced = forced >= 0
            best_gt = torch.where(is_forced, forced, best_gt)
            best_gt_iou = torch.where(is_forced, torch.full_like(best_gt_iou, 2.0), best_gt_iou)
            matched = best_gt_iou > iou_threshold
            out_labels[matched] = labels.to(torch.int64)[best_gt[matched]]
            out_boxes[matched] = boxes_ltrb[best_gt[matched]]
        return ltrb_to_xywh(out_boxes), out_labels

    def encode_batch(
        self, boxes_ltrb: Sequence[Tensor], labels: Sequence[Tensor], iou_threshold: float = 0.5
    ) -> tuple[Tensor, Tensor]:
        """:meth:`encode` for a list of images -> (boxes_xywh (N, B, 4), labels (N, B) int64)."""
        if len(boxes_ltrb) != len(labels):
            raise ValueError(f"got {len(boxes_ltrb)} box tensors but {len(labels)} label tensors")
        encoded = [self.encode(b, lab, iou_threshold) for b, lab in zip(boxes_ltrb, labels, strict=True)]
        return torch.stack([e[0] for e in encoded]), torch.stack([e[1] for e in encoded])

    # ------------------------------------------------------------------ decode
    def decode_boxes(self, locs: Tensor) -> Tensor:
        """Offsets (N, 4, B) -> boxes (N, B, 4) float32 ltrb (not clamped).

        Same float32 operations, in the same order, as the reference ``scale_back_batch``.
        """
        _, dboxes_xywh = self._dboxes(locs.device)
        dboxes_xywh = dboxes_xywh.unsqueeze(0)
        boxes = locs.float().clone().permute(0, 2, 1)  # (N, B, 4)
        boxes[:, :, :2] = self.scale_xy * boxes[:, :, :2]
        boxes[:, :, 2:] = self.scale_wh * boxes[:, :, 2:]
        boxes[:, :, :2] = boxes[:, :, :2] * dboxes_xywh[:, :, 2:] + dboxes_xywh[:, :, :2]
        boxes[:, :, 2:] = boxes[:, :, 2:].exp() * dboxes_xywh[:, :, 2:]
        left = boxes[:, :, 0] - 0.5 * boxes[:, :, 2]
        top = boxes[:, :, 1] - 0.5 * boxes[:, :, 3]
        right = boxes[:, :, 0] + 0.5 * boxes[:, :, 2]
        bottom = boxes[:, :, 1] + 0.5 * boxes[:, :, 3]
        return torch.stack([left, top, right, bottom], dim=2)

    @torch.no_grad()
    def decode(
        self,
        locs: Tensor,
        logits: Tensor,
        score_thresh: float = 0.05,
        nms_iou: float = 0.5,
        topk_per_class: int = 200,
        max_detections: int = 200,
    ) -> list[dict[str, Tensor]]:
        """Network outputs -> detections per image.

        Args:
            locs: (N, 4, B) box offsets.
            logits: (N, C, B) class logits, class 0 = background.
            score_thresh: keep class scores (softmax) strictly greater than this.
            nms_iou: a candidate is suppressed by a kept box of the same class when IoU >= this.
            topk_per_class: candidates per (image, class) entering NMS, highest scores first.
            max_detections: detections kept per image, highest scores first.

        Returns:
            one dict per image: ``boxes`` (k, 4) float32 ltrb relative to the image (not clamped),
            ``scores`` (k,) float32, ``labels`` (k,) int64 in 1..C-1; sorted by descending score.
        """
        if locs.ndim != 3 or locs.shape[1] != 4 or locs.shape[2] != self.num_boxes:
            raise ValueError(f"locs must have shape (N, 4, {self.num_boxes}), got {tuple(locs.shape)}")
        if logits.ndim != 3 or logits.shape[0] != locs.shape[0] or logits.shape[2] != self.num_boxes:
            raise ValueError(
                f"logits must have shape ({locs.shape[0]}, C, {self.num_boxes}), got {tuple(logits.shape)}"
            )
        n_img, n_cls, _ = logits.shape
        boxes = self.decode_boxes(locs)  # (N, B, 4)
        probs = torch.softmax(logits.float().permute(0, 2, 1), dim=-1)  # (N, B, C), as the reference

        # 1. Candidates: score > thresh, foreground classes; nonzero orders them by (image, class, box).
        img, cls, box = (probs.permute(0, 2, 1)[:, 1:, :] > score_thresh).nonzero(as_tuple=True)
        scores = probs[img, box, cls + 1]
        group = img * (n_cls - 1) + cls  # (image, class) pair

        # 2. Per group: score descending, ties -> larger box index first; keep the top-k.
        order = _segmented_sort_desc(scores, group)
        img, cls, box, scores, group = img[order], cls[order], box[order], scores[order], group[order]
        rank = _rank_in_segment(group, n_img * (n_cls - 1))
        top = rank < topk_per_class
        img, cls, box, scores, group = img[top], cls[top], box[top], scores[top], group[top]

        # 3. Greedy NMS inside every group, batched over groups.
        keep = _batched_greedy_nms(boxes[img, box], group, nms_iou)
        img, cls, box, scores = img[keep], cls[keep], box[keep], scores[keep]

        # 4. Per image: the best max_detections. Candidates are ordered (class, NMS pick) inside an image,
        #    which is the reference's concatenation order; ties go to the later one.
        order = _segmented_sort_desc(scores, img)
        img, cls, box, scores = img[order], cls[order], box[order], scores[order]
        top = _rank_in_segment(img, n_img) < max_detections
        img, cls, box, scores = img[top], cls[top], box[top], scores[top]

        det_boxes = boxes[img, box]
        counts = torch.bincount(img, minlength=n_img).tolist()
        return [
            {"boxes": b, "scores": s, "labels": c + 1}
            for b, s, c in zip(det_boxes.split(counts), scores.split(counts), cls.split(counts), strict=True)
        ]


def _segmented_sort_desc(values: Tensor, segment: Tensor) -> Tensor:
    """Permutation that sorts by (segment ascending, value descending, position descending).

    Ties in value put the later position first, which is what a stable ascending sort read from the
    end (the reference's ``sort()`` then ``[-k:]``) does.
    """
    order = torch.arange(values.numel() - 1, -1, -1, device=values.device)
    order = order[torch.sort(values[order], descending=True, stable=True).indices]
    return order[torch.sort(segment[order], stable=True).indices]


def _rank_in_segment(segment: Tensor, num_segments: int) -> Tensor:
    """Position of every element inside its run, for a ``segment`` tensor sorted ascending."""
    counts = torch.bincount(segment, minlength=num_segments)
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(segment.numel(), device=segment.device) - starts[segment]


# Pairs of boxes processed at once by the batched NMS (memory: about 40 bytes per pair).
_NMS_PAIRS_PER_CHUNK = 1 << 22


def _batched_greedy_nms(boxes: Tensor, group: Tensor, iou_threshold: float) -> Tensor:
    """Greedy NMS inside each group, all groups at once.

    Args:
        boxes: (M, 4) ltrb float32 candidates, sorted by group and, inside a group, by processing order.
        group: (M,) group id, non-decreasing.
        iou_threshold: suppress a candidate whose IoU with a kept, earlier one is >= this (or NaN),
            i.e. keep it only when ``iou < iou_threshold``, exactly as the reference.

    Returns:
        (M,) bool, True for kept candidates.
    """
    keep = torch.ones_like(group, dtype=torch.bool)
    if group.numel() == 0:
        return keep
    counts = torch.unique_consecutive(group, return_counts=True)[1]
    # Groups of one need no NMS; process the others from the largest down so each chunk pads little.
    multi = (counts > 1).nonzero().squeeze(1)
    multi = multi[torch.sort(counts[multi], descending=True, stable=True).indices]
    sizes = counts[multi].tolist()
    first_of_group = torch.cumsum(counts, 0) - counts
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    start = 0
    while start < len(sizes):
        width = sizes[start]
        stop = min(len(sizes), start + max(1, _NMS_PAIRS_PER_CHUNK // (width * width)))
        chunk = multi[start:stop]  # (G,)
        # Padded (G, width) index of each candidate into the flat arrays; -1 where the group is short.
        pos = first_of_group[chunk, None] + torch.arange(width, device=group.device)
        valid = torch.arange(width, device=group.device) < counts[chunk, None]
        pos = torch.where(valid, pos, torch.zeros_like(pos))
        keep[pos[valid]] = _greedy_nms_padded(boxes[pos], area[pos], valid, iou_threshold)[valid]
        start = stop
    return keep


def _greedy_nms_padded(boxes: Tensor, area: Tensor, valid: Tensor, iou_threshold: float) -> Tensor:
    """Greedy NMS on (G, K, 4) ltrb boxes already in processing order; ``valid`` (G, K) marks real ones.

    IoU is computed with the reference arithmetic (float32, intersection clamped at 0, no epsilon).
    """
    lt = torch.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])  # (G, K, K, 2)
    rb = torch.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    iou = inter / (area[:, :, None] + area[:, None, :] - inter)  # (G, K, K): [g, kept i, candidate j]
    width = boxes.shape[1]
    later = torch.ones(width, width, dtype=torch.bool, device=boxes.device).triu(1)
    suppress = ~(iou < iou_threshold) & later  # only earlier boxes suppress later ones
    alive = valid.clone()
    for i in range(width - 1):
        alive &= ~(suppress[:, i, :] & alive[:, i, None])
    return alive
