"""Where a detector goes wrong, from what the COCO evaluation already has: PR curves and confusion matrices.

* :func:`pr_curves_from_precision` reads the precision/recall curves of every category (and of all of
  them) at chosen IoU thresholds out of COCOeval's own accumulated ``eval["precision"]`` array: no second
  matcher, so the mean of a curve is COCOeval's AP at that IoU.
* :func:`detection_confusion_matrix` counts, at one IoU and score threshold, which class each detection was
  given for which ground-truth class, with a background row (false positives) and column (missed ground
  truth). Each detection and each ground-truth box is matched at most once.
* :func:`top_confusions` lists the largest off-diagonal cells of any confusion matrix.

numpy only; boxes are COCO ``[x, y, w, h]`` in pixels, the layout of the ``(M, 7)`` results arrays of
:mod:`ssd_lightning.evaluation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "PRCurves",
    "detection_confusion_matrix",
    "ground_truth_array",
    "pr_curves_from_precision",
    "top_confusions",
]


@dataclass(frozen=True)
class PRCurves:
    """Precision at fixed recall points, per category and for all categories, at some IoU thresholds.

    Attributes:
        iou_thresholds: ``(I,)`` the IoU thresholds of the curves.
        recall: ``(R,)`` the recall points (COCOeval's ``params.recThrs``: 0, 0.01, ..., 1).
        precision: ``(I, K, R)`` COCOeval's interpolated precision of each category at each recall point
            (0 beyond the highest recall reached); NaN for a category without ground truth.
        ap: ``(I, K)`` the mean of each curve, COCOeval's per-category AP at that IoU; NaN likewise.
        all_precision: ``(I, R)`` the mean over the categories that have ground truth: the all-classes curve.
        all_ap: ``(I,)`` its mean, COCOeval's AP at that IoU (``mAP_50`` at 0.5); NaN without ground truth.
    """

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
    """PR curves at the IoU thresholds ``ious`` from COCOeval's ``eval["precision"]``.

    ``precision``, ``iou_thresholds``, ``area_index``, ``max_dets_index``: as
    :func:`ssd_lightning.evaluation.class_ap_from_precision`; ``recall_thresholds``: ``(R,)``
    ``params.recThrs``; each of ``ious`` must be one of ``iou_thresholds`` (else ValueError). A curve's mean
    is taken over the entries COCOeval counts (``> -1``), so ``ap[i, k]`` is exactly the per-category AP
    that ``COCOeval.summarize`` computes at that IoU.
    """
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
    rows = []
    for iou in ious:
        found = np.flatnonzero(np.isclose(thresholds, float(iou)))
        if found.size != 1:
            raise ValueError(f"IoU {iou} is not one of the evaluation's thresholds {thresholds.tolist()}")
        rows.append(int(found[0]))
    selected = precision[rows][:, :, :, area_index, max_dets_index]  # (I, R, K)
    curves = np.ascontiguousarray(np.transpose(selected, (0, 2, 1)))  # (I, K, R)
    defined = curves > -1
    count = defined.sum(axis=2)
    # a sum along the contiguous axis is pairwise, as COCOeval's np.mean
    ap = np.divide(
        np.where(defined, curves, 0.0).sum(axis=2), count, out=np.full(count.shape, np.nan), where=count > 0
    )
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
    at_clipped = np.minimum(at, len(category_ids) - 1)
    bad = (at >= len(category_ids)) | (category_ids[at_clipped] != values)
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
    if crowd:
        union = area_d
    else:
        area_g = ((gts[..., 2] - gts[..., 0]) * (gts[..., 3] - gts[..., 1]))[:, None, :]
        union = area_d + area_g - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def _greedy(iou: np.ndarray, threshold: float, det_open: np.ndarray, gt_open: np.ndarray) -> np.ndarray:
    """Match detections (in column order, best score first) to ground truth, each at most once.

    ``iou``: ``(C, D, G)``, ``-1`` where a pair may not match; ``det_open`` ``(C, D)`` the detections still
    to match, ``gt_open`` ``(C, G)`` the ground truth still free (updated in place). A detection takes the
    free ground truth of highest IoU if that is ``>= threshold``. Returns ``(C, D)`` the matched ground-truth
    column, -1 for none."""
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
    """Detection confusion matrix: ``(K+1, K+1)`` counts, rows the ground-truth class, columns the predicted
    class, index K (last) the background.

    Only detections with ``score >= score_threshold`` take part. In each image, same-class pairs are
    matched first, by descending score, each detection taking the free ground-truth box of highest IoU if
    that IoU is ``>= iou_threshold``: COCOeval's rule at one IoU, so the diagonal is its true positives at
    this score threshold. A detection left unmatched that COCOeval would ignore (IoU, here intersection over
    the detection's area, ``>= iou_threshold`` with a crowd region of its class) is not counted. The others
    are then matched the same way to the remaining ground truth of any class (the off-diagonal
    confusions). Each detection and each ground-truth box is matched at most once; what is left is a false
    positive (row K) or a missed ground-truth box (column K). Crowd regions are never counted as ground truth.

    Args:
        detections: ``(M, 7)`` ``[image_id, x, y, w, h, score, category_id]`` (see
            :func:`ssd_lightning.evaluation.to_coco_array`).
        ground_truth: ``(N, 7)`` ``[image_id, x, y, w, h, category_id, iscrowd]``
            (:func:`ground_truth_array`).
        category_ids: the K dataset category ids; class index k is the k-th id in ascending order.
        iou_threshold: the IoU a match needs.
        score_threshold: the score a detection needs to be counted at all.
        image_ids: count only these images (default: every image of ``detections`` and ``ground_truth``).
        max_cells: bound on the ``images x detections x ground truth`` IoU cells computed at once (memory).

    Raises:
        ValueError: wrong shapes, or a category id outside ``category_ids``.
    """
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
    _add(matrix, gc[rows, match[rows, cols]], dc[rows, cols])  # matched pairs
    fp = det_open & (second < 0)
    _add(matrix, np.full(int(fp.sum()), k), dc[fp])  # false positives: background row
    _add(matrix, gc[gt_open], np.full(int(gt_open.sum()), k))  # still free: missed, background column


def _add(matrix: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> None:
    n = matrix.shape[0]
    matrix += np.bincount(rows * n + cols, minlength=n * n).reshape(n, n)


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
    sub = m[:size, :size].astype(np.int64).copy()
    np.fill_diagonal(sub, 0)
    flat = sub.reshape(-1)
    order = np.argsort(-flat, kind="stable")[:n]
    return [(int(i // size), int(i % size), int(flat[i])) for i in order if flat[i] > 0]
