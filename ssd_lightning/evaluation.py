"""COCO bbox evaluation (official protocol) and the one conversion of detections to COCO results.

:func:`evaluate_coco` runs faster-coco-eval's ``COCOeval_faster`` (the default) or pycocotools' ``COCOeval``
(the same 12 numbers, slower); per-class AP comes from the same run. Detections become COCO results one way:
:func:`to_coco_array` (the only rounding: bbox to 3 decimals, score to 5), then :func:`coco_array_to_results`
or its text, :func:`coco_result_texts` (:func:`write_coco_results_json`, ``predict.py``'s files).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

__all__ = ["BACKENDS", "COCO_STAT_NAMES", "DEFAULT_BACKEND", "ClassAP", "CocoEvaluation", "evaluate_coco"]
__all__ += ["class_ap_from_precision", "coco_array_to_results", "detections_to_coco_array", "format_summary"]
__all__ += ["evaluate_coco_detailed", "per_class_records", "format_per_class_table", "per_class_metrics"]
__all__ += ["coco_result_texts", "to_coco_array", "write_coco_results_json"]

#: The 12 COCOeval bbox statistics in ``COCOeval.stats`` order: AP at IoU 0.50:0.95, 0.50, 0.75 and per area
#: (small < 32^2 <= medium < 96^2 <= large), maxDets 100; AR (IoU 0.50:0.95) at maxDets 1, 10, 100, per area.
COCO_STAT_NAMES: tuple[str, ...] = (
    *("mAP", "mAP_50", "mAP_75", "mAP_small", "mAP_medium", "mAP_large"),
    *("mAR_1", "mAR_10", "mAR_100", "mAR_small", "mAR_medium", "mAR_large"),
)

#: Evaluation backends; the first is the default.
BACKENDS: tuple[str, ...] = ("faster_coco_eval", "pycocotools")
DEFAULT_BACKEND = BACKENDS[0]


def _as_numpy(x: Any, dtype: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x).numpy()
    return np.asarray(x, dtype=dtype)


def to_coco_array(
    image_ids: Sequence[int] | torch.Tensor | np.ndarray,
    boxes: Sequence[torch.Tensor | np.ndarray],
    scores: Sequence[torch.Tensor | np.ndarray],
    labels: Sequence[torch.Tensor | np.ndarray],
    category_map: Any,
    *,
    box_decimals: int = 3,
    score_decimals: int = 5,
) -> np.ndarray:
    """Per-image detections -> ``(M, 7)`` float64 ``[image_id, x, y, w, h, score, category_id]`` rows (the
    layout of ``COCO.loadNumpyAnnotations``): ``boxes`` ``(k_i, 4)`` ltrb in original-image pixels, ``labels``
    contiguous (1..K), mapped by ``category_map.label_to_category_id``. The rounding keeps the JSON small (see
    docs/benchmarks.md for why not fewer decimals)."""
    ids = _as_numpy(image_ids, np.int64).reshape(-1)
    if not (len(ids) == len(boxes) == len(scores) == len(labels)):
        raise ValueError(
            "image_ids, boxes, scores and labels must have one entry per image, got "
            f"{len(ids)}, {len(boxes)}, {len(scores)}, {len(labels)}"
        )
    rows = []
    for image_id, b, s, lab in zip(ids.tolist(), boxes, scores, labels, strict=True):
        b = _as_numpy(b, np.float64).reshape(-1, 4)
        s = _as_numpy(s, np.float64).reshape(-1)
        lab = _as_numpy(lab, np.int64).reshape(-1)
        if not (b.shape[0] == s.shape[0] == lab.shape[0]):
            raise ValueError(
                f"image {image_id}: boxes {tuple(b.shape)}, scores {tuple(s.shape)} and labels "
                f"{tuple(lab.shape)} disagree on the number of detections"
            )
        if b.shape[0] == 0:
            continue
        xywh = np.round(np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], axis=1), box_decimals)  # ltrb -> xywh
        cats = _as_numpy(category_map.label_to_category_id(torch.from_numpy(lab)), np.int64).reshape(-1)
        rows.append(np.column_stack([np.full(len(b), image_id), xywh, np.round(s, score_decimals), cats]))
    return np.concatenate(rows, axis=0).astype(np.float64) if rows else np.zeros((0, 7), dtype=np.float64)


def _columns(array: Any) -> tuple[list, ...]:
    """Lists ``image_id, category_id, x, y, w, h, score`` of an (M, 7) array (by column: ~2x faster)."""
    array = np.asarray(array, dtype=np.float64)
    array = array.reshape(0, 7) if array.size == 0 else array
    if array.ndim != 2 or array.shape[1] != 7:
        raise ValueError(
            "a COCO results array has shape (M, 7), rows [image_id, x, y, w, h, score, category_id]; "
            f"got {tuple(array.shape)}"
        )
    return (
        array[:, 0].astype(np.int64).tolist(),
        array[:, 6].astype(np.int64).tolist(),
        *(array[:, i].tolist() for i in range(1, 6)),
    )


def coco_array_to_results(array: np.ndarray) -> list[dict[str, Any]]:
    """An (M, 7) array as a COCO results list ``[{"image_id", "category_id", "bbox", "score"}, ...]``."""
    return [
        {"image_id": i, "category_id": c, "bbox": [x, y, w, h], "score": s}
        for i, c, x, y, w, h, s in zip(*_columns(array), strict=True)
    ]


_RESULT_FORMAT = '{"image_id":%d,"category_id":%d,"bbox":[%r,%r,%r,%r],"score":%r}'


def coco_result_texts(array: np.ndarray, separators: tuple[str, str] = (",", ":")) -> list[str]:
    """The :func:`coco_array_to_results` dicts as ``json.dumps(result, separators=separators)`` writes them,
    made without the dicts (~2x faster, ~1 s for 500k detections); non-finite values by ``json.dumps``."""
    array = np.asarray(array, dtype=np.float64)
    if not np.isfinite(array).all():
        return [json.dumps(result, separators=separators) for result in coco_array_to_results(array)]
    form = _RESULT_FORMAT.replace(",", separators[0]).replace(":", separators[1])
    return [form % row for row in zip(*_columns(array), strict=True)]


def write_coco_results_json(file: str | os.PathLike | IO[str], array: np.ndarray) -> None:
    """Write an ``(M, 7)`` results array as a COCO results JSON file (a path or an open text file): byte for
    byte ``json.dumps(coco_array_to_results(array), separators=(",", ":"))`` (:func:`coco_result_texts`)."""
    text = "[" + ",".join(coco_result_texts(array)) + "]"
    if isinstance(file, (str, os.PathLike)):
        Path(file).write_text(text)
    else:
        file.write(text)


def detections_to_coco_array(
    detections: Iterable[Mapping[str, Any]], category_map: Any, **kwargs: int
) -> np.ndarray:
    """:func:`to_coco_array` for the per-image dicts returned by ``SSDLitModule.validation_step``
    (``{"image_id": int, "boxes": (k, 4) ltrb pixels, "scores": (k,), "labels": (k,) contiguous}``)."""
    dets = list(detections)
    for d in dets:
        if missing := {"image_id", "boxes", "scores", "labels"} - set(d):
            raise ValueError(f"detection dict is missing keys {sorted(missing)}; see docs/architecture.md")
    per_key = ([d[k] for d in dets] for k in ("boxes", "scores", "labels"))
    return to_coco_array([int(d["image_id"]) for d in dets], *per_key, category_map, **kwargs)


def _load_results(detections: Sequence[Mapping[str, Any]] | str | os.PathLike | np.ndarray) -> list[dict]:
    """Fresh (``loadRes`` mutates its input), type-checked copy of the results, each with an empty
    ``segmentation``: ``loadRes`` otherwise adds an unused 8-number polygon per box (~1 s per 500k)."""
    if isinstance(detections, np.ndarray):
        return [{**r, "segmentation": []} for r in coco_array_to_results(detections)]
    if isinstance(detections, (str, os.PathLike)):
        path = Path(detections)
        if not path.is_file():
            raise FileNotFoundError(f"detections file {str(path)!r} does not exist")
        detections = json.loads(path.read_text())
    if not isinstance(detections, list):
        raise ValueError(
            "detections must be a COCO results list [{'image_id', 'category_id', 'bbox', 'score'}, ...], "
            f"a path to a JSON file holding one, or an (M, 7) array; got {type(detections).__name__}"
        )
    out = []
    for i, d in enumerate(detections):
        try:
            bbox = [float(v) for v in d["bbox"]]
            ids = {"image_id": int(d["image_id"]), "category_id": int(d["category_id"])}
            entry = {**ids, "bbox": bbox, "score": float(d["score"]), "segmentation": []}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"detections[{i}] is not a COCO bbox result "
                f"{{'image_id', 'category_id', 'bbox', 'score'}}: {d!r}"
            ) from e
        if len(bbox) != 4:
            raise ValueError(f"detections[{i}]['bbox'] must be [x, y, w, h], got {bbox}")
        out.append(entry)
    return out


def _check_ids(
    results: list[dict], gt_dataset: dict, annotation_file: Path, image_ids: Any
) -> list[int] | None:
    where = repr(str(annotation_file))
    gt_images = {int(im["id"]) for im in gt_dataset.get("images", [])}
    gt_cats = {int(c["id"]) for c in gt_dataset.get("categories", [])}
    if bad_images := {r["image_id"] for r in results} - gt_images:
        raise ValueError(
            f"detections refer to {len(bad_images)} image id(s) not in {where}, "
            f"e.g. {sorted(bad_images)[:5]}; wrong annotation file or image ids?"
        )
    if bad_cats := {r["category_id"] for r in results} - gt_cats:
        raise ValueError(
            f"detections use category id(s) {sorted(bad_cats)[:10]} that {where} does not "
            f"define (it has {sorted(gt_cats)}); were contiguous labels passed without a CategoryMap?"
        )
    if image_ids is None:
        return None
    ids = sorted(set(_as_numpy(image_ids, np.int64).reshape(-1).tolist()))
    if unknown := set(ids) - gt_images:
        raise ValueError(f"image_ids holds {len(unknown)} id(s) not in {where}, e.g. {sorted(unknown)[:5]}")
    if len(ids) < len(gt_images):
        message = f"evaluating on {len(ids)} of the {len(gt_images)} images of {where} (image_ids given); "
        warnings.warn(message + "the numbers are not the full-dataset COCO metrics", stacklevel=3)
    return ids


def _run(backend: str, annotation_file: Path, results: list[dict], image_ids: Any, verbose: bool) -> tuple:
    """The finished COCOeval (either backend: same ``stats``, ``params``, ``eval["precision"]``) and the
    ground-truth dataset dict it ran on; the backends' own printing silenced, the standard 12 lines ours."""
    if backend == "pycocotools":
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        quiet = {}
    else:
        from faster_coco_eval import COCO
        from faster_coco_eval import COCOeval_faster as COCOeval

        quiet = {"print_function": lambda *args, **kwargs: None}
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(annotation_file), **quiet)
        ids = _check_ids(results, coco_gt.dataset, annotation_file, image_ids)
        if results or quiet:
            coco_dt = coco_gt.loadRes(results)
        else:  # pycocotools' loadRes fails on an empty list
            coco_dt = COCO()
            images, cats = list(coco_gt.dataset["images"]), copy.deepcopy(coco_gt.dataset["categories"])
            coco_dt.dataset = {"images": images, "categories": cats, "annotations": []}
            coco_dt.createIndex()
        coco_eval = COCOeval(coco_gt, coco_dt, iouType="bbox", **quiet)
        if ids is not None:
            coco_eval.params.imgIds = ids
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()  # faster_coco_eval's has 14 lines (adds AR@0.5, AR@0.75)
    if verbose:
        print(format_summary(coco_eval.stats))
    return coco_eval, coco_gt.dataset


