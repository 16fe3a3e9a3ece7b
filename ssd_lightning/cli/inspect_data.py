"""``task=inspect_data``: look at the data before training; writes into the run directory, trains nothing.

Detection: ``data_stats.json``/``.png`` (label statistics of both splits), ``default_box_fit.json``/``.png``
(how the SSD300 training targets cover the training boxes), ``batches/batch_<i>.jpg``/``.json`` (the first
DALI training batches, boxes decoded back from the targets). Classification: images per class and the grids.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from PIL import Image, ImageDraw, ImageFont

from ssd_lightning.data.coco_datamodule import CocoDALIDataModule
from ssd_lightning.data.imagefolder_datamodule import ImageFolderDALIDataModule, list_image_folder
from ssd_lightning.data.inspection import (
    decode_targets,
    default_box_fit,
    label_statistics,
    load_coco_arrays,
    plot_default_box_fit,
    plot_label_statistics,
)
from ssd_lightning.errors import ConfigError
from ssd_lightning.io.atomic import atomic_write_json
from ssd_lightning.models import IMAGENET_MEAN, IMAGENET_STD, dboxes300_coco
from ssd_lightning.visualize import draw_detections

__all__ = ["run_inspect_task"]

log = logging.getLogger(__name__)

_MAX_TILES = 64  # images drawn per batch grid


def run_inspect_task(
    datamodule: pl.LightningDataModule,
    output_dir: str | os.PathLike,
    *,
    num_batches: int = 2,
    fit_images: int | None = 2000,
) -> dict[str, float]:
    """Write the inspection of ``datamodule``'s data (COCO layout or image folder; its training pipeline runs
    on the CPU) into ``output_dir``, log a summary and return the key numbers (what ``train()`` returns).
    ``fit_images``: training images (evenly spaced) of the default-box fit, None: all."""
    if not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 0:
        raise ConfigError(f"inspect.num_batches must be an integer >= 0, got {num_batches!r}")
    if fit_images is not None and (not isinstance(fit_images, int) or fit_images < 1):
        raise ConfigError(f"inspect.fit_images must be a positive integer or null (all), got {fit_images!r}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(datamodule, "device"):
        datamodule.device = "cpu"  # inspection runs no model: CPU pipelines, like the tests
    datamodule.prepare_data()  # generated datasets (shapes) are made here on first use
    if isinstance(datamodule, CocoDALIDataModule):
        return _inspect_detection(datamodule, out, num_batches, fit_images)
    if isinstance(datamodule, ImageFolderDALIDataModule):
        return _inspect_classification(datamodule, out, num_batches)
    raise ConfigError(
        f"task=inspect_data reads COCO-layout detection data or ImageFolder classification data; "
        f"data._target_ is {type(datamodule).__name__}, which has neither (choose another data=...)"
    )


def _inspect_detection(
    dm: CocoDALIDataModule, out: Path, num_batches: int, fit_images: int | None
) -> dict[str, float]:
    started = time.perf_counter()
    stats, arrays = {}, {}
    for split in ("train", "val") if dm.val_annotations.is_file() else ("train",):
        info = dm.check_split(split)  # the start-up check's counts; statistics of the copy DALI reads
        arrays[split] = load_coco_arrays(info.reader_annotation_file)
        stats[split] = {
            "annotation_file": str(info.annotation_file),
            "read_from": str(info.reader_annotation_file),
            "boxes_clipped_to_image": info.num_clipped,
            "boxes_dropped_below_0.1px": info.num_dropped,
            **label_statistics(arrays[split]),
        }
    stats_seconds = time.perf_counter() - started
    atomic_write_json(out / "data_stats.json", stats)
    plot_label_statistics(
        stats["train"], out / "data_stats.png", title=f"training labels: {dm.train_annotations}"
    )
    started = time.perf_counter()
    fit = default_box_fit(
        arrays["train"], dboxes300_coco().ltrb, include_crowd=dm.include_crowd, max_images=fit_images
    )
    fit_seconds = time.perf_counter() - started
    atomic_write_json(out / "default_box_fit.json", fit)
    plot_default_box_fit(fit, out / "default_box_fit.png", title="SSD300 default boxes vs training boxes")
    grids = _detection_batches(dm, out / "batches", num_batches, arrays["train"].names)
    lines = [
        f"inspect_data: outputs in {out}",
        *_summary(stats, fit),
        f"  statistics {stats_seconds:.1f} s, default-box fit {fit_seconds:.1f} s",
        f"  {out / 'data_stats.json'}, {out / 'data_stats.png'}",
        f"  {out / 'default_box_fit.json'}, {out / 'default_box_fit.png'}",
        *(f"  {p}" for p in grids),
    ]
    log.info("\n".join(lines))
    o = fit["overall"]
    return {
        "inspect/train_images": float(stats["train"]["images"]),
        "inspect/train_boxes": float(stats["train"]["boxes"]),
        "inspect/fit_matched_mean": float(o["matched_mean"] or 0.0),
        "inspect/fit_forced_only_share": float(o["forced_only_share"] or 0.0),
        "inspect/stats_seconds": stats_seconds,
        "inspect/fit_seconds": fit_seconds,
    }


def _summary(stats: dict[str, dict], fit: dict) -> list[str]:
    train = stats["train"]
    lines = [
        f"  train: {train['images']} images, {train['boxes']} boxes "
        f"({train['boxes_per_image']['mean']:.2f} per image, max {train['boxes_per_image']['max']}), "
        f"{train['images_without_boxes']} images without boxes, {train['crowd_boxes']} crowd boxes",
        "  sizes: " + ", ".join(f"{k} {v}" for k, v in train["size_buckets"].items()),
        "  boxes per class: " + _first_12(f"{c['name']} {c['boxes']}" for c in train["classes"]),
    ]
    if "val" in stats:
        lines.append(f"  val: {stats['val']['images']} images, {stats['val']['boxes']} boxes")
    o = fit["overall"]
    lines.append(
        f"  default-box fit ({fit['images']} images, {o['boxes']} boxes): "
        f"{o['matched_mean'] or 0:.2f} default boxes per box, mean best IoU {o['best_iou_mean'] or 0:.3f}, "
        f"{o['forced_only']} ({100 * (o['forced_only_share'] or 0):.1f}%) matched only by the forced rule"
    )
    for name, g in fit["size_buckets"].items():
        if g["boxes"]:
            lines.append(
                f"    {name}: {g['boxes']} boxes, {g['matched_mean']:.2f} per box, "
                f"forced-only {100 * g['forced_only_share']:.1f}%"
            )
    return lines


def _first_12(items: Iterable[str]) -> str:
    items = list(items)
    return ", ".join(items[:12]) + (" ..." if len(items) > 12 else "")


def _detection_batches(dm: CocoDALIDataModule, folder: Path, num_batches: int, names: Sequence[str]) -> list:
    """The first ``num_batches`` batches of the datamodule's DALI training pipeline (with image ids), drawn
    with the boxes decoded from their targets; ``batch_<i>.json`` lists those boxes in input pixels."""

    def draw(i: int, batch: dict) -> list[Image.Image]:
        size = batch["images"].shape[-1]
        decoded = decode_targets(batch["boxes"], batch["labels"])
        tiles, records = [], []
        for k, (image, (boxes, labels)) in enumerate(zip(_to_pil(batch["images"]), decoded, strict=True)):
            image_id, boxes = int(batch["image_ids"][k]), boxes * size
            records.append({"image_id": image_id, "boxes": boxes.tolist(), "labels": labels.tolist()})
            if k < _MAX_TILES:
                tile = draw_detections(image, boxes, labels, class_names=names)
                tiles.append(_caption(tile, f"id {image_id}"))
        atomic_write_json(folder / f"batch_{i}.json", {"image_size": size, "images": records})
        return tiles

    return _save_batches(lambda: dm.make_loader("train", with_image_ids=True), folder, num_batches, draw)


def _save_batches(make_loader: Callable[[], Iterable], folder: Path, num_batches: int, draw) -> list[Path]:
    """``batch_<i>.jpg``: the grid of ``draw(i, batch)``'s tiles of the first batches (0: no loader built)."""
    written = []
    for i, batch in enumerate(itertools.islice(make_loader(), num_batches) if num_batches else ()):
        folder.mkdir(parents=True, exist_ok=True)
        tiles = draw(i, batch)
        written.append(folder / f"batch_{i}.jpg")
        _grid(tiles).save(written[-1], quality=90)
    return written


