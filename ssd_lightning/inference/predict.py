"""Detect objects in image files: read and preprocess, run a :class:`Detector`, write pictures + JSON, and
score the detections against a COCO annotation file (or classify them, with a :class:`Classifier`).

Images are read in ``workers`` threads a few batches ahead of the model, in input order; the same threads
draw and encode the pictures behind it. :func:`preprocess` is the datamodules' validation transform done
with PIL and torch instead of DALI; with the detector on CUDA, JPEGs are decoded and preprocessed on the GPU
(:mod:`~ssd_lightning.inference.gpu_decode`). Why and how fast: docs/internals.md, "inference/predict.py".
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path, PurePosixPath
from typing import IO, Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.errors import ConfigError, DataError, user_errors_as_messages
from ssd_lightning.evaluation import (
    COCO_STAT_NAMES,
    coco_result_texts,
    evaluate_coco_detailed,
    format_summary,
    per_class_records,
    to_coco_array,
)
from ssd_lightning.inference.classifier import Classifier
from ssd_lightning.inference.detector import Detector, resolve_dtype
from ssd_lightning.inference.loading import load_model_from_settings
from ssd_lightning.inference.sources import (
    InputImage,
    collect_inputs,
    load_annotation_file,
    match_annotation_ids,
    preview,
)
from ssd_lightning.io.atomic import atomic_write, atomic_write_json
from ssd_lightning.models import IMAGENET_MEAN, IMAGENET_STD
from ssd_lightning.tables import markdown_table

__all__ = [
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
    """PIL image -> (3, size, size) float32 RGB, resized without letterbox (Pillow bilinear), then
    ``(pixel - mean) / std`` with the ImageNet mean/std on the 0..255 scale."""
    rgb = image.convert("RGB").resize((size, size), Image.BILINEAR)
    array = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1)  # (3, S, S) 0..255
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    return (array - mean) / std


def open_image(path: Path, min_side: int = 0) -> tuple[Image.Image, tuple[int, int]]:
    """The image, EXIF-oriented and decoded fully (a truncated file fails here), and the full image's
    ``(height, width)`` after orientation (what detections are mapped to). ``min_side > 0``: a JPEG is
    decoded at the smallest libjpeg DCT scale (PIL ``draft``: 1/2, 1/4, 1/8) keeping both sides >= it."""
    with Image.open(path) as img:
        width, height = img.size
        if img.getexif().get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8):  # a quarter turn
            width, height = height, width
        if min_side > 0:
            img.draft("RGB", (min_side, min_side))
        img.load()
        return ImageOps.exif_transpose(img).convert("RGB"), (height, width)


READ_ERRORS = (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError)


@dataclass(frozen=True)
class _Read:
    """One input: decoded ``image`` (maybe reduced), full-image ``size`` (h, w), network ``tensor``; or the
    ``reason`` it could not be read."""

    index: int
    item: InputImage
    image: Image.Image | None = None
    size: tuple[int, int] = (0, 0)
    tensor: Tensor | None = None
    reason: str = ""


def _read(index: int, item: InputImage, transform: Callable[[Image.Image], Tensor], min_side: int) -> _Read:
    try:
        image, size = open_image(item.path, min_side)
    except READ_ERRORS as e:
        return _Read(index, item, reason=f"{type(e).__name__}: {e}")
    return _Read(index, item, image, size, transform(image))


def _cuda_device_of(detector: Detector) -> torch.device | None:
    """The CUDA device ``detector``'s network runs on; None on a CPU or for an ONNX session."""
    device = detector.device if getattr(detector, "net", None) is not None else None
    return device if device is not None and device.type == "cuda" else None


def _one_at_a_time(read: Callable[[int, InputImage], _Read]) -> Callable[..., list[_Read]]:
    return lambda start, chunk: [read(start + k, item) for k, item in enumerate(chunk)]


