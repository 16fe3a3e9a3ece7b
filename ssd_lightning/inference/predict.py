"""Detect objects in image files: read and preprocess, run a :class:`Detector`, write pictures + JSON, and
score the detections against a COCO annotation file.

Inputs come from :func:`ssd_lightning.inference.sources.collect_inputs` (re-exported here). Images are read
and preprocessed in ``workers`` threads ahead of the detector, in input order. Preprocessing
(:func:`preprocess`) is the validation transform of the datamodules done with PIL and torch instead of
DALI: RGB (EXIF orientation applied), resize to 300×300 without letterbox (Pillow bilinear), then
``(pixel - 255 * mean) / (255 * std)`` with the ImageNet mean/std, NCHW float32.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.errors import DataError, user_errors_as_messages
from ssd_lightning.evaluation import (
    COCO_STAT_NAMES,
    ClassAP,
    coco_array_to_results,
    evaluate_coco_detailed,
    format_summary,
    per_class_records,
    to_coco_array,
)
from ssd_lightning.inference.classifier import Classifier
from ssd_lightning.inference.detector import Detector
from ssd_lightning.inference.loading import load_model_from_settings
from ssd_lightning.inference.sources import (
    IMAGE_EXTENSIONS,
    InputImage,
    collect_inputs,
    load_annotation_file,
    match_annotation_ids,
)
from ssd_lightning.io.atomic import atomic_write_json
from ssd_lightning.models import IMAGENET_MEAN, IMAGENET_STD
from ssd_lightning.tables import markdown_table

__all__ = [
    "IMAGE_EXTENSIONS",
    "InputImage",
    "categories_for_annotations",
    "classify_images",
    "collect_inputs",
    "evaluate_predictions",
    "imagefolder_labels",
    "open_image",
    "predict_from_settings",
    "predict_images",
    "preprocess",
]

log = logging.getLogger(__name__)


def preprocess(image: Image.Image, size: int = 300) -> Tensor:
    """PIL image -> (3, size, size) float32, RGB, resized without letterbox, ImageNet-normalised."""
    rgb = image.convert("RGB").resize((size, size), Image.BILINEAR)
    array = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1)  # (3, S, S) 0..255
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (array - mean) / std


def open_image(path: Path) -> Image.Image:
    """Decode fully (so a truncated file fails here, not later) and apply the EXIF orientation."""
    with Image.open(path) as img:
        img.load()
        return ImageOps.exif_transpose(img).convert("RGB")


# ------------------------------------------------------------------------------------------ reading
_READ_ERRORS = (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError)


def _read(
    item: InputImage, transform: Callable[[Image.Image], Tensor]
) -> tuple[InputImage, Image.Image | None, Tensor | None, str]:
    """``(item, image, transform(image), "")``, or ``(item, None, None, reason)`` for an unreadable file."""
    try:
        image = open_image(item.path)
    except _READ_ERRORS as e:
        return item, None, None, f"{type(e).__name__}: {e}"
    return item, image, transform(image), ""


def _read_ahead(
    inputs: Sequence[InputImage], transform: Callable[[Image.Image], Tensor], workers: int, window: int
) -> Iterator[tuple]:
    """:func:`_read` of every input, in input order; ``workers`` threads keep at most ``window`` reads
    ahead (0 workers: read in this thread)."""
    if workers <= 0:
        for item in inputs:
            yield _read(item, transform)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="predict-read") as pool:
        pending: deque[Future] = deque()
        items = iter(inputs)
        for item in items:
            pending.append(pool.submit(_read, item, transform))
            if len(pending) >= window:
                break
        while pending:
            yield pending.popleft().result()
            item = next(items, None)
            if item is not None:
                pending.append(pool.submit(_read, item, transform))


class _Progress:
    """A tqdm bar on a terminal; elsewhere (a log file, a pipe) a log line at every tenth of the inputs."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.next_line = total, 0, total / 10
        on_terminal = enabled and sys.stderr.isatty()
        self.bar = None
        if on_terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="img", dynamic_ncols=True)
        self.lines = enabled and not on_terminal

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines and (self.done >= self.next_line or self.done == self.total):
            log.info("%d/%d images", self.done, self.total)
            self.next_line = (math.floor(self.done * 10 / self.total) + 1) * self.total / 10

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------ running
def _picture_name(name: str, used: set[str]) -> str:
    """``<name without suffix>.jpg``, or ``..._<k>.jpg`` for the k-th other input of that stem."""
    stem = PurePosixPath(name).with_suffix("").as_posix()
    picture, k = f"{stem}.jpg", 1
    while picture in used:
        picture, k = f"{stem}_{k}.jpg", k + 1
    used.add(picture)
    return picture


