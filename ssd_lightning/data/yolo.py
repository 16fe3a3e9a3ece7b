"""YOLO (ultralytics) detection data (``data=yolo``): ``<root>/data.yaml`` and one label file per image,
converted once into COCO annotations (:mod:`.conversion`).

``data.yaml`` has ``names`` (a list, or ``{index: name}``: the category ids) and ``train``/``val``: image
folders (recursive) or ``.txt`` image lists, relative to ``path`` (relative to ``data.root``; where missing,
``data.root``); a missing ``../x`` is tried as ``x`` (Roboflow). Labels: :func:`label_path`; a row is
``class cx cy w h`` (normalised to the EXIF-turned image) or a polygon ``class x1 y1 x2 y2 ...`` (its box); no
or an empty label file means no objects. Boxes may reach :data:`TOLERANCE` outside [0, 1] (clipped); anything
else wrong is a :class:`~ssd_lightning.errors.DataError` naming ``file:line``.
"""

from __future__ import annotations

import logging
import math
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from ssd_lightning.data.conversion import IMAGE_SUFFIXES, ConvertedDataModule, coco_dict, image_size
from ssd_lightning.errors import DataError, MissingDataError

__all__ = ["TOLERANCE", "YOLOConverter", "YOLODALIDataModule", "label_path"]

log = logging.getLogger(__name__)

TOLERANCE = 1e-3  # normalised units a box corner may lie outside [0, 1] (clipped): 0.6 px of a 640 px image


def label_path(image: Path) -> Path:
    """Where ultralytics looks for ``image``'s labels: the last ``/images/`` replaced by ``/labels/``."""
    images, labels = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return Path(labels.join(str(image).rsplit(images, 1))).with_suffix(".txt")


def _class_names(names: Any, where: Path) -> dict[int, str]:
    if isinstance(names, list):
        names = dict(enumerate(names))
    if not isinstance(names, dict) or not names:
        raise DataError(f"{where}: 'names' must be a list of class names or {{index: name}}, got {names!r}")
    out = {}
    for index, name in names.items():
        try:
            out[int(index)] = str(name)
        except (TypeError, ValueError):
            raise DataError(f"{where}: 'names' key {index!r} is not a class index") from None
    return dict(sorted(out.items()))


class YOLOConverter:
    """The YOLO dataset of ``<root>/<data_yaml>``: its ``train`` and ``val`` images, as COCO dicts."""

    format = "yolo"

    def __init__(self, root: str | os.PathLike, *, data_yaml: str = "data.yaml") -> None:
        self.root = Path(root).absolute()  # label_path needs the "/images/" of a relative root too
        self.data_yaml = self.root / data_yaml

    def options(self) -> dict[str, Any]:
        return {"data_yaml": str(self.data_yaml), "tolerance": TOLERANCE}

    @cached_property
    def _dataset(self) -> tuple[dict[int, str], dict[str, list[Path]]]:
        """``names`` and, per split, the image files (sorted)."""
        if not self.data_yaml.is_file():
            where = f"no {self.data_yaml.name} in it" if self.root.is_dir() else "the folder does not exist"
            raise MissingDataError(
                f"no YOLO dataset at {self.root} (data.root): {where}; data=yolo reads {self.data_yaml}"
            )
        try:
            config = yaml.safe_load(self.data_yaml.read_text(encoding="utf-8-sig"))
        except yaml.YAMLError as exc:
            at = f":{mark.line + 1}" if (mark := getattr(exc, "problem_mark", None)) is not None else ""
            raise DataError(
                f"{self.data_yaml}{at}: not valid YAML ({getattr(exc, 'problem', exc)})"
            ) from None
        if not isinstance(config, dict) or "names" not in config:
            raise DataError(f"{self.data_yaml}: needs 'names' (the class names), 'train' and 'val'")
        names = _class_names(config["names"], self.data_yaml)
        if "nc" in config and config["nc"] != len(names):
            raise DataError(f"{self.data_yaml}: nc is {config['nc']}, but 'names' has {len(names)} names")
        base = self._base(config.get("path"))
        return names, {split: self._split_images(config, split, base) for split in ("train", "val")}

    def _base(self, path: Any) -> Path:
        """``path`` (relative to ``data.root``), else ``data.root`` (also where ``path`` does not exist here:
        ultralytics' ``path: coco8`` under its datasets folder, a path on the exporting machine)."""
        if not path:
            return self.root
        base = self.root / str(path)
        if base.is_dir():
            return base
        log.warning(
            f"{self.data_yaml}: path: {path} is {base}, which does not exist here; reading train and val "
            f"relative to data.root ({self.root})"
        )
        return self.root

    def _split_images(self, config: dict, split: str, base: Path) -> list[Path]:
        entries = config.get(split)
        if not entries:
            raise DataError(
                f"{self.data_yaml}: no '{split}' entry (an image folder or list file under {base})"
            )
        found: set[Path] = set()
        for entry in entries if isinstance(entries, list) else [entries]:
            where = base / str(entry)
            if not where.exists() and str(entry).startswith("../"):
                where = base / str(entry)[3:]
            if where.is_dir():
                found.update(
                    p for p in where.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
                )
            elif where.is_file():
                found.update(self._list_file(where))
            else:
                raise MissingDataError(f"{self.data_yaml}: {split}: {entry} is {where}, which does not exist")
        if not found:
            raise DataError(
                f"{self.data_yaml}: {split}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {entries}"
            )
        return sorted(found)

    @staticmethod
    def _list_file(path: Path) -> list[Path]:
        images = []
        for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
            if line.strip():
                image = path.parent / line.strip()
                if not image.is_file():
                    raise DataError(f"{path}:{n}: image {image} does not exist")
                images.append(image)
        return images

    def sources(self) -> list[Path]:
        files = [self.data_yaml]
        for images in self._dataset[1].values():
            files += [*images, *(label for label in map(label_path, images) if label.is_file())]
        return files

    def convert(self) -> dict[str, tuple[Path, dict[str, Any]]]:
        names, images = self._dataset
        out = {}
        for split, paths in images.items():
            image_dir = Path(os.path.commonpath([p.parent for p in paths]))
            # no label file at all: labels not where ultralytics looks; some missing: images without objects
            missing = [image for image in paths if not label_path(image).is_file()]
            if len(missing) == len(paths):
                raise DataError(
                    f"{self.data_yaml}: {split}: none of its {len(paths)} images has a label file; the "
                    f"first one's would be {label_path(paths[0])} (the last /images/ of the image's path "
                    "replaced by /labels/, .txt)"
                )
            if missing:
                log.warning(
                    f"{self.data_yaml}: {len(missing)} of {len(paths)} {split} images have no label file "
                    f"(images without objects), e.g. {label_path(missing[0])}"
                )
            entries, annotations = [], []
            for image_id, path in enumerate(paths, 1):
                width, height = image_size(path)
                name = path.relative_to(image_dir).as_posix()
                entries.append({"id": image_id, "file_name": name, "width": width, "height": height})
                label = label_path(path)
                if label.is_file():
                    for category_id, (x1, y1, x2, y2) in _read_labels(label, names):
                        bbox = [x1 * width, y1 * height, (x2 - x1) * width, (y2 - y1) * height]
                        annotations.append({"image_id": image_id, "category_id": category_id, "bbox": bbox})
            out[split] = (image_dir, coco_dict(entries, annotations, names))
        return out