def _read_on_gpu(
    start: int,
    chunk: Sequence[InputImage],
    device: torch.device,
    size: int,
    picture_size: int,
    host: Callable[[int, InputImage], _Read],
) -> list[_Read]:
    """``chunk``'s JPEGs decoded together and preprocessed on ``device`` (pictures of at most
    ``picture_size`` copied to the host; none for 0); other files and refused JPEGs read by ``host``."""
    from ssd_lightning.inference import gpu_decode

    def on_host(index: int) -> _Read:
        done = host(start + index, chunk[index])
        return done if done.reason else replace(done, tensor=done.tensor.to(device))

    reads: list[_Read | None] = [None] * len(chunk)
    jpegs: dict[int, int] = {}  # position in chunk -> EXIF orientation
    for k, item in enumerate(chunk):
        try:
            orientation = gpu_decode.jpeg_orientation(item.path)
        except READ_ERRORS as e:
            reads[k] = _Read(start + k, item, reason=f"{type(e).__name__}: {e}")
            continue
        if orientation is None:
            reads[k] = on_host(k)
        else:
            jpegs[k] = orientation
    paths = [chunk[k].path for k in jpegs]
    for k, image in zip(jpegs, gpu_decode.decode_jpegs_on(paths, list(jpegs.values()), device), strict=True):
        if image is None:
            reads[k] = on_host(k)
        else:
            picture = gpu_decode.picture_of(image, picture_size) if picture_size else None
            tensor = gpu_decode.network_input(image, size)
            reads[k] = _Read(start + k, chunk[k], picture, tuple(image.shape[1:]), tensor)
    return reads


