"""Pascal VOC detection data (``data=voc``): ``<root>/Annotations/<id>.xml``, ``<root>/JPEGImages/``,
``<root>/ImageSets/Main/{train,val}.txt``, converted once into COCO annotations (:mod:`.conversion`).

Each listed id needs ``Annotations/<id>.xml`` and an image in ``JPEGImages/`` (the xml's ``<filename>``, else
``<id>`` with any image suffix). Sizes come from the xml's ``<size>``, else the image header. ``difficult``
objects become ``iscrowd=1``: ignored by the evaluation (as VOC's) and not trained on
(``include_crowd=False``). Classes: the sorted ``<name>``s of both splits, or ``classes`` (that order). Only
``filename``, ``size`` and ``object/{name,difficult,bndbox}`` are read. Errors name ``file:line``.
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any
from xml.parsers import expat

from ssd_lightning.data.conversion import IMAGE_SUFFIXES, ConvertedDataModule, coco_dict, image_size
from ssd_lightning.errors import ConfigError, DataError, MissingDataError

__all__ = ["VOCConverter", "VOCDALIDataModule", "voc_box_to_coco"]

_CORNERS = ("xmin", "ymin", "xmax", "ymax")


def voc_box_to_coco(xmin: float, ymin: float, xmax: float, ymax: float) -> list[float]:
    """A VOC ``bndbox`` as COCO ``[x, y, w, h]``: VOC corners are 1-based and inclusive (``xmin=1, xmax=W`` is
    the whole width), COCO's pixel ``i`` covers ``[i, i + 1)``, so the box spans ``[xmin - 1, xmax]``. As
    detectron2's ``load_voc_instances``; mmdetection subtracts 1 from all four (boxes 1 px smaller)."""
    return [xmin - 1.0, ymin - 1.0, xmax - xmin + 1.0, ymax - ymin + 1.0]


def _read_xml(path: Path) -> tuple[ET.Element, dict[ET.Element, int]]:
    """The parsed file and the line each element starts on."""
    parser, builder, lines = expat.ParserCreate(), ET.TreeBuilder(), {}

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
        main = self.root / "ImageSets" / "Main"
        self.lists = {"train": main / f"{train_split}.txt", "val": main / f"{val_split}.txt"}
        self.classes = None if classes is None else [str(c) for c in classes]
        if self.classes is not None and (not self.classes or len(set(self.classes)) != len(self.classes)):
            raise ConfigError(f"data.classes must be distinct class names, got {self.classes}")

    def options(self) -> dict[str, Any]:
        return {"lists": {s: str(p) for s, p in self.lists.items()}, "classes": self.classes}

    @cached_property
    def _ids(self) -> dict[str, list[tuple[str, int]]]:
        """Per split, the listed ids with their line in the list file (what the folders must hold)."""
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
        return listed

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
        listed = self._ids  # checks the folders first
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
            for split, ids in self._ids.items()
        }
        classes = self.classes or sorted(
            {obj["name"] for split in parsed.values() for _, objs in split for obj in objs}
        )
        if not classes:
            raise DataError(f"no <object> in any annotation file under {self.root / 'Annotations'}")
        category = {name: i for i, name in enumerate(classes, 1)}
        out = {}
        for split, images in parsed.items():
            annotations = []
            for image_id, (_, objects) in enumerate(images, 1):
                for obj in objects:
                    if obj["name"] not in category:
                        raise DataError(
                            f"{obj['where']}: class {obj['name']!r} is not in data.classes {classes} (add "
                            "it, or leave data.classes out to take the names the files use)"
                        )
                    box = {"bbox": obj["bbox"], "iscrowd": int(obj["difficult"])}
                    annotations.append({"image_id": image_id, "category_id": category[obj["name"]], **box})
            entries = [{"id": i, **image} for i, (image, _) in enumerate(images, 1)]
            out[split] = (image_dir, coco_dict(entries, annotations, dict(enumerate(classes, 1))))
        return out

    def _read(self, image_id: str, line: int, split: str, names: set[str], by_stem: dict[str, str]) -> tuple:
        """``({"file_name", "width", "height"}, [{"name", "bbox", "difficult", "where"} per object])``."""
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
        return {"file_name": file_name, "width": int(width), "height": int(height)}, objects


class VOCDALIDataModule(ConvertedDataModule):
    """SSD300 data from a Pascal VOC folder (e.g. ``VOCdevkit/VOC2007``), read through its COCO copy:
    ``train_split``/``val_split`` name ``ImageSets/Main/<name>.txt`` (VOC 2007: ``trainval``, ``test``);
    ``classes``: label order (default: the sorted names the files use); ``include_crowd``: also train on
    ``difficult`` objects; the rest are :class:`~.coco_datamodule.CocoDALIDataModule`'s."""

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