@dataclass(frozen=True)
class ClassAP:
    """COCO AP of one category (area all, 100 detections per image), a row of the per-class table. ``key``
    (of ``AP/<key>``): the name, ``/`` (would nest the tag in TensorBoard/MLflow) as ``_``, stripped,
    ``category_<id>`` if empty, ``_<id>`` appended on collision. ``ap`` (AP@[.5:.95]), ``ap50``: NaN without
    ground truth among the evaluated images; ``num_gt``: non-crowd ground-truth boxes there."""

    category_id: int
    name: str
    key: str
    ap: float
    ap50: float
    num_gt: int


def class_ap_from_precision(
    precision: np.ndarray,
    iou_thresholds: Sequence[float] | np.ndarray,
    *,
    area_index: int = 0,
    max_dets_index: int = -1,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-category ``(ap, ap50)``, each ``(K,)``, from COCOeval's ``eval["precision"]`` ``(T, R, K, A, M)``
    (IoU thresholds ``iou_thresholds``, recall points, categories, area ranges, maxDets; -1: undefined): the
    mean of the defined entries over T and R (R at IoU 0.5), as ``COCOeval.summarize``; NaN if none."""
    precision = np.asarray(precision, dtype=np.float64)
    if precision.ndim != 5:
        raise ValueError(f"precision must have shape (T, R, K, A, M), got {tuple(precision.shape)}")
    thresholds = np.asarray(iou_thresholds, dtype=np.float64).reshape(-1)
    if thresholds.shape[0] != precision.shape[0]:
        raise ValueError(
            f"{thresholds.shape[0]} IoU thresholds for a precision array with T={precision.shape[0]}"
        )
    at_50 = np.flatnonzero(np.isclose(thresholds, 0.5))
    if at_50.size != 1:
        raise ValueError(f"the IoU thresholds must contain 0.5 once, got {thresholds.tolist()}")
    selected = precision[:, :, :, area_index, max_dets_index]  # (T, R, K)
    return _mean_of_defined(selected), _mean_of_defined(selected[at_50])


def _mean_of_defined(precision: np.ndarray) -> np.ndarray:
    """``(T, R, K) -> (K,)``: mean over T and R of the entries ``> -1``; NaN where there are none."""
    per_class = np.ascontiguousarray(precision.reshape(-1, precision.shape[-1]).T)  # (K, T*R)
    defined = per_class > -1
    count = defined.sum(axis=1)
    # a sum along the contiguous axis is pairwise, as COCOeval's np.mean: rounding error ~1e-16, not ~1e-14
    total = np.where(defined, per_class, 0.0).sum(axis=1)
    return np.divide(total, count, out=np.full(count.shape, np.nan), where=count > 0)


def _class_rows(
    gt_dataset: dict, category_ids: np.ndarray, ap: np.ndarray, ap50: np.ndarray, image_ids: np.ndarray
) -> list[ClassAP]:
    """One :class:`ClassAP` per category of the evaluation, in category id order."""
    names_by_id = {int(c["id"]): str(c.get("name", "")) for c in gt_dataset.get("categories", [])}
    names = [names_by_id.get(int(c), "") for c in category_ids]
    keys = [n.replace("/", "_").strip() or f"category_{c}" for c, n in zip(category_ids, names, strict=True)]
    collided = {k for k in keys if keys.count(k) > 1}
    keys = [f"{k}_{c}" if k in collided else k for c, k in zip(category_ids, keys, strict=True)]
    # non-crowd ground-truth boxes per category among the evaluated images
    anns = gt_dataset.get("annotations", [])
    cats = np.fromiter((a["category_id"] for a in anns), dtype=np.int64, count=len(anns))
    images = np.fromiter((a["image_id"] for a in anns), dtype=np.int64, count=len(anns))
    crowd = np.fromiter((bool(a.get("iscrowd", 0)) for a in anns), dtype=bool, count=len(anns))
    keep = ~crowd & np.isin(images, np.asarray(image_ids, dtype=np.int64)) & np.isin(cats, category_ids)
    num_gt = np.bincount(np.searchsorted(category_ids, cats[keep]), minlength=len(category_ids))
    return [
        ClassAP(int(c), name, key, float(a), float(a50), int(n))
        for c, name, key, a, a50, n in zip(category_ids, names, keys, ap, ap50, num_gt, strict=True)
    ]


def per_class_metrics(classes: Iterable[ClassAP]) -> dict[str, float]:
    """``{"AP/<key>": ap, "AP50/<key>": ap50}`` for every category that has an AP (NaN rows left out)."""
    defined = [row for row in classes if not math.isnan(row.ap)]
    return {f"{m}/{r.key}": v for r in defined for m, v in (("AP", r.ap), ("AP50", r.ap50))}


def format_per_class_table(classes: Iterable[ClassAP]) -> str:
    """Per-class table, worst AP first (then AP50, category id); undefined AP (no GT) last, ``-``."""

    def order(row: ClassAP) -> tuple:
        undefined = math.isnan(row.ap)
        return (undefined, 0.0 if undefined else row.ap, 0.0 if undefined else row.ap50, row.category_id)

    def value(x: float) -> str:
        return f"{'-':>6}" if math.isnan(x) else f"{x:6.3f}"

    lines = [f"{'AP':>6} {'AP50':>6} {'GT':>7} {'id':>6}  category"]
    for r in sorted(classes, key=order):
        lines.append(f"{value(r.ap)} {value(r.ap50)} {r.num_gt:>7d} {r.category_id:>6d}  {r.name}")
    return "\n".join(lines)


_AREAS, _AP, _AR = ("small", "medium", "large"), ("Average Precision", "(AP)"), ("Average Recall", "(AR)")
_SUMMARY_ROWS = (  # (title, IoU, area, maxDets) per stat, as COCOeval.summarize() prints them
    *((_AP, iou, "all", 100) for iou in ("0.50:0.95", "0.50", "0.75")),
    *((_AP, "0.50:0.95", area, 100) for area in _AREAS),
    *((_AR, "0.50:0.95", "all", max_dets) for max_dets in (1, 10, 100)),
    *((_AR, "0.50:0.95", area, 100) for area in _AREAS),
)


def format_summary(stats: Sequence[float] | Mapping[str, float]) -> str:
    """COCOeval's 12-line bbox summary of ``stats`` (COCOeval order, or :func:`evaluate_coco`'s dict)."""
    values = [stats[n] for n in COCO_STAT_NAMES] if isinstance(stats, Mapping) else list(stats)[:12]
    return "\n".join(
        f" {title:<18} {kind} @[ IoU={iou:<9} | area={area:>6s} | maxDets={max_dets:>3d} ] = {v:0.3f}"
        for ((title, kind), iou, area, max_dets), v in zip(_SUMMARY_ROWS, values, strict=True)
    )


def evaluate_coco(
    annotation_file: str | os.PathLike,
    detections: Sequence[Mapping[str, Any]] | str | os.PathLike | np.ndarray,
    backend: str = DEFAULT_BACKEND,
    *,
    verbose: bool = True,
    image_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    per_class: bool = False,
) -> dict[str, float]:
    """Official COCO bbox evaluation of ``detections`` (a COCO results list, ``bbox`` ``[x, y, w, h]``
    pixels, not modified; a JSON file holding one; or an ``(M, 7)`` array) against ``annotation_file``: the
    12 stats in ``COCO_STAT_NAMES`` order (``-1.0``: no ground truth in that range; no detections: ``0.0``),
    then with ``per_class`` the ``AP/<key>``, ``AP50/<key>`` (:class:`ClassAP`) of every category with
    ground truth. ``verbose``: print the 12-line summary; ``image_ids``: only these images (a subset warns).
    """
    ev = evaluate_coco_detailed(annotation_file, detections, backend, verbose=verbose, image_ids=image_ids)
    return {**ev.stats, **(per_class_metrics(ev.classes) if per_class else {})}


@dataclass(frozen=True)
class CocoEvaluation:
    """What one COCOeval run leaves for looking closer (PR curves, confusion matrices), without the COCOeval
    object (its per-image match records are freed): ``precision`` is ``eval["precision"]`` ``(T, R, K, A, M)``
    (-1: undefined) with the parameters to read it; ``gt_dataset`` the dataset dict it ran on (not a copy)."""

    stats: dict[str, float]
    classes: list[ClassAP]
    precision: np.ndarray
    iou_thresholds: np.ndarray
    recall_thresholds: np.ndarray
    category_ids: np.ndarray
    area_index: int
    max_dets_index: int
    max_dets: int
    image_ids: np.ndarray
    gt_dataset: dict


def evaluate_coco_detailed(
    annotation_file: str | os.PathLike,
    detections: Sequence[Mapping[str, Any]] | str | os.PathLike | np.ndarray,
    backend: str = DEFAULT_BACKEND,
    *,
    verbose: bool = True,
    image_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None,
) -> CocoEvaluation:
    """:func:`evaluate_coco` (same arguments, one COCOeval run) with one :class:`ClassAP` row per category of
    the annotation file (category id order, NaN AP without ground truth), the accumulated precision array and
    the parameters needed to read it (:class:`CocoEvaluation`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    ann_path = Path(annotation_file)
    if not ann_path.is_file():
        raise FileNotFoundError(
            f"annotation_file {str(ann_path)!r} does not exist; pass the dataset's COCO instances JSON"
        )
    coco_eval, gt_dataset = _run(backend, ann_path, _load_results(detections), image_ids, verbose)
    params = coco_eval.params
    precision = np.asarray(coco_eval.eval["precision"], dtype=np.float64)
    iou_thresholds = np.asarray(params.iouThrs, dtype=np.float64)
    category_ids, image_ids = np.asarray(params.catIds, np.int64), np.asarray(params.imgIds, np.int64)
    area_index, max_dets_index = list(params.areaRngLbl).index("all"), int(np.argmax(params.maxDets))
    ap, ap50 = class_ap_from_precision(
        precision, iou_thresholds, area_index=area_index, max_dets_index=max_dets_index
    )
    return CocoEvaluation(
        stats={name: float(v) for name, v in zip(COCO_STAT_NAMES, coco_eval.stats, strict=False)},
        classes=_class_rows(gt_dataset, category_ids, ap, ap50, image_ids),
        precision=precision,
        iou_thresholds=iou_thresholds,
        recall_thresholds=np.asarray(params.recThrs, dtype=np.float64),
        category_ids=category_ids,
        area_index=area_index,
        max_dets_index=max_dets_index,
        max_dets=int(params.maxDets[max_dets_index]),
        image_ids=image_ids,
        gt_dataset=gt_dataset,
    )


def per_class_records(classes: Sequence[ClassAP]) -> list[dict[str, Any]]:
    """JSON rows of ``per_class_epoch_<e>.json`` and predict's ``coco_eval.json``; undefined AP: null."""
    return [
        {"category_id": r.category_id, "name": r.name, "metric_key": r.key}
        | {"AP": None if math.isnan(r.ap) else r.ap, "AP50": None if math.isnan(r.ap50) else r.ap50}
        | {"num_gt": r.num_gt}
        for r in classes
    ]