class _Pool:
    """``workers`` threads reading ahead of the network and writing pictures behind it, at most ``window``
    tasks each way (0 workers: all in the calling thread)."""

    def __init__(self, workers: int, window: int) -> None:
        self.executor = ThreadPoolExecutor(workers, "predict") if workers > 0 else None
        self.window = window
        self.behind: deque[Future] = deque()

    def read_ahead(self, items: Sequence[InputImage], read: Callable, chunk: int = 1) -> Iterator[_Read]:
        starts = range(0, len(items), chunk)
        if self.executor is None:
            for start in starts:
                yield from read(start, items[start : start + chunk])
            return
        ahead: deque[Future] = deque()
        for start in starts:
            ahead.append(self.executor.submit(read, start, items[start : start + chunk]))
            if len(ahead) >= max(1, self.window // chunk):
                yield from ahead.popleft().result()
        while ahead:
            yield from ahead.popleft().result()

    def later(self, task: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """``task`` in the background; beyond ``window`` pending, waits for the oldest (raising its error)."""
        if self.executor is None:
            task(*args, **kwargs)
            return
        self.behind.append(self.executor.submit(task, *args, **kwargs))
        while len(self.behind) > self.window:
            self.behind.popleft().result()

    def close(self, wait: bool) -> None:
        if self.executor is None:
            return
        try:
            while wait and self.behind:
                self.behind.popleft().result()
        finally:
            self.executor.shutdown(wait=True, cancel_futures=True)


class _Progress:
    """A tqdm bar on a terminal; elsewhere (a log file, a pipe) a log line at every tenth of the inputs."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.bar = total, 0, None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="img", dynamic_ncols=True)
        self.lines = enabled and self.bar is None

    def update(self, n: int) -> None:
        tenth, self.done = self.done * 10 // self.total, self.done + n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines and (self.done * 10 // self.total > tenth or self.done == self.total):
            log.info("%d/%d images", self.done, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _picture_name(name: str, used: set[str]) -> str:
    """``<name without suffix>.jpg``, or ``..._<k>.jpg`` for the k-th other input of that stem."""
    stem = PurePosixPath(name).with_suffix("").as_posix()
    picture, k = f"{stem}.jpg", 1
    while picture in used:
        picture, k = f"{stem}_{k}.jpg", k + 1
    used.add(picture)
    return picture


def _write_picture(
    picture_size: int, path: Path, read: _Read, boxes: Any, labels: Any, scores: Any, **draw: Any
) -> None:
    """``read``'s image with ``boxes`` (ltrb, full-image pixels) drawn, longer side <= ``picture_size``."""
    from ssd_lightning.visualize import draw_detections

    image = read.image
    boxes = np.asarray(boxes, dtype=np.float64) * (image.width / read.size[1])  # to the decoded pixels
    scale = min(1.0, picture_size / max(image.size))
    picture = draw_detections(image, boxes, labels, scores, scale=scale, **draw)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        picture.save(path, quality=92, subsampling=0)
    except OSError as e:  # raised on the main thread by _Pool: name the file
        raise OSError(e.errno, f"cannot write the picture {path}: {e.strerror or e}") from None


def _record_of(
    read: _Read, det: Mapping[str, Tensor], image_id: int, categories: CategoryMap, quoted: Sequence[str]
) -> tuple[str, list[str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The ``predictions.jsonl`` line, the ``predictions.json`` entries (COCO results, boxes clipped to the
    image) and what the picture shows: the clipped ltrb boxes, labels, scores. The text is what
    ``json.dumps`` writes (``quoted``: the JSON strings of ``categories.names``), each number formatted
    once: at 200 detections an image, ``json.dumps`` and re-reading the lines cost ~2 ms an image."""
    height, width = read.size
    boxes = det["boxes"].cpu().double().numpy().clip(0, [width, height, width, height])
    labels, scores = det["labels"].cpu().numpy(), det["scores"].cpu().numpy()
    rows = to_coco_array([image_id], [boxes], [scores], [labels], categories)
    # '{"image_id": 5, "category_id": ..., "score": ...}' -> '"category_id": ..., "score": ...'
    cores = [text.partition(", ")[2][:-1] for text in coco_result_texts(rows, separators=(", ", ": "))]
    names = [quoted[int(label)] for label in labels]
    file_name = json.dumps(read.item.name)
    detections = ", ".join(
        f'{{{core}, "category_name": {name}}}' for core, name in zip(cores, names, strict=True)
    )
    line = (
        f'{{"image_id": {image_id}, "file_name": {file_name}, "height": {height}, "width": {width}, '
        f'"detections": [{detections}]}}'
    )
    entries = [
        f'{{"image_id": {image_id}, {core}, "file_name": {file_name}, "category_name": {name}}}'
        for core, name in zip(cores, names, strict=True)
    ]
    return line, entries, (boxes, labels, scores)


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
    fast_decode: bool = True,
    picture_size: int = 1280,
    gpu_decode: bool = True,
    keep_results: bool = True,
) -> tuple[list[dict[str, Any]], list[tuple[Path, str]]]:
    """Detect objects in ``inputs``; write pictures ``<name>.jpg`` (``_1``... for repeated names; scores >=
    ``draw_score_thresh``), ``predictions.jsonl`` (a line per input as it is done: ``image_id``,
    ``file_name``, ``height``, ``width``, ``detections`` or ``error``) and, written alongside and renamed
    into place when complete, ``predictions.json``: COCO results with ``image_id`` = ``image_ids[i]``
    (default ``i``), ids of ``categories`` (default the detector's), bbox in original pixels clipped to the
    image, ``file_name``, ``category_name``. Returns (those results, ``[]`` without ``keep_results``;
    unreadable ``(path, reason)``). ``fast_decode``: JPEGs decoded at the smallest libjpeg scale keeping
    both sides >= twice the network input (false, with ``gpu_decode=False`` on CUDA: earlier versions'
    detections); ``gpu_decode``: on CUDA, decoded and preprocessed there."""
    ids = list(range(len(inputs))) if image_ids is None else [int(i) for i in image_ids]
    if len(ids) != len(inputs):
        raise ValueError(f"{len(ids)} image_ids for {len(inputs)} inputs")
    categories, output_dir = categories or detector.categories, Path(output_dir)
    size = detector.image_size
    host = partial(_read, transform=partial(preprocess, size=size), min_side=2 * size if fast_decode else 0)
    device = _cuda_device_of(detector) if gpu_decode else None
    read, chunk = _one_at_a_time(host), 1
    if device is not None:  # one batch's JPEGs decoded together
        shown = picture_size if draw else 0
        read = partial(_read_on_gpu, device=device, size=size, picture_size=shown, host=host)
        chunk = batch_size
    style = {"class_names": categories.names, "score_thresh": draw_score_thresh}
    picture = partial(_write_picture, picture_size, **style) if draw else None
    quoted = [json.dumps(name) for name in categories.names]
    failures: list[tuple[Path, str]] = []
    count = 0

    def predict_into(coco: IO[str]) -> None:  # the entries as they come; predictions.json when complete
        def run(batch: list[_Read]) -> list[tuple[str, tuple]]:
            nonlocal count
            detections = detector.detect(torch.stack([r.tensor for r in batch]), [r.size for r in batch])
            done = []
            for image, det in zip(batch, detections, strict=True):
                line, entries, drawn = _record_of(image, det, ids[image.index], categories, quoted)
                if entries:
                    coco.write((", " if count else "") + ", ".join(entries))
                    count += len(entries)
                done.append((line, drawn))
            return done

        coco.write("[")
        failures.extend(
            _run_batches(inputs, ids, read, run, output_dir, batch_size, workers, progress, chunk, picture)
        )
        coco.write("]")

    target = atomic_write(output_dir / "predictions.json", predict_into)
    log.info("%d image(s), %d detection(s) -> %s", len(inputs) - len(failures), count, target)
    return json.loads(target.read_text(encoding="utf-8")) if keep_results else [], failures


def _run_batches(
    inputs: Sequence[InputImage | str | os.PathLike],
    ids: Sequence[int],
    read: Callable[[int, Sequence[InputImage]], list[_Read]],
    run: Callable[[list[_Read]], list[tuple[dict[str, Any] | str, tuple]]],
    output_dir: Path,
    batch_size: int,
    workers: int,
    progress: bool,
    chunk: int = 1,
    picture: Callable[..., None] | None = None,
) -> list[tuple[Path, str]]:
    """Read ``inputs`` ahead (``chunk`` per task, at most ``max(2 * batch_size, 4 * workers)`` items), call
    ``run`` per batch and write the records it returns to ``<output_dir>/predictions.jsonl`` as they come,
    each read's ``(boxes, labels, scores)`` drawn behind by ``picture(path, read, boxes, labels, scores)``
    (as ``<name>.jpg``, see :func:`_picture_name`); unreadable files are logged, recorded there with an
    ``error`` and returned as ``(path, reason)``. Logs the rate."""
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size}: must be >= 1")
    items = [
        item if isinstance(item, InputImage) else InputImage(Path(item), Path(item).name) for item in inputs
    ]
    output_dir.mkdir(parents=True, exist_ok=True)
    failures: list[tuple[Path, str]] = []
    used: set[str] = set()
    bar = _Progress(len(items), progress)
    pool = _Pool(workers, window=max(2 * batch_size, 4 * workers))
    start = time.perf_counter()
    batch: list[_Read] = []
    finished = False
    with open(output_dir / "predictions.jsonl", "w", encoding="utf-8") as lines:

        def write(records: Iterable[Mapping[str, Any] | str], n: int) -> None:
            lines.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
            lines.flush()
            bar.update(n)

        def finish(batch: list[_Read]) -> None:
            outputs = run(batch)
            if picture is not None:
                for done, (_, drawn) in zip(batch, outputs, strict=True):
                    pool.later(picture, output_dir / _picture_name(done.item.name, used), done, *drawn)
            write([record for record, _ in outputs], len(batch))

        try:
            for done in pool.read_ahead(items, read, chunk):
                if done.reason:
                    failures.append((done.item.path, done.reason))
                    log.error("skipping %s: cannot read it as an image (%s)", done.item.path, done.reason)
                    error = {"image_id": ids[done.index], "file_name": done.item.name, "error": done.reason}
                    write([error], 1)
                    continue
                batch.append(done)
                if len(batch) == batch_size:
                    finish(batch)
                    batch = []
            if batch:
                finish(batch)
            finished = True
        finally:
            pool.close(wait=finished)
            bar.close()
    seconds = time.perf_counter() - start
    done = len(items) - len(failures)
    log.info("%d images in %.1f s, %.1f images/s", done, seconds, done / seconds if seconds > 0 else 0.0)
    return failures


def imagefolder_labels(
    inputs: Sequence[InputImage], root: str | os.PathLike, class_names: Sequence[str]
) -> list[int]:
    """The true label of each input in an ImageFolder layout: its first folder below ``root``, by name
    among ``class_names``. DataError for an image outside ``root`` or in a folder that is not a class."""
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
        raise DataError(
            f"annotations={root}: class folder(s) {sorted(unknown)[:10]} are not classes of the model "
            f"({preview(class_names, 10)})"
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
    picture_size: int = 1280,
) -> tuple[list[dict[str, Any]], list[tuple[Path, str]]]:
    """Classify ``inputs`` into ``<output_dir>/predictions.json`` (``.jsonl`` and pictures as for detection):
    per readable image ``image_id`` (input index), ``file_name``, ``top_k`` (``{"label", "name", "score"}``,
    best first). With the true ``labels``, top-1/top-5 accuracy goes to ``classification_eval.json``.
    Returns (the entries, the unreadable ``(path, reason)``)."""
    names, output_dir = classifier.class_names, Path(output_dir)
    k = max(1, min(int(top_k), len(names)))
    results: list[dict[str, Any]] = []
    hits = np.zeros((len(names), 3), dtype=np.int64)  # per true class: images, top-1 hits, top-5 hits

    def run(batch: list[_Read]) -> list[tuple[dict[str, Any], tuple]]:
        probs = classifier.classify(torch.stack([r.tensor for r in batch]))
        scores, ranked = probs.topk(max(k, min(5, len(names))), dim=1)
        done = []
        for read, score_row, label_row in zip(batch, scores, ranked, strict=True):
            top = [
                {"label": int(label), "name": names[int(label)], "score": round(float(score), 5)}
                for score, label in zip(score_row[:k], label_row[:k], strict=True)
            ]
            results.append({"image_id": read.index, "file_name": read.item.name, "top_k": top})
            if labels is not None:
                true = labels[read.index]
                hits[true] += (1, int(label_row[0]) == true, true in label_row[:5].tolist())
            frame = [[0, 0, read.size[1] - 1, read.size[0] - 1]]  # the whole image, in its class's colour
            done.append((results[-1], (frame, [top[0]["label"] + 1], [top[0]["score"]])))
        return done

    read = _one_at_a_time(partial(_read, transform=classifier.preprocess, min_side=0))
    picture = partial(_write_picture, picture_size, class_names=("", *names)) if draw else None
    ids = range(len(inputs))
    failures = _run_batches(inputs, ids, read, run, output_dir, batch_size, workers, progress, 1, picture)
    atomic_write_json(output_dir / "predictions.json", results)
    if labels is not None:
        _report_accuracy(hits, names, output_dir)
    return results, failures


def _report_accuracy(hits: np.ndarray, names: Sequence[str], output_dir: Path) -> None:
    total, top1, top5 = (int(x) for x in hits.sum(axis=0))
    per_class = [
        {"name": name, "images": int(n), "top1": int(h1) / int(n) if n else None}
        for name, (n, h1, _) in zip(names, hits, strict=True)
    ]
    top1, top5 = (top1 / total, top5 / total) if total else (None, None)
    report = {"images": total, "top1": top1, "top5": top5, "per_class": per_class}
    path = atomic_write_json(output_dir / "classification_eval.json", report, indent=1)
    rows = [(c["name"], c["images"], "-" if c["top1"] is None else f"{c['top1']:.3f}") for c in per_class]
    table = markdown_table(["class", "images", "top-1"], rows, align="lrr", pad=True)
    summary = f"Classification of {total} image(s): top-1 {top1 or 0.0:.4f}, top-5 {top5 or 0.0:.4f}"
    log.info("%s\n%s\n-> %s", summary, table, path)


def _category_text(pairs: Mapping[int, str], limit: int = 12) -> str:
    shown = [f"{i}: {name!r}" for i, name in list(pairs.items())[:limit]]
    more = f", ... ({len(pairs)} in all)" if len(pairs) > limit else ""
    return "{" + ", ".join(shown) + more + "}"


def categories_for_annotations(
    categories: CategoryMap, dataset: Mapping[str, Any], *, where: str = "annotations"
) -> CategoryMap:
    """The detector's ``categories`` with the category ids of a COCO ``dataset`` (parsed JSON): as they are
    for the same ``{id: name}`` set, renumbered by name for the same names; else DataError (names both)."""
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


def evaluate_predictions(
    annotation_file: str | os.PathLike,
    results: Sequence[Mapping[str, Any]] | str | os.PathLike,
    image_ids: Sequence[int],
    output_dir: str | os.PathLike,
    *,
    annotated_images: int | None = None,
) -> dict[str, Any]:
    """COCO bbox evaluation of ``results`` on the images ``image_ids`` (one without detections counts as
    missed), logged and returned as written to ``<output_dir>/coco_eval.json``: ``annotations``, ``images``,
    ``annotated_images``, ``stats`` (``-1`` undefined) and ``per_class`` (``null`` AP without ground truth).
    """
    with warnings.catch_warnings():  # a subset is stated in the log line below
        warnings.filterwarnings("ignore", message="evaluating on .* images", category=UserWarning)
        evaluation = evaluate_coco_detailed(annotation_file, results, verbose=False, image_ids=image_ids)
    stats, classes, evaluated = evaluation.stats, evaluation.classes, len(set(image_ids))
    report = {
        "annotations": str(annotation_file),
        "images": evaluated,
        "annotated_images": annotated_images,
        "stats": {name: stats[name] for name in COCO_STAT_NAMES},
        "per_class": per_class_records(classes),
    }
    written = atomic_write_json(Path(output_dir) / "coco_eval.json", report, indent=1, allow_nan=False)
    scope = f"{evaluated} image(s)"
    if annotated_images is not None and annotated_images != evaluated:
        scope = f"{evaluated} of its {annotated_images} images (not the full-dataset metrics)"
    log.info("COCO bbox evaluation on %s of %s:\n%s", scope, annotation_file, format_summary(stats))
    rows = [
        (c.name, c.category_id, c.num_gt, *("-" if math.isnan(x) else f"{x:.3f}" for x in (c.ap, c.ap50)))
        for c in classes
    ]  # category order; "-" where AP is undefined
    table = markdown_table(["category", "id", "GT", "AP", "AP50"], rows, align="lrrrr", pad=True)
    log.info("Per-class AP (area all, maxDets 100):\n%s", table)
    log.info("-> %s", written)
    return report


def predict_from_settings(settings: Mapping[str, Any]) -> int:
    """What ``python predict.py`` does with its resolved settings (``configs/predict.yaml``): collect the
    inputs, load the model, detect or classify, write, evaluate. Returns the exit status: 0, or 1 when no
    image could be read; input errors end the process with a one-line ``Error:`` (exit 1 or 2)."""
    with user_errors_as_messages():
        output, size, annotations = settings["output"], settings["picture_size"], settings["annotations"]
        if size < 1:
            raise ConfigError(f"picture_size={size}: the pictures' longer side in pixels (>= 1)")
        inputs = collect_inputs(settings["input"], recursive=settings["recursive"], exclude=[output])
        model = load_model_from_settings(settings)
        dtype = ""  # a classifier runs in fp32, an ONNX export as exported
        if isinstance(model, Detector) and model.net is not None:
            dtype = f"; dtype {model.dtype} ({resolve_dtype(settings['dtype'], model.device)[1]})"
        log.info(
            "%d input file(s); weights from %s; device %s%s", len(inputs), model.source, model.runs_on, dtype
        )
        common = {key: settings[key] for key in ("batch_size", "draw", "workers", "progress", "picture_size")}
        dataset = None  # the annotations of a detector's inputs
        if isinstance(model, Classifier):
            top_k = settings.get("top_k", 5)
            labels = imagefolder_labels(inputs, annotations, model.class_names) if annotations else None
            results, failures = classify_images(model, inputs, output, top_k=top_k, labels=labels, **common)
            log.info("%d image(s) classified -> %s/predictions.json", len(results), output)
        else:
            common.update({key: settings[key] for key in ("draw_score_thresh", "fast_decode", "gpu_decode")})
            if annotations:
                dataset, where = load_annotation_file(annotations), f"annotations={annotations}"
                common["image_ids"] = match_annotation_ids(inputs, dataset, where=where)
                common["categories"] = categories_for_annotations(model.categories, dataset, where=where)
            _, failures = predict_images(model, inputs, output, keep_results=False, **common)
        if failures:
            log.error("%d file(s) skipped: %s", len(failures), preview([str(p) for p, _ in failures], 10))
        if len(failures) == len(inputs):
            log.error("no image could be read")
            return 1
        if dataset is not None:
            results_file, annotated = Path(output) / "predictions.json", len(dataset["images"])
            evaluate_predictions(
                annotations, results_file, common["image_ids"], output, annotated_images=annotated
            )
        return 0
