"""Pascal VOC detection data (``data=voc``): ``<root>/Annotations/<id>.xml``, ``<root>/JPEGImages/``,
``<root>/ImageSets/Main/{train,val}.txt``, converted once into COCO annotations (:mod:`.conversion`).

Policy: each listed id needs ``Annotations/<id>.xml`` and an image in ``JPEGImages/`` (the xml's
``<filename>``, else ``<id>`` with any image suffix, case-insensitive). Width and height come from the xml's
``<size>`` (what the boxes were drawn on), from the image header where it is missing or 0. ``difficult``
objects are written as COCO ``iscrowd=1``: the COCO evaluation ignores detections on them (as VOC's does)
and :class:`VOCDALIDataModule` does not train on them (``include_crowd=False``). Class names are the
sorted set of ``<name>``s found in both splits, or ``classes`` (that order; another name is an error). Tags
other than ``filename``, ``size``, ``object/name``, ``object/difficult`` and ``object/bndbox`` (``pose``,
``truncated``, ``segmented``, ``part``, ...) are not read. Errors name ``file:line``.
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.parsers import expat

from ssd_lightning.data.conversion import IMAGE_SUFFIXES, ConvertedDataModule, coco_dict, image_size
from ssd_lightning.errors import ConfigError, DataError, MissingDataError

__all__ = ["VOCConverter", "VOCDALIDataModule", "voc_box_to_coco"]

_CORNERS = ("xmin", "ymin", "xmax", "ymax")


def voc_box_to_coco(xmin: float, ymin: float, xmax: float, ymax: float) -> list[float]:
    """A VOC ``bndbox`` as COCO ``[x, y, w, h]``.

    VOC corners are 1-based pixel indices, both inclusive: ``xmin=1, xmax=W`` covers the whole image (the
    devkit's area is ``(xmax - xmin + 1) * (ymax - ymin + 1)``). COCO's coordinates are continuous, pixel
    ``i`` covering ``[i, i + 1)`` from 0, so the box spans ``[xmin - 1, xmax]``:
    ``[xmin - 1, ymin - 1, xmax - xmin + 1, ymax - ymin + 1]``. That is detectron2's ``load_voc_instances``
    (``xmin -= 1``, ``ymin -= 1``); mmdetection's ``pascal_voc.py`` converter subtracts 1 from all four
    corners, which makes its boxes 1 px narrower and lower.
    """
    return [xmin - 1.0, ymin - 1.0, xmax - xmin + 1.0, ymax - ymin + 1.0]


def _read_xml(path: Path) -> tuple[ET.Element, dict[ET.Element, int]]:
    """The parsed file and the line each element starts on."""
    parser = expat.ParserCreate()
    builder = ET.TreeBuilder()
    lines: dict[ET.Element, int] = {}

    def start(tag: str, attrs: dict[str, str]) -> None:
        lines[builder.start(tag, attrs)] = parser.CurrentLineNumber

    parser.StartElementHandler = start
    parser.EndElementHandler = builder.end
    parser.CharacterDataHandler = builder.data
    try:
        with open(path, "rb") as f:
            parser.ParseFile(f)
    except expat.ExpatError as exc:
        raise DataError(f"{path}:{exc.lineno}: not valid XML ({expat.ErrorString(exc.code)})") from None
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror or exc})") from None
    return builder.close(), lines


def _number(element: ET.Element | None) -> float | None:
    try:
        value = float((element.text or "").strip()) if element is not None else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class VOCConverter:
    """The Pascal VOC dataset under ``root``: its ``train_split`` and ``val_split`` lists, as COCO dicts."""

    format = "voc"

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        train_split: str = "train",
        val_split: str = "val",
        classes: Sequence[str] | None = None,
    ) -> None:
        self.root = Path(root).absolute()
        self.lists = {
            "train": self.root / "ImageSets" / "Main" / f"{train_split}.txt",
            "val": self.root / "ImageSets" / "Main" / f"{val_split}.txt",
        }
        self.classes = None if classes is None else [str(c) for c in classes]
        if self.classes is not None and (not self.classes or len(set(self.classes)) != len(self.classes)):
            raise ConfigError(f"data.classes must be distinct class names, got {self.classes}")
        self._listed: dict[str, list[tuple[str, int]]] | None = None

    def options(self) -> dict[str, Any]:
        return {"lists": {s: str(p) for s, p in self.lists.items()}, "classes": self.classes}

    def _ids(self) -> dict[str, list[tuple[str, int]]]:
        """Per split, the listed ids with their line in the list file (what the folders must hold)."""
        if self._listed is None:
            if not self.root.is_dir():
                raise MissingDataError(
                    f"no Pascal VOC dataset at {self.root} (data.root): the folder does not exist"
                )
            for folder in ("Annotations", "JPEGImages"):
                if not (self.root / folder).is_dir():
                    raise MissingDataError(
                        f"{self.root / folder} is missing: data=voc reads {folder}/ under data.root"
                    )
            listed = {}
            for split, list_file in self.lists.items():
                if not list_file.is_file():
                    raise MissingDataError(
                        f"{list_file} is missing: the {split} split lists its image ids there "
                        f"(another list: data.{split}_split=<name of a file in {list_file.parent}>)"
                    )
                lines = list_file.read_text(encoding="utf-8-sig").splitlines()
                # a line is "<id>" (Main/<split>.txt) or "<id> <flag>" (the per-class lists)
                listed[split] = [(line.split()[0], n) for n, line in enumerate(lines, 1) if line.strip()]
                first: dict[str, int] = {}
                for image_id, n in listed[split]:
                    if first.setdefault(image_id, n) != n:
                        again = f"is listed again (first at line {first[image_id]})"
                        raise DataError(f"{list_file}:{n}: image {image_id!r} {again}")
            self._listed = listed
        return self._listed

    def _images_by_stem(self) -> tuple[set[str], dict[str, str]]:
        """The file names in ``JPEGImages/`` and, per stem, the first image among them."""
        names = sorted(os.listdir(self.root / "JPEGImages"))
        by_stem: dict[str, str] = {}
        for name in names:
            stem, suffix = os.path.splitext(name)
            if suffix.lower() in IMAGE_SUFFIXES:
                by_stem.setdefault(stem, name)
        return set(names), by_stem

    def sources(self) -> list[Path]:
        listed = self._ids()  # checks the folders first
        annotations, image_dir = self.root / "Annotations", self.root / "JPEGImages"
        present = set(os.listdir(annotations))
        names, _ = self._images_by_stem()
        # every image: an xml's <filename> may name any of them, and sizes missing from an xml are read there
        files = [*self.lists.values(), *(image_dir / name for name in sorted(names))]
        for split, ids in listed.items():
            for image_id, line in ids:
                if f"{image_id}.xml" not in present:
                    raise DataError(
                        f"{self.lists[split]}:{line}: image {image_id!r} is listed, but "
                        f"{annotations / (image_id + '.xml')} does not exist"
                    )
                files.append(annotations / f"{image_id}.xml")
        return files

    def convert(self) -> dict[str, tuple[Path, dict[str, Any]]]:
        image_dir = self.root / "JPEGImages"
        names, by_stem = self._images_by_stem()
        parsed = {
            split: [self._read(image_id, line, split, names, by_stem) for image_id, line in ids]
            for split, ids in self._ids().items()
        }
        if self.classes is None:
            found = {obj["name"] for split in parsed.values() for image in split for obj in image["objects"]}
            if not found:
                raise DataError(f"no <object> in any annotation file under {self.root / 'Annotations'}")
            classes = sorted(found)
        else:
            classes = self.classes
        category = {name: i for i, name in enumerate(classes, 1)}
        out = {}
        for split, images in parsed.items():
            annotations = []
            for image_id, image in enumerate(images, 1):
                for obj in image["objects"]:
                    if obj["name"] not in category:
                        raise DataError(
                            f"{obj['where']}: class {obj['name']!r} is not in data.classes {classes} (add "
                            "it, or leave data.classes out to take the names the files use)"
                        )
                    box = {"bbox": obj["bbox"], "iscrowd": int(obj["difficult"])}
                    annotations.append({"image_id": image_id, "category_id": category[obj["name"]], **box})
            entries = [
                {"id": i, "file_name": image["file_name"], "width": image["width"], "height": image["height"]}
                for i, image in enumerate(images, 1)
            ]
            out[split] = (image_dir, coco_dict(entries, annotations, {i: n for n, i in category.items()}))
        return out

    def _read(self, image_id: str, line: int, split: str, names: set[str], by_stem: dict[str, str]) -> dict:
        path = self.root / "Annotations" / f"{image_id}.xml"
        tree, lines = _read_xml(path)
        image_dir = self.root / "JPEGImages"
        filename = (tree.findtext("filename") or "").strip()
        if filename and (filename in names or (image_dir / filename).is_file()):
            file_name = filename
        elif image_id in by_stem:
            file_name = by_stem[image_id]
        else:
            named = f"{filename} nor {image_id}.*" if filename else f"{image_id}.*"
            raise DataError(
                f"{self.lists[split]}:{line}: image {image_id!r} is listed, but {image_dir} has no {named}"
            )
        width, height = (_number(tree.find(f"size/{side}")) for side in ("width", "height"))
        if not width or not height or width < 0 or height < 0:
            width, height = image_size(image_dir / file_name)
        objects = []
        for obj in tree.findall("object"):
            where = f"{path}:{lines[obj]}"
            name = (obj.findtext("name") or "").strip()
            if not name:
                raise DataError(f"{where}: <object> without a <name>")
            box = obj.find("bndbox")
            if box is None:
                raise DataError(f"{where}: object {name!r} has no <bndbox>")
            corners = [_number(box.find(tag)) for tag in _CORNERS]
            if None in corners:
                tag = _CORNERS[corners.index(None)]
                element = box.find(tag)  # the line of the element, or of <bndbox> without one
                raise DataError(
                    f"{path}:{lines.get(element, lines[box])}: <{tag}> of object {name!r} must be a number, "
                    f"got {getattr(element, 'text', None)!r}"
                )
            xmin, ymin, xmax, ymax = corners
            if xmax < xmin or ymax < ymin:
                raise DataError(
                    f"{path}:{lines[box]}: object {name!r} has xmax < xmin or ymax < ymin "
                    f"({', '.join(f'{t}={v:g}' for t, v in zip(_CORNERS, corners, strict=True))})"
                )
            difficult = (obj.findtext("difficult") or "0").strip().lower() in ("1", "true")
            box = voc_box_to_coco(xmin, ymin, xmax, ymax)
            objects.append({"name": name, "bbox": box, "difficult": difficult, "where": where})
        return {"file_name": file_name, "width": int(width), "height": int(height), "objects": objects}


class VOCDALIDataModule(ConvertedDataModule):
    """SSD300 data from a Pascal VOC folder (see the module doc), read through its COCO copy.

    Args:
        root: the folder holding ``Annotations/``, ``JPEGImages/`` and ``ImageSets/Main/`` (e.g.
            ``VOCdevkit/VOC2007``).
        train_split, val_split: the list files ``ImageSets/Main/<name>.txt`` of the two splits (VOC 2007:
            ``trainval`` and ``test``).
        classes: class names in label order (default: the sorted names the files use).
        include_crowd: also train on ``difficult`` objects (default False, as VOC).
        kwargs: :class:`~ssd_lightning.data.coco_datamodule.CocoDALIDataModule`'s.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        train_split: str = "train",
        val_split: str = "val",
        classes: Sequence[str] | None = None,
        include_crowd: bool = False,
        **kwargs: Any,
    ) -> None:
        converter = VOCConverter(root, train_split=train_split, val_split=val_split, classes=classes)
        super().__init__(converter, include_crowd=include_crowd, **kwargs)
