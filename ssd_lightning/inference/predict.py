"""Detect objects in image files: collect inputs, preprocess, run a :class:`Detector`, write pictures + JSON.

Preprocessing (:func:`preprocess`) is the validation transform of the datamodules done with PIL and torch
instead of DALI: RGB (EXIF orientation applied), resize to 300×300 without letterbox (Pillow bilinear), then
``(pixel - 255 * mean) / (255 * std)`` with the ImageNet mean/std, NCHW float32.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from ssd_lightning.evaluation import coco_array_to_results, to_coco_array
from ssd_lightning.inference.detector import Detector

__all__ = ["IMAGE_EXTENSIONS", "collect_inputs", "open_image", "predict_images", "preprocess"]

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
IMAGENET_MEAN_255 = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD_255 = (0.229 * 255, 0.224 * 255, 0.225 * 255)


# ------------------------------------------------------------------------------------------ inputs
def collect_inputs(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Image files named by ``spec``: a file, a folder (its files with an image extension, sorted, not
    recursive), a glob pattern (``photos/*.jpg``, ``**`` allowed), or a list of those.

    Raises:
        FileNotFoundError: nothing matched (the message names ``spec``).
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    found: list[Path] = []
    for item in specs:
        path = Path(item)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
        else:
            found += sorted(Path(p) for p in glob.glob(str(item), recursive=True) if Path(p).is_file())
    if not found:
        raise FileNotFoundError(
            f"input={spec!s}: no image files found; give an image, a folder of images or a glob in quotes"
        )
    return list(dict.fromkeys(found))


def preprocess(image: Image.Image, size: int = 300) -> Tensor:
    """PIL image -> (3, size, size) float32, RGB, resized without letterbox, ImageNet-normalised."""
    rgb = image.convert("RGB").resize((size, size), Image.BILINEAR)
    array = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1)  # (3, S, S) 0..255
    mean = torch.tensor(IMAGENET_MEAN_255).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD_255).view(3, 1, 1)
    return (array - mean) / std


def open_image(path: Path) -> Image.Image:
    """Decode fully (so a truncated file fails here, not later) and apply the EXIF orientation."""
    with Image.open(path) as img:
        img.load()
        return ImageOps.exif_transpose(img).convert("RGB")


def _batches(paths: Sequence[Path], batch_size: int, failures: list[tuple[Path, str]]) -> Iterator[list]:
    batch: list[tuple[Path, Image.Image]] = []
    for path in paths:
        try:
            batch.append((path, open_image(path)))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            failures.append((path, f"{type(e).__name__}: {e}"))
            log.error("skipping %s: cannot read it as an image (%s)", path, e)
            continue
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


# ------------------------------------------------------------------------------------------ running
def _unique_name(path: Path, used: set[str]) -> str:
    name = f"{path.stem}.jpg"
    k = 1
    while name in used:
        name, k = f"{path.stem}_{k}.jpg", k + 1
    used.add(name)
    return name


def predict_images(
    detector: Detector,
    inputs: Sequence[Path],
    output_dir: str | os.PathLike,
    *,
    batch_size: int = 8,
    draw_score_thresh: float = 0.3,
    draw: bool = True,
) -> tuple[list[dict[str, Any]], list[tuple[Path, str]]]:
    """Detect objects in ``inputs``; write annotated pictures and ``predictions.json`` to ``output_dir``.

    ``predictions.json`` is in COCO results format (:func:`ssd_lightning.evaluation.to_coco_array`: bbox to
    0.001 px, score to 1e-5), one entry per detection the decoder keeps: ``image_id`` (index of the image in
    ``inputs`` order, failures included), ``category_id`` (dataset id), ``bbox`` ``[x, y, w, h]`` in original
    pixels clipped to the image, ``score``, plus ``file_name`` (the input path) and ``category_name``.
    Pictures ``<output_dir>/<stem>.jpg`` show detections with score >= ``draw_score_thresh``.

    Returns:
        (the COCO results, the failures as ``(path, reason)``). Unreadable files are skipped with an
        error message naming them; the others are processed.
    """
    from ssd_lightning.visualize import draw_detections

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    index = {path: i for i, path in enumerate(inputs)}
    results: list[dict[str, Any]] = []
    failures: list[tuple[Path, str]] = []
    used: set[str] = set()
    done = 0
    for batch in _batches(inputs, batch_size, failures):
        images = torch.stack([preprocess(img, detector.image_size) for _, img in batch])
        sizes = [(img.height, img.width) for _, img in batch]
        detections = detector.detect(images, sizes)
        for (path, img), det in zip(batch, detections, strict=True):
            boxes = det["boxes"].cpu().double().numpy()
            scores = det["scores"].cpu().numpy()
            labels = det["labels"].cpu().numpy()
            clipped = boxes.copy()
            clipped[:, 0::2] = clipped[:, 0::2].clip(0, img.width)
            clipped[:, 1::2] = clipped[:, 1::2].clip(0, img.height)
            rows = to_coco_array([index[path]], [clipped], [scores], [labels], detector.categories)
            for entry, label in zip(coco_array_to_results(rows), labels, strict=True):
                entry.update(file_name=str(path), category_name=detector.class_names[int(label)])
                results.append(entry)
            if draw:
                picture = draw_detections(
                    img,
                    clipped,
                    labels,
                    scores,
                    class_names=detector.class_names,
                    score_thresh=draw_score_thresh,
                )
                picture.save(output_dir / _unique_name(path, used), quality=92, subsampling=0)
            done += 1
        log.info("%d/%d images done", done + len(failures), len(inputs))
    with open(output_dir / "predictions.json", "w", encoding="utf-8") as f:
        json.dump(results, f)
    return results, failures
