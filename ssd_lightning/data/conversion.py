"""Own detection data in other layouts (Pascal VOC, YOLO), converted once into the COCO instances JSON that
:class:`~ssd_lightning.data.coco_datamodule.CocoDALIDataModule` reads; everything after that (start-up checks,
DALI pipelines, evaluation, ``task=inspect_data``) is the COCO code path.

A :class:`Converter` (:mod:`.voc`, :mod:`.yolo`) names the files it reads and builds one COCO dict per split.
:func:`convert_once` keys the result on those files' paths, sizes and ``mtime_ns``, the converter's options
and :data:`VERSION`: ``<cache folder>/converted/<format>-<folder name>-<key>/instances_{train,val}.json`` and
``manifest.json`` (the image folders; written last, only when no file changed within
:data:`~.split_cache.RACY_SECONDS` of the conversion). One process at a time (``flock``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from ssd_lightning.data.coco_datamodule import CocoDALIDataModule
from ssd_lightning.data.coco_validation import SWAPS_SIDES, exif_orientation
from ssd_lightning.data.split_cache import RACY_SECONDS, file_lock, writable_cache_dir
from ssd_lightning.errors import ConfigError, DataError
from ssd_lightning.io.atomic import atomic_write_json

__all__ = ["VERSION", "IMAGE_SUFFIXES", "Converter", "ConvertedDataModule", "convert_once", "image_size"]

log = logging.getLogger(__name__)

VERSION = 1  # part of every key: bump when a converter writes anything differently
SPLITS = ("train", "val")
# what DALI decodes (case-insensitive: exports have .JPG)
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp"})


class Converter(Protocol):
    """One dataset in another layout: what :func:`convert_once` needs of it."""

    format: str  # "voc" | "yolo": the config name and the cache entry's prefix
    root: Path

    def sources(self) -> list[Path]: ...  # every file whose change must re-convert (raises on a bad layout)

    def options(self) -> dict[str, Any]: ...  # the settings that change the result: part of the key

    def convert(self) -> dict[str, tuple[Path, dict[str, Any]]]: ...  # {split: (image folder, COCO dict)}


def image_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` of an image as viewers show it (EXIF-turned), read from its header only."""
    found = exif_orientation(path)
    if found is None:
        raise DataError(f"cannot read the image {path} (missing, or not an image PIL can open)")
    orientation, (width, height) = found
    return (height, width) if orientation in SWAPS_SIDES else (width, height)


def coco_dict(
    images: list[dict[str, Any]], annotations: list[dict[str, Any]], names: dict[int, str]
) -> dict[str, Any]:
    """A complete COCO instances dict (``id``, ``area``, ``iscrowd`` filled in: no normalised copy needed)."""
    for i, ann in enumerate(annotations, 1):
        ann.setdefault("iscrowd", 0)
        ann["id"] = i
        ann["area"] = ann["bbox"][2] * ann["bbox"][3]
    return {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": cid, "name": name, "supercategory": "none"} for cid, name in names.items()],
    }


def _identity(files: Iterable[Path]) -> list[list[Any]]:
    try:
        return [[str(path), (st := path.stat()).st_size, st.st_mtime_ns] for path in files]
    except OSError as exc:
        raise DataError(f"cannot read {exc.filename} ({exc.strerror or exc})") from None


def convert_once(
    converter: Converter, cache_dir: str | os.PathLike | None = None
) -> dict[str, tuple[Path, Path]]:
    """``{"train": (image folder, COCO annotation file), "val": ...}``, converted now or earlier."""
    root = converter.root.resolve()
    folder = writable_cache_dir(cache_dir)
    if folder is None:
        raise DataError(
            f"no writable cache folder for the COCO copy of {root} (data.cache_dir, $SSD_LIGHTNING_CACHE_DIR)"
        )
    started = time.time()
    before = _identity(converter.sources())
    key_text = json.dumps([VERSION, converter.format, str(root), converter.options(), before])
    key = hashlib.sha1(key_text.encode()).hexdigest()[:16]
    safe_name = re.sub(r"[^\w.-]", "_", root.name) or "root"
    entry = folder / "converted" / f"{converter.format}-{safe_name}-{key}"
    manifest = entry / "manifest.json"
    entry.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(entry.parent / f"{entry.name}.lock", f"converting {root}"):  # root names have dots
        try:
            found = json.loads(manifest.read_text(encoding="utf-8"))
            return {s: (Path(found[s]), entry / f"instances_{s}.json") for s in SPLITS}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not converted yet (or an unreadable entry): convert
        log.info("converting the %s dataset %s to COCO annotations in %s", converter.format, root, entry)
        splits = converter.convert()
        out = {s: (d, atomic_write_json(entry / f"instances_{s}.json", c)) for s, (d, c) in splits.items()}
        newest = max((mtime for _, _, mtime in before), default=0) / 1e9
        if _identity(converter.sources()) == before and started - newest >= RACY_SECONDS:
            atomic_write_json(manifest, {s: str(out[s][0]) for s in SPLITS})
        else:
            log.info("not keeping the conversion of %s: its files changed recently", root)
        return out


class ConvertedDataModule(CocoDALIDataModule):
    """:class:`CocoDALIDataModule` over the COCO copy :func:`convert_once` makes (at construction) of
    ``converter``'s dataset; the layout gives the four path arguments (passing one is a ConfigError)."""

    def __init__(
        self, converter: Converter, *, cache_dir: str | os.PathLike | None = None, **kwargs: Any
    ) -> None:
        for key in ("train_images", "val_images", "train_annotations", "val_annotations"):
            if (value := kwargs.pop(key, None)) is not None:
                raise ConfigError(
                    f"data.{key}={value} is not used by data={converter.format}: the {converter.format} "
                    "layout under data.root says where images and annotations are (docs/own_data.md)"
                )
        splits = convert_once(converter, cache_dir)
        paths = {f"{s}_{k}": splits[s][i] for i, k in enumerate(("images", "annotations")) for s in SPLITS}
        super().__init__(converter.root, **paths, cache_dir=cache_dir, **kwargs)
