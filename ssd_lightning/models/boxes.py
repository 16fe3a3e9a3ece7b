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

__all__ = ["DefaultBoxes", "dboxes300_coco", "xywh_to_ltrb", "ltrb_to_xywh", "box_iou"]


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
