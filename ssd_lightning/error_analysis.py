"""Where a detector goes wrong, from what the COCO evaluation already has: PR curves and confusion matrices.

PR curves come from COCOeval's own ``eval["precision"]`` (no second matcher). numpy only; boxes are COCO
``[x, y, w, h]`` pixels, the ``(M, 7)`` layout of :mod:`ssd_lightning.evaluation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PRCurves", "detection_confusion_matrix", "ground_truth_array", "pr_curves_from_precision"]
__all__ += ["top_confusions"]


@dataclass(frozen=True)
class PRCurves:
    """Precision at fixed recall points ``recall`` ``(R,)``, at IoU thresholds ``iou_thresholds`` ``(I,)``:
    ``precision`` ``(I, K, R)`` per category and ``ap`` ``(I, K)`` its mean (NaN without ground truth);
    ``all_precision`` ``(I, R)``, the mean over categories with ground truth, and ``all_ap`` ``(I,)``."""

    iou_thresholds: np.ndarray
    recall: np.ndarray
    precision: np.ndarray
    ap: np.ndarray
    all_precision: np.ndarray
    all_ap: np.ndarray


def pr_curves_from_precision(
    precision: np.ndarray,
    iou_thresholds: Sequence[float] | np.ndarray,
    recall_thresholds: Sequence[float] | np.ndarray,
    *,
    ious: Sequence[float] = (0.5, 0.75),
    area_index: int = 0,
    max_dets_index: int = -1,
) -> PRCurves:
    """PR curves at the IoU thresholds ``ious`` (each one of ``iou_thresholds``) from ``eval["precision"]``;
    arguments as :func:`ssd_lightning.evaluation.class_ap_from_precision`, ``recall_thresholds``: ``(R,)``."""
    precision = np.asarray(precision, dtype=np.float64)
    if precision.ndim != 5:
        raise ValueError(f"precision must have shape (T, R, K, A, M), got {tuple(precision.shape)}")
    thresholds = np.asarray(iou_thresholds, dtype=np.float64).reshape(-1)
    recall = np.asarray(recall_thresholds, dtype=np.float64).reshape(-1)
    if thresholds.shape[0] != precision.shape[0] or recall.shape[0] != precision.shape[1]:
        raise ValueError(
            f"precision has T={precision.shape[0]}, R={precision.shape[1]} but {thresholds.shape[0]} IoU "
            f"thresholds and {recall.shape[0]} recall points were given"
        )
    found = [np.flatnonzero(np.isclose(thresholds, float(iou))) for iou in ious]
    for iou, at in zip(ious, found, strict=True):
        if at.size != 1:
            raise ValueError(f"IoU {iou} is not one of the evaluation's thresholds {thresholds.tolist()}")
    rows = [int(at[0]) for at in found]
    selected = precision[rows][:, :, :, area_index, max_dets_index]  # (I, R, K)
    curves = np.ascontiguousarray(np.transpose(selected, (0, 2, 1)))  # (I, K, R)
    defined = curves > -1
    count = defined.sum(axis=2)
    total = np.where(defined, curves, 0.0).sum(axis=2)  # along the contiguous axis: pairwise, as np.mean
    ap = np.divide(total, count, out=np.full(count.shape, np.nan), where=count > 0)
    curves = np.where(defined, curves, np.nan)
    has_gt = defined.all(axis=2)  # COCOeval leaves -1 only for a whole category without ground truth
    n = has_gt.sum(axis=1)  # (I,)
    total = np.where(has_gt[:, :, None], curves, 0.0).sum(axis=1)  # (I, R)
    all_precision = np.divide(total, n[:, None], out=np.full(total.shape, np.nan), where=n[:, None] > 0)
    all_ap = np.array([np.mean(curves[i][has_gt[i]]) if n[i] else np.nan for i in range(len(rows))])
    return PRCurves(thresholds[rows], recall, curves, ap, all_precision, all_ap)


def ground_truth_array(annotations: Sequence[dict]) -> np.ndarray:
    """COCO ``annotations`` as an ``(N, 7)`` float64 array ``[image_id, x, y, w, h, category_id, iscrowd]``
    (what :func:`detection_confusion_matrix` takes); an annotation without ``bbox`` is left out."""
    rows = [
        (a["image_id"], *a["bbox"], a["category_id"], 1.0 if a.get("iscrowd", 0) else 0.0)
        for a in annotations
        if "bbox" in a
    ]
    return np.asarray(rows, dtype=np.float64).reshape(-1, 7)


def _category_index(category_ids: np.ndarray, values: np.ndarray, what: str) -> np.ndarray:
    at = np.searchsorted(category_ids, values)
    bad = category_ids[np.minimum(at, len(category_ids) - 1)] != values  # also a value above every id
    if bad.any():
        raise ValueError(
            f"{what} use category id(s) {sorted(set(values[bad].astype(int).tolist()))[:10]} that are not "
            f"among the {len(category_ids)} categories given"
        )
    return at


def _padded(image_index: np.ndarray, n_images: int, xywh: np.ndarray, cls: np.ndarray):
    """Rows grouped by ``image_index`` (already sorted) -> ``(n_images, width, 4)`` ltrb boxes (0 padding),
    ``(n_images, width)`` class indices (-1 padding) and validity mask; ``width`` is the largest group."""
    counts = np.bincount(image_index, minlength=n_images)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(len(image_index)) - starts[image_index]
    valid = np.zeros((n_images, int(counts.max())), dtype=bool)
    valid[image_index, slot] = True
    boxes = np.zeros((*valid.shape, 4))
    boxes[image_index, slot] = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:4]], axis=1)  # ltrb
    classes = np.full(valid.shape, -1, dtype=cls.dtype)
    classes[image_index, slot] = cls
    return boxes, classes, valid


def _overlaps(dets: np.ndarray, gts: np.ndarray, crowd: bool) -> np.ndarray:
    """``(C, D, 4)``, ``(C, G, 4)`` ltrb -> ``(C, D, G)`` IoU (crowd: intersection / detection area, as
    COCOeval); numpy, not ``models.boxes.box_iou``: a leaf does not import ``models/`` (one layer up)."""
    lt = np.maximum(dets[:, :, None, :2], gts[:, None, :, :2])
    rb = np.minimum(dets[:, :, None, 2:], gts[:, None, :, 2:])
    wh = np.clip(rb - lt, 0.0, None)
    inter = wh[..., 0] * wh[..., 1]
    area_d = ((dets[..., 2] - dets[..., 0]) * (dets[..., 3] - dets[..., 1]))[:, :, None]
    area_g = ((gts[..., 2] - gts[..., 0]) * (gts[..., 3] - gts[..., 1]))[:, None, :]
    union = area_d if crowd else area_d + area_g - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def _greedy(iou: np.ndarray, threshold: float, det_open: np.ndarray, gt_open: np.ndarray) -> np.ndarray:
    """``(C, D)`` ground-truth column matched to each detection (best score first), -1: none; ``iou`` (C, D,
    G) (-1: may not match), ``det_open`` (C, D) to match, ``gt_open`` (C, G) still free (updated in place)."""
    n_img, n_det, _ = iou.shape
    match = np.full((n_img, n_det), -1, dtype=np.int64)
    rows = np.arange(n_img)
    for d in range(n_det):
        candidates = np.where(gt_open, iou[:, d, :], -1.0)
        if candidates.shape[1] == 0:
            break
        best = candidates.argmax(axis=1)
        ok = (candidates[rows, best] >= threshold) & det_open[:, d]
        match[ok, d] = best[ok]
        gt_open[rows[ok], best[ok]] = False
    return match


def detection_confusion_matrix(
    detections: np.ndarray,
    ground_truth: np.ndarray,
    category_ids: Sequence[int] | np.ndarray,
    *,
    iou_threshold: float = 0.5,
    score_threshold: float = 0.3,
    image_ids: Sequence[int] | np.ndarray | None = None,
    max_cells: int = 4_000_000,
) -> np.ndarray:
    """``(K+1, K+1)`` counts, rows the ground-truth class (k: k-th sorted category id; K: background),
    columns the predicted one. Detections with ``score >= score_threshold``, per image by descending score,
    take the free same-class ground-truth box of highest IoU ``>= iou_threshold`` (COCOeval's rule: the
    diagonal is its true positives); those on a crowd region of their class are not counted; the rest match
    the ground truth left of any class the same way. ``ground_truth``: :func:`ground_truth_array`'s;
    ``max_cells``: IoU cells computed at once."""
    dets = np.asarray(detections, dtype=np.float64).reshape(-1, 7)
    gt = np.asarray(ground_truth, dtype=np.float64).reshape(-1, 7)
    cats = np.unique(np.asarray(category_ids, dtype=np.int64).reshape(-1))
    if len(cats) == 0:
        raise ValueError("category_ids is empty")
    dets = dets[dets[:, 5] >= score_threshold]
    if image_ids is not None:
        keep = np.asarray(image_ids, dtype=np.int64).reshape(-1)
        dets = dets[np.isin(dets[:, 0].astype(np.int64), keep)]
        gt = gt[np.isin(gt[:, 0].astype(np.int64), keep)]
    det_cls = _category_index(cats, dets[:, 6].astype(np.int64), "detections")
    gt_cls = _category_index(cats, gt[:, 5].astype(np.int64), "ground-truth boxes")
    images, index = np.unique(np.concatenate([dets[:, 0], gt[:, 0]]).astype(np.int64), return_inverse=True)
    det_img, gt_img = index[: len(dets)], index[len(dets) :]
    matrix = np.zeros((len(cats) + 1, len(cats) + 1), dtype=np.int64)
    if len(images) == 0:
        return matrix
    # detections sorted by image, then descending score (stable: ties keep their order, as COCOeval)
    order = np.lexsort((-dets[:, 5], det_img))
    groups = [_padded(det_img[order], len(images), dets[order, 1:5], det_cls[order])]
    crowd = gt[:, 6] > 0
    for sel in (np.flatnonzero(~crowd), np.flatnonzero(crowd)):  # ground truth, then crowd regions
        sel = sel[np.argsort(gt_img[sel], kind="stable")]
        groups.append(_padded(gt_img[sel], len(images), gt[sel, 1:5], gt_cls[sel]))
    width = max(1, groups[0][0].shape[1]) * max(1, groups[1][0].shape[1] + groups[2][0].shape[1])
    chunk = max(1, max_cells // width)
    threshold = min(float(iou_threshold), 1 - 1e-10)  # COCOeval's comparison
    for start in range(0, len(images), chunk):
        _count_images(matrix, *([a[start : start + chunk] for a in group] for group in groups), threshold)
    return matrix


def _count_images(matrix: np.ndarray, dets: list, gts: list, crowds: list, threshold: float) -> None:
    """Add a chunk of images to ``matrix``; ``dets``, ``gts``, ``crowds``: :func:`_padded` of each."""
    (d_box, dc, dv), (g_box, gc, gv), (c_box, cc, cv) = dets, gts, crowds
    k = matrix.shape[0] - 1
    iou = _overlaps(d_box, g_box, crowd=False)
    iou[~(dv[:, :, None] & gv[:, None, :])] = -1.0
    gt_open = gv.copy()
    first = _greedy(np.where(dc[:, :, None] == gc[:, None, :], iou, -1.0), threshold, dv, gt_open)
    ioa = _overlaps(d_box, c_box, crowd=True)
    own_crowd = (dc[:, :, None] == cc[:, None, :]) & cv[:, None, :] & (ioa >= threshold)
    det_open = dv & (first < 0) & ~own_crowd.any(axis=2)
    second = _greedy(iou, threshold, det_open, gt_open)
    match = np.where(first >= 0, first, second)
    rows, cols = np.nonzero(match >= 0)
    fp = det_open & (second < 0)
    # matched pairs, false positives (background row), ground truth still free (missed: background column)
    true = np.concatenate([gc[rows, match[rows, cols]], np.full(int(fp.sum()), k), gc[gt_open]])
    predicted = np.concatenate([dc[rows, cols], dc[fp], np.full(int(gt_open.sum()), k)])
    matrix += np.bincount(true * (k + 1) + predicted, minlength=(k + 1) ** 2).reshape(k + 1, k + 1)


def top_confusions(
    matrix: np.ndarray, n: int = 3, *, include_background: bool = False
) -> list[tuple[int, int, int]]:
    """The ``n`` largest off-diagonal cells of a confusion matrix (rows true, columns predicted) as
    ``(true, predicted, count)``, largest first (ties: row then column order), zero cells left out.
    ``include_background=False`` leaves out the last row and column (a detection matrix's background)."""
    m = np.asarray(matrix)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"a confusion matrix is square, got shape {m.shape}")
    size = m.shape[0] - (0 if include_background else 1)
    sub = m[:size, :size].astype(np.int64)  # a copy
    np.fill_diagonal(sub, 0)
    flat = sub.reshape(-1)
    order = np.argsort(-flat, kind="stable")[:n]
    return [(int(i // size), int(i % size), int(flat[i])) for i in order if flat[i] > 0]