def _inspect_classification(dm: ImageFolderDALIDataModule, out: Path, num_batches: int) -> dict[str, float]:
    stats = {}
    for split, directory in (("train", dm.train_dir), ("val", dm.val_dir)):
        if split == "val" and not Path(directory).is_dir():
            continue
        classes, files = list_image_folder(Path(directory))
        counts = Counter(label for _, label in files)
        stats[split] = {
            "folder": str(directory),
            "images": len(files),
            "classes": [{"label": k, "name": c, "images": counts[k]} for k, c in enumerate(classes)],
        }
    atomic_write_json(out / "data_stats.json", stats)
    _plot_class_counts(stats, out / "data_stats.png")

    def draw(i: int, batch: dict) -> list[Image.Image]:
        names, tiles, images = dm.class_names, [], _to_pil(batch["images"][:_MAX_TILES])
        for image, label in zip(images, batch["labels"].tolist(), strict=False):
            scale = max(1, round(160 / image.width))
            big = image.resize((image.width * scale, image.height * scale))
            tiles.append(_caption(big, names[label]))
        return tiles

    written = _save_batches(dm.train_dataloader, out / "batches", num_batches, draw)
    train = stats["train"]
    lines = [
        f"inspect_data: outputs in {out}",
        f"  train: {train['images']} images in {len(train['classes'])} classes: "
        + _first_12(f"{c['name']} {c['images']}" for c in train["classes"]),
    ]
    if "val" in stats:
        lines.append(f"  val: {stats['val']['images']} images")
    lines += [f"  {out / 'data_stats.json'}, {out / 'data_stats.png'}", *(f"  {p}" for p in written)]
    log.info("\n".join(lines))
    return {"inspect/train_images": float(train["images"]), "inspect/classes": float(len(train["classes"]))}