def _save_picture(picture: Image.Image, output_dir: Path, name: str, used: set[str], **options: Any) -> None:
    """``picture`` as ``<output_dir>/<name>.jpg`` (:func:`_picture_name`), subfolders made."""
    path = output_dir / _picture_name(name, used)
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(path, **options)


def _as_input(item: InputImage | str | os.PathLike) -> InputImage:
    return item if isinstance(item, InputImage) else InputImage(Path(item), Path(item).name)


def predict_images(
    detector: Detector,
    inputs: Sequence[InputImage | str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    batch_size: int = 8,
    draw_score_thresh: float = 0.3,
    draw: bool = True,
    image_ids: Sequence[int] | None = None,
    categories: CategoryMap | None = None,
    workers: int = 4,
    progress: bool = False,
) -> tuple[list[dict[str, Any]], list[tuple[Path, str]]]:
    """Detect objects in ``inputs``; write annotated pictures and ``predictions.json`` to ``output_dir``.

    ``predictions.json`` is in COCO results format (:func:`ssd_lightning.evaluation.to_coco_array`: bbox to
    0.001 px, score to 1e-5), one entry per detection the decoder keeps: ``image_id`` (``image_ids[i]`` for
    input ``i``, default ``i``; failures keep their place), ``category_id`` (from ``categories``, default
    the detector's), ``bbox`` ``[x, y, w, h]`` in original pixels clipped to the image, ``score``, plus
    ``file_name`` (the input's ``name``: its path relative to the input folder; a plain path is named by its
    file name) and ``category_name``. Pictures ``<output_dir>/<name>.jpg`` (subfolders kept, the suffix
    replaced; ``_1``, ``_2``... for further inputs of the same name) show detections with score >=
    ``draw_score_thresh``. ``workers`` threads read images ahead; ``progress`` shows a progress bar. The
    log's last line gives the images per second of the loop (reading, detecting, drawing; not loading the
    detector).

    Returns:
        (the COCO results, the failures as ``(path, reason)``). Unreadable files are skipped with an
        error message naming them; the others are processed.
    """
    from ssd_lightning.visualize import draw_detections

    items = [_as_input(item) for item in inputs]
    ids = list(range(len(items))) if image_ids is None else [int(i) for i in image_ids]
    if len(ids) != len(items):
        raise ValueError(f"{len(ids)} image_ids for {len(items)} inputs")
    categories = categories or detector.categories
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    used: set[str] = set()

    def run(batch: list[tuple[int, InputImage, Image.Image, Tensor]]) -> None:
        images = torch.stack([tensor for *_, tensor in batch])
        detections = detector.detect(images, [(img.height, img.width) for _, _, img, _ in batch])
        for (index, item, img, _), det in zip(batch, detections, strict=True):
            boxes = det["boxes"].cpu().double().numpy()
            scores = det["scores"].cpu().numpy()
            labels = det["labels"].cpu().numpy()
            clipped = boxes.copy()
            clipped[:, 0::2] = clipped[:, 0::2].clip(0, img.width)
            clipped[:, 1::2] = clipped[:, 1::2].clip(0, img.height)
            rows = to_coco_array([ids[index]], [clipped], [scores], [labels], categories)
            for entry, label in zip(coco_array_to_results(rows), labels, strict=True):
                entry.update(file_name=item.name, category_name=categories.names[int(label)])
                results.append(entry)
            if draw:
                picture = draw_detections(
                    img,
                    clipped,
                    labels,
                    scores,
                    class_names=categories.names,
                    score_thresh=draw_score_thresh,
                )
                _save_picture(picture, output_dir, item.name, used, quality=92, subsampling=0)

    transform = partial(preprocess, size=detector.image_size)
    failures = _run_batches(items, transform, run, batch_size=batch_size, workers=workers, progress=progress)
    with open(output_dir / "predictions.json", "w", encoding="utf-8") as f:
        json.dump(results, f)
    return results, failures


def _run_batches(
    items: Sequence[InputImage],
    transform: Callable[[Image.Image], Tensor],
    run: Callable[[list[tuple[int, InputImage, Image.Image, Tensor]]], None],
    *,
    batch_size: int,
    workers: int,
    progress: bool,
) -> list[tuple[Path, str]]:
    """Read ``items`` ahead in ``workers`` threads and call ``run`` on batches of ``(index, item, image,
    tensor)``; unreadable files are logged and skipped. Returns them as ``(path, reason)``; logs the rate."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    failures: list[tuple[Path, str]] = []
    bar = _Progress(len(items), progress)
    start = time.perf_counter()
    batch: list[tuple[int, InputImage, Image.Image, Tensor]] = []
    try:
        reads = _read_ahead(items, transform, workers, window=max(2 * batch_size, 4 * workers))
        for index, (item, image, tensor, reason) in enumerate(reads):
            if image is None:
                failures.append((item.path, reason))
                log.error("skipping %s: cannot read it as an image (%s)", item.path, reason)
                bar.update(1)
                continue
            batch.append((index, item, image, tensor))
            if len(batch) == batch_size:
                run(batch)
                bar.update(len(batch))
                batch = []
        if batch:
            run(batch)
            bar.update(len(batch))
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    done = len(items) - len(failures)
    log.info("%d images in %.1f s, %.1f images/s", done, seconds, done / seconds if seconds > 0 else 0.0)
    return failures


def imagefolder_labels(
    inputs: Sequence[InputImage], root: str | os.PathLike, class_names: Sequence[str]
) -> list[int]:
    """The true label of each input in an ImageFolder layout: its first folder below ``root``, by name
    among ``class_names``.

    Raises:
        DataError: an image outside ``root``, or in a folder that is not one of the classes (checked before
            anything runs; the message names them).
    """
    root = Path(root)
    label_of = {name: k for k, name in enumerate(class_names)}
    labels, outside, unknown = [], [], set()
    for item in inputs:
        try:
            folder = item.path.resolve().relative_to(root.resolve()).parts[0]
        except (ValueError, IndexError):
            outside.append(str(item.path))
            continue
        if folder not in label_of:
            unknown.add(folder)
        labels.append(label_of.get(folder, -1))
    if outside:
        raise DataError(
            f"annotations={root}: {len(outside)} input image(s) are not inside it, e.g. {outside[0]}; for a "
            "classifier, annotations= is the ImageFolder root whose class folders hold the input images"
        )
    if unknown:
        shown = ", ".join(class_names[:10]) + (", ..." if len(class_names) > 10 else "")
        raise DataError(
            f"annotations={root}: class folder(s) {sorted(unknown)[:10]} are not classes of the model "
            f"({shown})"
        )
    return labels


def classify_images(
    classifier: Classifier,
    inputs: Sequence[InputImage | str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    top_k: int = 5,
    batch_size: int = 8,
    draw: bool = False,
    workers: int = 4,
    progress: bool = False,
    labels: Sequence[int] | None = None,
) -> tuple[list[dict[str, Any]], list[tuple[Path, str]]]:
    """Classify ``inputs``; write ``predictions.json`` (and, with ``draw``, pictures) to ``output_dir``.

    ``predictions.json`` holds one entry per readable image, in input order: ``image_id`` (the input's
    index), ``file_name`` (its name, as for detection), ``top_k``: the ``top_k`` most likely classes as
    ``{"label", "name", "score"}`` (softmax probability, to 1e-5), best first. Pictures
    ``<output_dir>/<name>.jpg`` show the image framed in the top class's colour with its name and score.
    With the true ``labels`` of the inputs (:func:`imagefolder_labels`), top-1 and top-5 accuracy (overall
    and per class) are logged and written to ``<output_dir>/classification_eval.json``.

    Returns:
        (the entries, the unreadable files as ``(path, reason)``).
    """
    from ssd_lightning.visualize import draw_detections

    items = [_as_input(item) for item in inputs]
    names = classifier.class_names
    k = max(1, min(int(top_k), len(names)))
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    used: set[str] = set()
    hits = np.zeros((len(names), 3), dtype=np.int64)  # per true class: images, top-1 hits, top-5 hits

    def run(batch: list[tuple[int, InputImage, Image.Image, Tensor]]) -> None:
        probs = classifier.classify(torch.stack([tensor for *_, tensor in batch]))
        scores, ranked = probs.topk(max(k, min(5, len(names))), dim=1)
        for (index, item, img, _), score_row, label_row in zip(batch, scores, ranked, strict=True):
            top = [
                {"label": int(label), "name": names[int(label)], "score": round(float(score), 5)}
                for score, label in zip(score_row[:k], label_row[:k], strict=True)
            ]
            results.append({"image_id": index, "file_name": item.name, "top_k": top})
            if labels is not None:
                true = labels[index]
                hits[true] += (1, int(label_row[0]) == true, true in label_row[:5].tolist())
            if draw:
                best = top[0]
                picture = draw_detections(
                    img,
                    [[0, 0, img.width - 1, img.height - 1]],
                    [best["label"] + 1],
                    [best["score"]],
                    class_names=("", *names),
                )
                _save_picture(picture, output_dir, item.name, used, quality=92)

    failures = _run_batches(
        items, classifier.preprocess, run, batch_size=batch_size, workers=workers, progress=progress
    )
    atomic_write_json(output_dir / "predictions.json", results)
    if labels is not None:
        _report_accuracy(hits, names, output_dir)
    return results, failures


def _report_accuracy(hits: np.ndarray, names: Sequence[str], output_dir: Path) -> None:
    """Log and write ``classification_eval.json`` from per-class ``(images, top-1 hits, top-5 hits)``."""
    total, top1, top5 = (int(x) for x in hits.sum(axis=0))
    report = {
        "images": total,
        "top1": top1 / total if total else None,
        "top5": top5 / total if total else None,
        "per_class": [
            {"name": name, "images": int(n), "top1": int(h1) / int(n) if n else None}
            for name, (n, h1, _) in zip(names, hits, strict=True)
        ],
    }
    atomic_write_json(output_dir / "classification_eval.json", report, indent=1)
    rows = [
        (c["name"], c["images"], "-" if c["top1"] is None else f"{c['top1']:.3f}")
        for c in report["per_class"]
    ]
    log.info(
        "Classification of %d image(s): top-1 %.4f, top-5 %.4f\n%s\n-> %s",
        total,
        report["top1"] or 0.0,
        report["top5"] or 0.0,
        markdown_table(["class", "images", "top-1"], rows, align="lrr", pad=True),
        output_dir / "classification_eval.json",
    )


# ------------------------------------------------------------------------------------------ evaluation
def _category_text(pairs: Mapping[int, str], limit: int = 12) -> str:
    shown = [f"{i}: {name!r}" for i, name in list(pairs.items())[:limit]]
    more = f", ... ({len(pairs)} in all)" if len(pairs) > limit else ""
    return "{" + ", ".join(shown) + more + "}"


def categories_for_annotations(
    categories: CategoryMap, dataset: Mapping[str, Any], *, where: str = "annotations"
) -> CategoryMap:
    """The detector's ``categories`` with the category ids of a COCO ``dataset`` (parsed JSON).

    The same ``{id: name}`` set: ``categories`` as they are. The same names under other ids: each label
    gets the id of its name in ``dataset``.

    Raises:
        DataError: the names differ; the one-line message names both sets (``where`` names the file).
    """
    theirs = CategoryMap.from_coco(dataset, where=where)
    ours_pairs = dict(zip(categories.category_ids, categories.names[1:], strict=True))
    their_pairs = dict(zip(theirs.category_ids, theirs.names[1:], strict=True))
    if ours_pairs == their_pairs:
        return categories
    id_of_name = {name: i for i, name in their_pairs.items()}
    same_names = len(id_of_name) == len(their_pairs) and set(id_of_name) == set(categories.names[1:])
    if same_names and len(set(categories.names[1:])) == len(categories.names) - 1:
        log.info("%s: category ids matched to the detector's classes by name", where)
        return CategoryMap(tuple(id_of_name[name] for name in categories.names[1:]), categories.names)
    raise DataError(
        f"{where}: its categories {_category_text(their_pairs)} are not the detector's "
        f"{_category_text(ours_pairs)} (id: name; the names must be the same); give the annotation file of "
        "the classes the model was trained on"
    )


def _class_table(classes: Sequence[ClassAP]) -> str:
    """The per-class AP as a markdown table, category order; ``-`` where AP is undefined."""

    def value(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.3f}"

    rows = [(c.name, c.category_id, c.num_gt, value(c.ap), value(c.ap50)) for c in classes]
    return markdown_table(["category", "id", "GT", "AP", "AP50"], rows, align="lrrrr", pad=True)


def evaluate_predictions(
    annotation_file: str | os.PathLike,
    results: Sequence[Mapping[str, Any]] | str | os.PathLike,
    image_ids: Sequence[int],
    output_dir: str | os.PathLike,
    *,
    annotated_images: int | None = None,
) -> dict[str, Any]:
    """COCO bbox evaluation of ``results`` (keyed by ``annotation_file``'s ids) on the images ``image_ids``
    (an image without detections counts as missed) with
    :func:`ssd_lightning.evaluation.evaluate_coco_detailed`; logs the 12 numbers and a per-class table and
    writes them to ``<output_dir>/coco_eval.json``.

    Returns:
        What ``coco_eval.json`` holds: ``annotations`` (the file), ``images`` (how many evaluated),
        ``annotated_images`` (how many the file has, if given), ``stats`` (``{name: value}`` in
        :data:`~ssd_lightning.evaluation.COCO_STAT_NAMES` order, ``-1`` where undefined) and ``per_class``
        (``category_id``, ``name``, ``metric_key``, ``AP``, ``AP50``, ``num_gt``; ``null`` AP without ground
        truth).
    """
    with warnings.catch_warnings():  # a subset is stated in the log line below
        warnings.filterwarnings("ignore", message="evaluating on .* images", category=UserWarning)
        evaluation = evaluate_coco_detailed(annotation_file, results, verbose=False, image_ids=image_ids)
    stats, classes = evaluation.stats, evaluation.classes
    evaluated = len(set(image_ids))
    report = {
        "annotations": str(annotation_file),
        "images": evaluated,
        "annotated_images": annotated_images,
        "stats": {name: stats[name] for name in COCO_STAT_NAMES},
        "per_class": per_class_records(classes),
    }
    atomic_write_json(Path(output_dir) / "coco_eval.json", report, indent=1, allow_nan=False)
    scope = f"{evaluated} image(s)"
    if annotated_images is not None and annotated_images != evaluated:
        scope = f"{evaluated} of its {annotated_images} images (not the full-dataset metrics)"
    log.info("COCO bbox evaluation on %s of %s:\n%s", scope, annotation_file, format_summary(stats))
    log.info("Per-class AP (area all, maxDets 100):\n%s", _class_table(classes))
    log.info("-> %s", Path(output_dir) / "coco_eval.json")
    return report


# ------------------------------------------------------------------------------------------ predict.py
def _predict(settings: Mapping[str, Any]) -> int:
    inputs = collect_inputs(settings["input"], recursive=settings["recursive"], exclude=[settings["output"]])
    where = f"annotations={settings['annotations']}"
    model = load_model_from_settings(settings)
    log.info("%d input file(s); weights from %s; device %s", len(inputs), model.source, model.runs_on)
    common = {
        "batch_size": settings["batch_size"],
        "draw": settings["draw"],
        "workers": settings["workers"],
        "progress": settings["progress"],
    }
    if isinstance(model, Classifier):
        labels = None
        if settings["annotations"]:
            labels = imagefolder_labels(inputs, settings["annotations"], model.class_names)
        results, failures = classify_images(
            model, inputs, settings["output"], top_k=settings.get("top_k", 5), labels=labels, **common
        )
        log.info("%d image(s) classified -> %s/predictions.json", len(results), settings["output"])
    else:
        dataset = load_annotation_file(settings["annotations"]) if settings["annotations"] else None
        image_ids = match_annotation_ids(inputs, dataset, where=where) if dataset is not None else None
        categories = categories_for_annotations(model.categories, dataset, where=where) if dataset else None
        results, failures = predict_images(
            model,
            inputs,
            settings["output"],
            draw_score_thresh=settings["draw_score_thresh"],
            image_ids=image_ids,
            categories=categories,
            **common,
        )
        done = len(inputs) - len(failures)
        log.info(
            "%d image(s), %d detection(s) -> %s/predictions.json", done, len(results), settings["output"]
        )
    if failures:
        shown = ", ".join(str(p) for p, _ in failures[:10]) + (", ..." if len(failures) > 10 else "")
        log.error("%d file(s) skipped: %s", len(failures), shown)
    if len(failures) == len(inputs):
        log.error("no image could be read")
        return 1
    if settings["annotations"] and not isinstance(model, Classifier):
        evaluate_predictions(
            settings["annotations"],
            results,
            image_ids,
            settings["output"],
            annotated_images=len(dataset["images"]),
        )
    return 0


def predict_from_settings(settings: Mapping[str, Any]) -> int:
    """What ``python predict.py`` does with its resolved settings (``configs/predict.yaml``): collect the
    inputs, load the model the file holds, detect (and match the inputs to ``annotations``' image ids) or
    classify, write, evaluate.

    Returns:
        The exit status: 0, or 1 when no image could be read. Input errors (a missing list entry, images
        or categories the annotation file lacks) end the process with a one-line ``Error:`` (exit 1 or 2).
    """
    with user_errors_as_messages():
        return _predict(settings)
