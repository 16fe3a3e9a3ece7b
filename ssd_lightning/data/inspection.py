"""What ``task=inspect_data`` computes: label statistics, the default-box fit, decoded training targets.

The default-box fit applies the matching rule of DALI's ``fn.box_encoder`` (the training targets): among
equal IoUs the larger index wins, where :class:`~ssd_lightning.models.BoxCoder` keeps the reference's smaller.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ssd_lightning.data.coco_validation import read_annotation_json
from ssd_lightning.errors import DataError
from ssd_lightning.models.boxes import cxcywh_to_ltrb, match_boxes

__all__ = ["SIZE_BUCKETS", "CocoArrays", "decode_targets", "default_box_fit", "label_statistics"]
__all__ += ["load_coco_arrays", "match_default_boxes"]

#: COCO's size buckets by annotation ``area`` (pixels): small < 32², medium < 96², large otherwise.
SIZE_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("small", 0.0, 32.0**2),
    ("medium", 32.0**2, 96.0**2),
    ("large", 96.0**2, float("inf")),
)
#: Edges of the aspect-ratio (w/h) histogram: log-spaced from 1/16 to 16; outside values go to the end bins.
ASPECT_EDGES: np.ndarray = np.geomspace(1 / 16, 16, 17)
# IoU elements (images x ground truths x default boxes) computed at once by match_default_boxes
_ELEMENTS_PER_CHUNK = 1 << 22
CRITERIA = 0.5  # a default box is positive at IoU > this (DALI's box_encoder in the training pipeline)


@dataclass(frozen=True)
class CocoArrays:
    """A COCO instances file as arrays: per image (I,), per annotation (A,) (``ann_image`` an index into the
    image arrays, ``bbox`` (A, 4) ``[x, y, w, h]`` pixels, ``area`` ``w * h`` where the file has none,
    ``ann_label`` 1..K in the file's category order, DALI's), ``names`` K + 1 with ``[0]`` background."""

    path: Path
    image_ids: np.ndarray
    widths: np.ndarray
    heights: np.ndarray
    ann_image: np.ndarray
    bbox: np.ndarray
    area: np.ndarray
    iscrowd: np.ndarray
    ann_label: np.ndarray
    category_ids: np.ndarray
    names: tuple[str, ...]

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_classes(self) -> int:
        """K + 1 (includes background)."""
        return len(self.names)


def load_coco_arrays(path: str | os.PathLike) -> CocoArrays:
    """A COCO instances JSON as :class:`CocoArrays` (DataError if it is not one, or names unknown ids)."""
    path = Path(path)
    try:
        data = read_annotation_json(path)  # polygons dropped before parsing (3x faster on COCO's train file)
        images, anns, cats = data["images"], data["annotations"], data["categories"]
        n = len(anns)
        image_ids, widths, heights = _columns(images, ("id", "width", "height"), (np.int64, float, float))
        category_ids = np.fromiter((c["id"] for c in cats), dtype=np.int64, count=len(cats))
        names = ("background", *(str(c.get("name", c["id"])) for c in cats))
        ann_image_id, ann_cat = _columns(anns, ("image_id", "category_id"), (np.int64, np.int64))
        bbox = np.fromiter(chain.from_iterable(map(itemgetter("bbox"), anns)), np.float64, 4 * n)
        bbox = bbox.reshape(n, 4)
        area = np.fromiter((a.get("area", -1.0) for a in anns), dtype=np.float64, count=n)
        iscrowd = np.fromiter((a.get("iscrowd", 0) for a in anns), dtype=np.int64, count=n).astype(bool)
    except DataError:  # the reader's own, naming the file
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"cannot read {path} as a COCO instances file ({type(exc).__name__}: {exc}); it needs 'images' "
            "(id, width, height), 'annotations' (image_id, category_id, bbox of 4 numbers) and 'categories' "
            "(id, name)"
        ) from None
    area = np.where(area < 0, bbox[:, 2] * bbox[:, 3], area)
    ann_image = _lookup(image_ids, ann_image_id, path, "image_id", "images")
    ann_label = _lookup(category_ids, ann_cat, path, "category_id", "categories") + 1
    return CocoArrays(
        path, image_ids, widths, heights, ann_image, bbox, area, iscrowd, ann_label, category_ids, names
    )


def _columns(rows: list, keys: tuple[str, ...], dtypes: tuple) -> list[np.ndarray]:
    """Columns ``keys`` of a list of dicts, each as a numpy array of its dtype (one pass per column)."""
    pairs = zip(keys, dtypes, strict=True)
    return [np.fromiter(map(itemgetter(k), rows), dtype=t, count=len(rows)) for k, t in pairs]


def _lookup(keys: np.ndarray, values: np.ndarray, path: Path, field: str, listing: str) -> np.ndarray:
    """Index of each of ``values`` in ``keys`` (vectorised), or a DataError naming the unknown ones."""
    order = np.argsort(keys, kind="stable")
    pos = np.clip(np.searchsorted(keys, values, sorter=order), 0, max(len(keys) - 1, 0))
    found = order[pos] if len(keys) else pos
    bad = (keys[found] != values) if len(keys) else np.ones(len(values), bool)
    if bad.any():
        raise DataError(
            f"{path}: annotations with {field} {np.unique(values[bad])[:5].tolist()} not in '{listing}'"
        )
    return found


def size_bucket(area: np.ndarray) -> np.ndarray:
    """(A,) COCO size bucket index (0 small, 1 medium, 2 large) of each area."""
    return np.searchsorted(np.array([b[2] for b in SIZE_BUCKETS[:-1]]), area, side="right")


def label_statistics(arrays: CocoArrays) -> dict:
    """Counts of one annotation file, JSON-ready: ``images``, ``boxes``, ``images_without_boxes``,
    ``crowd_boxes``, ``boxes_per_image`` (``histogram``: images with k boxes at index k), ``size_buckets`` (by
    ``area``), ``aspect_ratio`` (w/h; ``degenerate``: w or h <= 0) and ``classes`` (per label)."""
    a = arrays
    per_image = np.bincount(a.ann_image, minlength=a.num_images)
    k = a.num_classes - 1
    boxes_per_class = np.bincount(a.ann_label - 1, minlength=k)
    crowd_per_class = np.bincount(a.ann_label[a.iscrowd] - 1, minlength=k)
    pairs = np.unique(a.ann_image * k + (a.ann_label - 1))
    images_per_class = np.bincount(pairs % k, minlength=k) if k else np.zeros(0, np.int64)
    buckets = np.bincount(size_bucket(a.area), minlength=len(SIZE_BUCKETS))
    w, h = a.bbox[:, 2], a.bbox[:, 3]
    ok = (w > 0) & (h > 0)
    ratio = w[ok] / h[ok]
    bins = np.clip(np.searchsorted(ASPECT_EDGES, ratio, side="right") - 1, 0, len(ASPECT_EDGES) - 2)
    per_class = (a.category_ids, a.names[1:], boxes_per_class, images_per_class, crowd_per_class)
    return {
        "file": str(a.path),
        "images": int(a.num_images),
        "boxes": int(len(a.ann_label)),
        "images_without_boxes": int((per_image == 0).sum()),
        "crowd_boxes": int(a.iscrowd.sum()),
        "boxes_per_image": {
            "mean": float(per_image.mean()) if len(per_image) else 0.0,
            "median": float(np.median(per_image)) if len(per_image) else 0.0,
            "max": int(per_image.max()) if len(per_image) else 0,
            "histogram": np.bincount(per_image).tolist(),
        },
        "size_buckets": {name: int(n) for (name, _, _), n in zip(SIZE_BUCKETS, buckets, strict=True)},
        "aspect_ratio": {
            "edges": ASPECT_EDGES.tolist(),
            "counts": np.bincount(bins, minlength=len(ASPECT_EDGES) - 1).tolist(),
            "median": float(np.median(ratio)) if len(ratio) else None,
            "degenerate": int((~ok).sum()),
        },
        "classes": [
            {"label": i, "category_id": int(c), "name": n, "boxes": int(b), "images": int(m), "crowd": int(r)}
            for i, (c, n, b, m, r) in enumerate(zip(*per_class, strict=True), start=1)
        ],
    }


def match_default_boxes(
    boxes_ltrb: Sequence[Tensor | np.ndarray], anchors_ltrb: Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """Per ground-truth box (``boxes_ltrb``: per image (M_i, 4) relative, as DALI's reader hands them): the
    default boxes whose target it is, forced one included (``matched`` (sum M_i,) int64), and its best IoU
    before forcing (``best_iou`` (sum M_i,) float32); a default box is positive at IoU > :data:`CRITERIA`."""
    anchors = torch.as_tensor(anchors_ltrb, dtype=torch.float32)
    num_anchors = anchors.shape[0]
    counts = np.array([len(b) for b in boxes_ltrb], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    matched = np.zeros(offsets[-1], dtype=np.int64)
    best_iou = np.zeros(offsets[-1], dtype=np.float32)
    # images with equally many boxes go together: a chunk is one (n, m, B) tensor without padding waste
    order = np.argsort(counts, kind="stable")
    order = order[counts[order] > 0]
    start = 0
    while start < len(order):
        m = int(counts[order[start]])
        same = int(np.searchsorted(counts[order], m, side="right")) - start
        take = max(1, min(same, _ELEMENTS_PER_CHUNK // (m * num_anchors)))
        idx = order[start : start + take]
        start += take
        gt = torch.as_tensor(np.stack([np.asarray(boxes_ltrb[i], dtype=np.float32) for i in idx]))
        best_gt, positive, best = match_boxes(gt, anchors, CRITERIA, last_wins_ties=True)  # DALI's ties
        per_gt = torch.zeros(len(idx), m, dtype=torch.int64)
        per_gt.scatter_add_(1, best_gt, positive.to(torch.int64))
        rows = (offsets[idx][:, None] + np.arange(m)).reshape(-1)
        matched[rows] = per_gt.reshape(-1).numpy()
        best_iou[rows] = best.reshape(-1).numpy()
    return matched, best_iou


def default_box_fit(
    arrays: CocoArrays,
    anchors_ltrb: Tensor,
    *,
    include_crowd: bool = True,
    max_images: int | None = None,
) -> dict:
    """How the training targets cover the boxes of an annotation file (:func:`match_default_boxes`), as a
    JSON-ready dict; ``max_images`` evenly spaced images (None: all) bound the cost. Per group,
    ``forced_only`` counts boxes with no default box above the criteria, ``unmatched`` those with none."""
    rows = np.arange(len(arrays.ann_label)) if include_crowd else np.flatnonzero(~arrays.iscrowd)
    rows = rows[np.argsort(arrays.ann_image[rows], kind="stable")]  # file order inside each image
    images, starts = np.unique(arrays.ann_image[rows], return_index=True)
    if max_images is not None and len(images) > max_images:
        pick = np.unique(np.linspace(0, len(images) - 1, max_images).round().astype(np.int64))
        ends = np.append(starts[1:], len(rows))
        rows = np.concatenate([rows[starts[p] : ends[p]] for p in pick]) if len(pick) else rows[:0]
        images, starts = np.unique(arrays.ann_image[rows], return_index=True)
    # relative ltrb as DALI's reader computes it (ltrb=True, ratio=True): (x, y, x + w, y + h) / (W, H, W, H)
    xywh, img = arrays.bbox[rows].astype(np.float32), arrays.ann_image[rows]
    size = np.stack([arrays.widths[img], arrays.heights[img]], 1).astype(np.float32)
    ltrb = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1) / np.concatenate([size, size], 1)
    matched, best = match_default_boxes(np.split(ltrb, starts[1:]) if len(rows) else [], anchors_ltrb)
    forced_only = best <= CRITERIA

    def group(mask: np.ndarray) -> dict:
        n = int(mask.sum())
        return {
            "boxes": n,
            "matched_mean": float(matched[mask].mean()) if n else None,
            "matched_median": float(np.median(matched[mask])) if n else None,
            "best_iou_mean": float(best[mask].mean()) if n else None,
            "forced_only": int(forced_only[mask].sum()),
            "forced_only_share": float(forced_only[mask].mean()) if n else None,
            "unmatched": int((matched[mask] == 0).sum()),
        }

    bucket = size_bucket(arrays.area[rows])
    labels = arrays.ann_label[rows]
    return {
        "file": str(arrays.path),
        "images": int(len(images)),
        "criteria": CRITERIA,
        "default_boxes": int(anchors_ltrb.shape[0]),
        "overall": group(np.ones(len(rows), bool)),
        "size_buckets": {name: group(bucket == i) for i, (name, _, _) in enumerate(SIZE_BUCKETS)},
        "classes": [
            {"label": k, "name": arrays.names[k], **group(labels == k)} for k in range(1, arrays.num_classes)
        ],
        "matched_histogram": np.bincount(matched).tolist(),
    }


def decode_targets(boxes_cxcywh: Tensor, labels: Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Training targets back to ground truth: per image ``(boxes (k, 4) float32 ltrb relative, labels (k,))``,
    the distinct pairs of its positives, from the batch's ``boxes`` (N, B, 4) relative cxcywh and ``labels``
    (N, B) (0: background). A box no default box carries is lost, two identical ones with a label show once.
    """
    out = []
    for boxes, lab in zip(boxes_cxcywh.float(), labels, strict=True):
        pos = lab > 0
        ltrb = cxcywh_to_ltrb(boxes[pos]).numpy()
        rows = np.concatenate([ltrb, lab[pos].numpy()[:, None].astype(np.float32)], axis=1)
        uniq = np.unique(rows, axis=0) if len(rows) else rows.reshape(0, 5)
        out.append((uniq[:, :4].astype(np.float32), uniq[:, 4].astype(np.int64)))
    return out


def plot_label_statistics(stats: dict, output: str | os.PathLike, title: str = "") -> Path:
    """``data_stats.png``: boxes per class, boxes per image, COCO size buckets, aspect ratios (w/h)."""
    from matplotlib.figure import Figure  # matplotlib only when a picture is drawn

    fig = Figure(figsize=(12, 8), layout="constrained")
    (ax_cls, ax_per_img), (ax_size, ax_ratio) = fig.subplots(2, 2)
    names = [c["name"] for c in stats["classes"]]
    ax_cls.barh(range(len(names)), [c["boxes"] for c in stats["classes"]], color="tab:blue")
    ax_cls.set_yticks(range(len(names)), names, fontsize=max(4, min(9, 400 // max(1, len(names)))))
    ax_cls.invert_yaxis()
    counts = f"{stats['boxes']} boxes, {stats['crowd_boxes']} crowd"
    ax_cls.set(xlabel="boxes", title=f"boxes per class ({counts})")
    hist = stats["boxes_per_image"]["histogram"]
    ax_per_img.bar(range(len(hist)), hist, width=1.0, color="tab:green")
    without = f"{stats['images']} images, {stats['images_without_boxes']} without boxes"
    ax_per_img.set(xlabel="boxes in the image", ylabel="images", title=f"boxes per image ({without})")
    sizes = stats["size_buckets"]
    ax_size.bar(list(sizes), list(sizes.values()), color=["tab:red", "tab:orange", "tab:purple"])
    ax_size.set(ylabel="boxes", title="COCO size buckets (area < 32², < 96², larger)")
    ratio = stats["aspect_ratio"]
    edges = np.asarray(ratio["edges"])
    ax_ratio.bar(edges[:-1], ratio["counts"], width=np.diff(edges), align="edge", color="tab:gray")
    ax_ratio.set(xscale="log", ylabel="boxes", title="box aspect ratios")
    ax_ratio.set_xlabel("aspect ratio w/h (end bins include everything beyond)")
    return _save(fig, output, title)


def plot_default_box_fit(fit: dict, output: str | os.PathLike, title: str = "") -> Path:
    """``default_box_fit.png``: default boxes per ground truth (histogram) and, per size bucket and class,
    the mean number of default boxes and the share matched only by the forced rule."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), layout="constrained")
    ax_hist, ax_size, ax_cls = fig.subplot_mosaic([["hist", "size"], ["cls", "cls"]]).values()
    hist = fit["matched_histogram"]
    ax_hist.bar(range(len(hist)), hist, width=1.0, color="tab:blue")
    ax_hist.set(xlabel="default boxes assigned to the box", ylabel="ground-truth boxes")
    ax_hist.set_title(f"{fit['overall']['boxes']} boxes in {fit['images']} images")
    groups = {"all": fit["overall"], **fit["size_buckets"]}
    _bars(ax_size, list(groups), list(groups.values()))
    ax_size.set_title(f"per size bucket (positive: IoU > {fit['criteria']})")
    _bars(ax_cls, [c["name"] for c in fit["classes"]], fit["classes"])
    ax_cls.set_title("per class")
    return _save(fig, output, title)


def _bars(ax, names: list[str], groups: list[dict]) -> None:
    """Mean default boxes per box (left axis) beside the forced-only share (right axis) per group."""
    x = np.arange(len(names))
    mean = [g["matched_mean"] or 0.0 for g in groups]
    share = [g["forced_only_share"] or 0.0 for g in groups]
    ax.bar(x - 0.2, mean, width=0.4, color="tab:blue", label="mean default boxes per box")
    ax.set_ylabel("default boxes per box")
    twin = ax.twinx()
    twin.bar(x + 0.2, share, width=0.4, color="tab:red", label="forced-only share")
    twin.set(ylim=(0, 1), ylabel="share matched only by the forced rule")
    ax.set_xticks(x, names, rotation=90 if len(names) > 8 else 0, fontsize=8 if len(names) > 20 else 10)
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")


def _save(fig, output: str | os.PathLike, title: str) -> Path:
    if title:
        fig.suptitle(title)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    return output