def _read_labels(path: Path, names: dict[int, str]) -> list[tuple[int, tuple[float, float, float, float]]]:
    """``(class index, (x1, y1, x2, y2) normalised and clipped to [0, 1])`` of each row of a label file."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read the label file {path} ({exc})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        where = f"{path}:{n}"
        try:
            values = [float(v) for v in fields]
        except ValueError:
            values = []
        is_box, is_polygon = len(values) == 5, len(values) >= 7 and len(values) % 2 == 1
        if not (is_box or is_polygon) or not all(math.isfinite(v) for v in values):
            raise DataError(
                f"{where}: expected 'class cx cy w h' (5 numbers) or a polygon 'class x1 y1 x2 y2 ...', "
                f"got {line.strip()!r}"
            )
        index = values[0]
        if not index.is_integer() or int(index) not in names:
            raise DataError(
                f"{where}: class index {fields[0]} is not in data.yaml's names "
                f"({min(names)}..{max(names)}: {', '.join(names.values())})"
            )
        if is_box:
            cx, cy, w, h = values[1:]
            x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
        else:
            xs, ys = values[1::2], values[2::2]
            x1, y1, x2, y2 = min(xs), min(ys), max(xs), max(ys)
        if x2 < x1 or y2 < y1:
            raise DataError(f"{where}: box {' '.join(fields[1:])} has a negative width or height")
        if min(x1, y1) < -TOLERANCE or max(x2, y2) > 1 + TOLERANCE:
            raise DataError(
                f"{where}: box {' '.join(fields[1:5]) if is_box else '(polygon)'} reaches outside the image "
                f"(x {x1:.4g}..{x2:.4g}, y {y1:.4g}..{y2:.4g}; YOLO coordinates are normalised to [0, 1], "
                f"{TOLERANCE:g} of rounding tolerated)"
            )
        rows.append((int(index), tuple(min(max(v, 0.0), 1.0) for v in (x1, y1, x2, y2))))
    return rows


class YOLODALIDataModule(ConvertedDataModule):
    """SSD300 data from the YOLO dataset ``root/data_yaml`` through its COCO copy (+ CocoDALIDataModule's)."""

    def __init__(self, root: str | os.PathLike, *, data_yaml: str = "data.yaml", **kwargs: Any) -> None:
        super().__init__(YOLOConverter(root, data_yaml=data_yaml), **kwargs)