def _plot_class_counts(stats: dict, output: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5), layout="constrained")
    ax = fig.subplots()
    names = [c["name"] for c in stats["train"]["classes"]]
    x = np.arange(len(names))
    for shift, split in ((-0.2, "train"), (0.2, "val")):
        if split in stats:
            ax.bar(x + shift, [c["images"] for c in stats[split]["classes"]], width=0.4, label=split)
    ax.set_xticks(x, names, rotation=90 if len(names) > 10 else 0)
    ax.set(ylabel="images", title="images per class")
    ax.legend()
    fig.savefig(output, dpi=100)


def _to_pil(images: torch.Tensor) -> list[Image.Image]:
    """(N, 3, S, S) ImageNet-normalised batch -> RGB images (the pipeline's normalisation undone)."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    pixels = (images.float().cpu() * std + mean).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in pixels]


def _caption(image: Image.Image, text: str) -> Image.Image:
    draw = ImageDraw.Draw(image)
    try:
        font = ImageFont.load_default(size=max(10, image.width // 20))
    except (TypeError, OSError, ImportError):  # Pillow without FreeType
        font = ImageFont.load_default()
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.rectangle((0, 0, right - left + 4, bottom - top + 4), fill=(0, 0, 0))
    draw.text((2 - left, 2 - top), text, fill=(255, 255, 255), font=font)
    return image


def _grid(tiles: list[Image.Image]) -> Image.Image:
    cols = max(1, math.ceil(math.sqrt(len(tiles))))
    rows = max(1, math.ceil(len(tiles) / cols))
    w, h = max((t.width for t in tiles), default=1), max((t.height for t in tiles), default=1)
    grid = Image.new("RGB", (cols * w + (cols - 1) * 4, rows * h + (rows - 1) * 4), (255, 255, 255))
    for k, tile in enumerate(tiles):
        grid.paste(tile, ((k % cols) * (w + 4), (k // cols) * (h + 4)))
    return grid
