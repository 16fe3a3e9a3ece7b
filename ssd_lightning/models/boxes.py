"""Default boxes (anchors) of SSD300 v1.1 and the box coder that maps ground truth onto them.

Box formats: ``cxcywh`` (cx, cy, w, h) and ``ltrb`` (torchvision's ``xyxy``), both relative to the image
size; ``xywh`` is COCO's (left, top, w, h) in pixels (the NVIDIA reference's ``xywh`` is the centre form).
Default-box order (the reference's, and the SSD300 heads'): per feature map, per box size, per location.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import torch
from torch import Tensor
from torchvision.ops import box_convert


@dataclass(frozen=True, eq=False)
class DecoderSettings(Mapping):
    """:meth:`BoxCoder.decode`'s settings and their one set of defaults, as a read-only mapping: scores >
    ``score_thresh``, the best ``topk_per_class`` per class into NMS (IoU >= ``nms_iou`` suppressed), then
    the best ``max_detections`` per image."""

    score_thresh: float = 0.05
    nms_iou: float = 0.5
    topk_per_class: int = 200
    max_detections: int = 200

    def __post_init__(self) -> None:
        if self.topk_per_class < 1 or self.max_detections < 1:
            raise ValueError(
                f"topk_per_class and max_detections must be >= 1, got {self.topk_per_class} and "
                f"{self.max_detections}"
            )

    @classmethod
    def from_mapping(cls, overrides: Mapping | None = None, base: Mapping | None = None) -> DecoderSettings:
        """``base`` (default: the defaults) updated with ``overrides`` (``None``: kept); unknown keys fail."""
        v = dict(base or cls())
        for key, value in dict(overrides or {}).items():
            if key not in v:
                raise ValueError(f"unknown decoder setting {key!r}; accepted: {sorted(v)}")
            if value is not None:
                v[key] = value
        return cls(
            float(v["score_thresh"]), float(v["nms_iou"]), int(v["topk_per_class"]), int(v["max_detections"])
        )

    def __getitem__(self, key: str) -> float:
        return asdict(self)[key]

    def __iter__(self) -> Iterator[str]:
        return (f.name for f in fields(self))

    def __len__(self) -> int:
        return len(fields(self))


def scale_to_pixels(
    detections: Sequence[dict[str, Tensor]], image_sizes: Tensor | Sequence[Sequence[int]]
) -> list[dict[str, Tensor]]:
    """Per image ``boxes`` (k, 4) relative ltrb -> float32 pixels (not clipped) of its ``image_sizes`` (N, 2)
    ``(height, width)``; ``scores`` and ``labels`` untouched."""
    device = detections[0]["boxes"].device if len(detections) else torch.device("cpu")
    sizes = torch.as_tensor(image_sizes).to(device, torch.float32).reshape(-1, 2)
    scale = sizes[:, [1, 0, 1, 0]]  # (N, 4) width, height, width, height
    if len(scale) != len(detections):
        raise ValueError(f"{len(detections)} images of detections but {len(scale)} image sizes")
    return [{**det, "boxes": det["boxes"] * scale[i]} for i, det in enumerate(detections)]


def cxcywh_to_ltrb(boxes: Tensor) -> Tensor:
    cxcy, wh = boxes[..., :2], boxes[..., 2:]
    return torch.cat([cxcy - 0.5 * wh, cxcy + 0.5 * wh], dim=-1)


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU of every pair: (..., M, 4) ltrb x (..., K, 4) ltrb -> (..., M, K), leading dims broadcast; the
    arithmetic of the reference's ``calc_iou_tensor`` and ``torchvision.ops.box_iou`` (no batch dims)."""
    lt = torch.maximum(boxes1[..., :, None, :2], boxes2[..., None, :, :2])
    rb = torch.minimum(boxes1[..., :, None, 2:], boxes2[..., None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    area1 = (boxes1[..., 2] - boxes1[..., 0]) * (boxes1[..., 3] - boxes1[..., 1])
    area2 = (boxes2[..., 2] - boxes2[..., 0]) * (boxes2[..., 3] - boxes2[..., 1])
    return inter / (area1[..., :, None] + area2[..., None, :] - inter)


def match_boxes(
    boxes_ltrb: Tensor, default_ltrb: Tensor, iou_threshold: float = 0.5, *, last_wins_ties: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """The package's one matcher: ground truth (n, m, 4) of n images (m >= 1) onto default boxes (B, 4), ltrb.

    Every ground truth is forced onto its best default box (IoU counted as 2; the later of several wins);
    every other default box takes its best ground truth, positive when IoU > ``iou_threshold``. Equal IoUs:
    the smaller index wins (the reference's ``torch.max``), with ``last_wins_ties`` the larger (DALI's
    ``fn.box_encoder``). Returns ``gt_index`` (n, B) int64, ``positive`` (n, B) bool and ``best_iou`` (n, m)
    float32, each ground truth's highest IoU before forcing.
    """
    ious = box_iou(boxes_ltrb, default_ltrb)  # (n, m, B)
    best_iou, forced_at = _max(ious, 2, last_wins_ties)  # per ground truth: (n, m)
    gt_iou, gt_index = _max(ious, 1, last_wins_ties)  # per default box: (n, B)
    forced = torch.full_like(gt_index, -1)  # the last ground truth forced onto each default box
    gts = torch.arange(forced_at.shape[1], device=forced.device).expand_as(forced_at)
    forced.scatter_reduce_(1, forced_at, gts, reduce="amax")
    positive = torch.where(forced >= 0, 2.0, gt_iou) > iou_threshold
    return torch.where(forced >= 0, forced, gt_index), positive, best_iou


def _max(values: Tensor, dim: int, last: bool) -> tuple[Tensor, Tensor]:
    """``values.max(dim)``; with ``last`` the largest index among equal maxima (else the smallest)."""
    best, index = values.flip(dim).max(dim) if last else values.max(dim)
    return best, (values.shape[dim] - 1 - index) if last else index


class DefaultBoxes:
    """The SSD default boxes for one square input of ``fig_size`` pixels.

    Per feature map (side ``feat_size``, pixel stride ``steps``) the sizes ``s_k`` and ``sqrt(s_k * s_{k+1})``
    of ``scales`` (pixels, one more than maps), plus ``(s*sqrt(a), s/sqrt(a))`` and its transpose for each
    ratio ``a`` of ``aspect_ratios``. ``cxcywh`` (B, 4) float32 is clamped to [0, 1], ``ltrb`` is not.
    """

    scale_xy, scale_wh = 0.1, 0.2  # variances of the centre and log-size offsets

    def __init__(
        self,
        fig_size: int,
        feat_size: Sequence[int],
        steps: Sequence[int],
        scales: Sequence[float],
        aspect_ratios: Sequence[Sequence[float]],
    ) -> None:
        n = len(feat_size)
        if len(steps) != n or len(aspect_ratios) != n:
            raise ValueError(
                f"feat_size, steps and aspect_ratios need one entry per feature map; got "
                f"{len(feat_size)}, {len(steps)} and {len(aspect_ratios)}"
            )
        if len(scales) != n + 1:
            raise ValueError(f"scales needs len(feat_size) + 1 = {n + 1} entries, got {len(scales)}")
        boxes: list[tuple[float, float, float, float]] = []
        for idx, sfeat in enumerate(feat_size):
            fk = fig_size / steps[idx]
            sk1 = scales[idx] / fig_size
            sk3 = math.sqrt(sk1 * (scales[idx + 1] / fig_size))
            sizes = [(sk1, sk1), (sk3, sk3)]
            for alpha in aspect_ratios[idx]:
                w, h = sk1 * math.sqrt(alpha), sk1 / math.sqrt(alpha)
                sizes += [(w, h), (h, w)]
            for w, h in sizes:
                for i, j in itertools.product(range(sfeat), repeat=2):
                    boxes.append(((j + 0.5) / fk, (i + 0.5) / fk, w, h))
        self.cxcywh: Tensor = torch.tensor(boxes, dtype=torch.float32).clamp_(min=0, max=1)
        self.ltrb: Tensor = cxcywh_to_ltrb(self.cxcywh)

    def __len__(self) -> int:
        return self.cxcywh.shape[0]


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

    ``encode`` is the NVIDIA reference ``Encoder.encode``, ``decode`` its ``decode_batch`` batched on tensors.
    Equal scores rank as a stable sort in the reference would: the larger default-box index first inside a
    class, then in the per-image cut the larger class (then the later NMS pick) first.
    """

    def __init__(self, default_boxes: DefaultBoxes) -> None:
        self.default_boxes = default_boxes
        self._cache: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _dboxes(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(ltrb (B, 4), cxcywh (B, 4)) float32 on ``device``."""
        if device not in self._cache:
            self._cache[device] = (self.default_boxes.ltrb.to(device), self.default_boxes.cxcywh.to(device))
        return self._cache[device]

    def encode(self, boxes_ltrb: Tensor, labels: Tensor, iou_threshold: float = 0.5) -> tuple[Tensor, Tensor]:
        """Ground truth ``boxes_ltrb`` (M, 4) in [0, 1], ``labels`` (M,) -> per default box the matched box
        (itself when unmatched), (B, 4) float32 cxcywh, and its label (B,) int64, 0 where unmatched."""
        if boxes_ltrb.ndim != 2 or boxes_ltrb.shape[-1] != 4:
            raise ValueError(f"boxes_ltrb must have shape (M, 4), got {tuple(boxes_ltrb.shape)}")
        if labels.shape != boxes_ltrb.shape[:1]:
            raise ValueError(
                f"labels must have shape ({boxes_ltrb.shape[0]},) to match boxes_ltrb, "
                f"got {tuple(labels.shape)}"
            )
        dboxes_ltrb, _ = self._dboxes(boxes_ltrb.device)
        boxes_ltrb = boxes_ltrb.float()
        out_boxes = dboxes_ltrb.clone()
        out_labels = torch.zeros(len(self.default_boxes), dtype=torch.int64, device=boxes_ltrb.device)
        if boxes_ltrb.shape[0] > 0:
            gt_index, positive, _ = match_boxes(boxes_ltrb[None], dboxes_ltrb, iou_threshold)
            positive, matched_gt = positive[0], gt_index[0, positive[0]]
            out_labels[positive] = labels.to(torch.int64)[matched_gt]
            out_boxes[positive] = boxes_ltrb[matched_gt]
        return box_convert(out_boxes, "xyxy", "cxcywh"), out_labels

    def decode_boxes(self, locs: Tensor) -> Tensor:
        """Offsets (N, 4, B) -> (N, B, 4) float32 ltrb, the reference ``scale_back_batch``'s operations."""
        _, dboxes = self._dboxes(locs.device)  # (B, 4) cxcywh
        offsets = locs.float().permute(0, 2, 1)  # (N, B, 4)
        xy = self.default_boxes.scale_xy * offsets[..., :2] * dboxes[:, 2:] + dboxes[:, :2]
        wh = (self.default_boxes.scale_wh * offsets[..., 2:]).exp() * dboxes[:, 2:]
        return cxcywh_to_ltrb(torch.cat([xy, wh], dim=-1))

    @staticmethod
    def foreground_scores(logits: Tensor) -> Tensor:
        """Logits (N, C, B) -> softmax scores (N, C - 1, B) float32 of classes 1..C-1 (as the reference)."""
        probs = torch.softmax(logits.float().permute(0, 2, 1), dim=-1)  # (N, B, C)
        return probs[:, :, 1:].permute(0, 2, 1)

    @torch.no_grad()
    def detect(
        self,
        locs: Tensor,
        logits: Tensor,
        image_sizes: Tensor | Sequence[Sequence[int]],
        settings: Mapping | None = None,
    ) -> list[dict[str, Tensor]]:
        """:meth:`decode` with ``settings``, boxes in each image's pixels (validation, predict, ONNX)."""
        detections = self.decode(locs.float(), logits.float(), **(settings or DecoderSettings()))
        return scale_to_pixels(detections, image_sizes)

    @torch.no_grad()
    def decode(
        self,
        locs: Tensor,
        logits: Tensor,
        score_thresh: float = DecoderSettings.score_thresh,
        nms_iou: float = DecoderSettings.nms_iou,
        topk_per_class: int = DecoderSettings.topk_per_class,
        max_detections: int = DecoderSettings.max_detections,
    ) -> list[dict[str, Tensor]]:
        """``locs`` (N, 4, B), ``logits`` (N, C, B) (class 0 = background) -> per image, best first: ``boxes``
        (k, 4) float32 relative ltrb (not clamped), ``scores`` (k,), ``labels`` (k,) int64 in 1..C-1."""
        n_box = len(self.default_boxes)
        if locs.ndim != 3 or locs.shape[1] != 4 or locs.shape[2] != n_box:
            raise ValueError(f"locs must have shape (N, 4, {n_box}), got {tuple(locs.shape)}")
        n_img = locs.shape[0]
        if logits.ndim != 3 or logits.shape[0] != n_img or logits.shape[2] != n_box:
            raise ValueError(f"logits must have shape ({n_img}, C, {n_box}), got {tuple(logits.shape)}")
        DecoderSettings(score_thresh, nms_iou, topk_per_class, max_detections)  # validates
        n_fg = logits.shape[1] - 1
        device = locs.device
        boxes = self.decode_boxes(locs)  # (N, B, 4)

        # 1. One row per (image, foreground class): candidates are scores > thresh, top-k of them.
        rows = self.foreground_scores(logits).reshape(n_img * n_fg, n_box)  # (G, B)
        candidate = rows > score_thresh
        k = min(topk_per_class, int(candidate.sum(dim=1).max())) if rows.numel() else 0
        if k == 0:
            none = torch.zeros(0, dtype=torch.int64, device=device)
            return [
                {"boxes": boxes.new_zeros(0, 4), "scores": boxes.new_zeros(0), "labels": none}
                for _ in range(n_img)
            ]
        rows = rows.masked_fill_(~candidate, -math.inf)
        scores, box_idx = _topk_rows(rows, k)  # (G, k) each, best first
        valid = scores > -math.inf
        row_img = torch.arange(n_img, device=device).repeat_interleave(n_fg)  # (G,)
        row_boxes = boxes[row_img[:, None], box_idx]  # (G, k, 4)

        # 2. Greedy NMS inside every row, all rows at once.
        keep = _batched_greedy_nms(row_boxes, valid, nms_iou)  # (G, k)

        # 3. Per image the best max_detections; inside an image the (class, NMS pick) order is the
        #    reference's concatenation order, and ties go to the later entry, as in the reference.
        per_img = scores.masked_fill(~keep, -math.inf).view(n_img, n_fg * k)
        det_scores, pos = _topk_rows(per_img, max_detections)  # (N, m)
        present = det_scores > -math.inf
        det_labels = pos // k + 1
        det_boxes = row_boxes.view(n_img, n_fg * k, 4).gather(1, pos[..., None].expand(-1, -1, 4))
        counts = present.sum(dim=1).tolist()
        return [
            {"boxes": det_boxes[i, :c], "scores": det_scores[i, :c], "labels": det_labels[i, :c]}
            for i, c in enumerate(counts)
        ]


def _topk_rows(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``values`` (R, L) -> per row the ``k`` largest (values, int64 columns), best first, equal values the
    larger column first (the reference's stable ``sort()[-k:]``); ``-inf`` (absent) last."""
    length = values.shape[1]
    k = min(k, length)
    kk = min(k + 1, length)  # one more, to see a tie at the cut
    vals, idx = values.topk(kk, dim=1)  # sorted, but tie order unspecified
    present = vals > -math.inf
    tie_inside = ((vals[:, 1:] == vals[:, :-1]) & present[:, 1:]).any(dim=1)
    tie_at_cut = (vals[:, k - 1] == vals[:, k]) & present[:, k] if kk > k else torch.zeros_like(tie_inside)
    # Rows with a tie across the cut: which of the equal entries make it depends on columns outside
    # the selection, so sort the whole row (stable, on the reversed row: later column first).
    full = tie_at_cut.nonzero().squeeze(1)
    if full.numel():
        s = values[full].flip(1).sort(dim=1, descending=True, stable=True)
        vals[full], idx[full] = s.values[:, :kk], length - 1 - s.indices[:, :kk]
    # Rows with ties inside the selection only: reorder the selection.
    fix = (tie_inside & ~tie_at_cut).nonzero().squeeze(1)
    if fix.numel():
        v, i = vals[fix], idx[fix]
        o = i.argsort(dim=1, descending=True)
        v, i = v.gather(1, o), i.gather(1, o)
        o = v.sort(dim=1, descending=True, stable=True).indices
        vals[fix], idx[fix] = v.gather(1, o), i.gather(1, o)
    return vals[:, :k], idx[:, :k]


_PAIRS_PER_CHUNK = 1 << 21  # box pairs whose IoU is computed at once (bounds the memory of one step)


def _batched_greedy_nms(boxes: Tensor, valid: Tensor, iou_threshold: float) -> Tensor:
    """Greedy NMS in every row at once, the reference's arithmetic and rule: (G, K, 4) ltrb ``boxes`` in
    score order, (G, K) ``valid`` -> (G, K) kept. A box is suppressed by an earlier kept one when their IoU
    is not ``< iou_threshold`` (NaN too). Rows of regular boxes look only at pairs close along x
    (:func:`_sweep_pairs`), others at all K^2 pairs.
    """
    width = valid.shape[1]
    if width < 2:
        return valid.clone()
    x1, y1, x2, y2 = boxes.unbind(-1)
    regular = (x2 > x1) & (y2 > y1) & torch.isfinite((x2 - x1) * (y2 - y1))  # NaN fails the comparisons
    needs_nms = valid.sum(dim=1) > 1
    sweep = (regular | ~valid).all(dim=1) & (iou_threshold > 0)
    dense = _all_pairs(boxes, valid, (needs_nms & ~sweep).nonzero().squeeze(1), iou_threshold)
    sparse = _sweep_pairs(boxes, valid, (needs_nms & sweep).nonzero().squeeze(1), iou_threshold)
    none = torch.zeros(0, dtype=torch.int64, device=boxes.device)
    src, dst = (torch.cat([none, *a, *b]) for a, b in zip(dense, sparse, strict=True))
    # Greedy result on the suppression graph (edges earlier -> later box): kept iff no kept box has an
    # edge to it. Iterating "kept = valid and not hit by a kept box" fixes every box whose predecessors
    # are fixed, and the fixed point is unique, so stopping at the first repeat is exact.
    valid_flat = valid.flatten()
    alive = valid_flat
    while True:
        hit = torch.zeros_like(valid_flat)
        hit[dst[alive[src]]] = True
        new = valid_flat & ~hit
        if torch.equal(new, alive):
            return new.view_as(valid)
        alive = new


def _all_pairs(boxes: Tensor, valid: Tensor, rows: Tensor, iou_threshold: float) -> tuple[list, list]:
    """Suppression edges (flat ``row * K + i`` -> ``row * K + j``, i < j) of ``rows``, from all K^2 pairs."""
    width = valid.shape[1]
    later = torch.ones(width, width, dtype=torch.bool, device=boxes.device).triu_(1)
    src, dst = [], []
    step = max(1, _PAIRS_PER_CHUNK // (width * width))
    for start in range(0, rows.numel(), step):
        r = rows[start : start + step]
        suppress = ~(box_iou(boxes[r], boxes[r]) < iou_threshold) & later & valid[r, :, None]
        g, i, j = suppress.nonzero().unbind(1)
        src.append(r[g] * width + i)
        dst.append(r[g] * width + j)
    return src, dst


def _sweep_pairs(boxes: Tensor, valid: Tensor, rows: Tensor, iou_threshold: float) -> tuple[list, list]:
    """:func:`_all_pairs` for rows of regular boxes and ``iou_threshold > 0``, by a sweep along x: IoU >= t
    needs an x-overlap >= t * max(w_i, w_j), so after sorting by x1 the partners j of i are the run with
    x1_j <= x2_i - t * w_i (binary search; a small slack so rounding never drops a real pair).
    """
    num_rows, width = rows.numel(), valid.shape[1]
    sub_valid = valid[rows]
    x1s, order = torch.where(sub_valid, boxes[rows, :, 0], math.inf).sort(dim=1)
    sorted_boxes = boxes[rows].gather(1, order[..., None].expand(-1, -1, 4)).view(-1, 4)
    sx1, sx2 = x1s.flatten(), sorted_boxes[:, 2]
    reach = sx2 - iou_threshold * (sx2 - sx1) * (1 - 1e-4) + 1e-6 * (sx1.abs() + sx2.abs())
    ends = torch.searchsorted(x1s, reach.view(num_rows, width), right=True)
    counts = (ends - torch.arange(1, width + 1, device=boxes.device)).clamp_(min=0).flatten()
    counts[~sub_valid.gather(1, order).flatten()] = 0
    orig = (rows[:, None] * width + order).flatten()  # flat index (row * K + score rank) of each
    src, dst = [], []
    for i, j in _runs(counts):
        hit = ~(box_iou(sorted_boxes[i, None], sorted_boxes[j, None])[:, 0, 0] < iou_threshold)
        i, j = orig[i[hit]], orig[j[hit]]
        src.append(torch.minimum(i, j))  # the earlier box in score order suppresses the later
        dst.append(torch.maximum(i, j))
    return src, dst


def _runs(counts: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
    """Pairs (i, j) for every i and j = i + 1, ..., i + counts[i], about ``_PAIRS_PER_CHUNK`` at a time."""
    starts = torch.cumsum(counts, 0) - counts
    chunk_of_i = torch.div(starts, _PAIRS_PER_CHUNK, rounding_mode="floor")
    bounds = torch.searchsorted(chunk_of_i, torch.unique_consecutive(chunk_of_i)).tolist()
    for lo, hi in zip(bounds, [*bounds[1:], counts.numel()], strict=False):
        c = counts[lo:hi]
        total = int(c.sum())
        i = torch.arange(lo, hi, device=counts.device).repeat_interleave(c, output_size=total)
        first = (starts[lo:hi] - starts[lo]).repeat_interleave(c, output_size=total)  # i's first pair
        yield i, i + 1 + torch.arange(total, device=counts.device) - first
