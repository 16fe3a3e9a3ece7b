"""COCO-layout detection data for SSD300 through DALI, as a LightningDataModule."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.data.coco_validation import CocoSplitInfo, check_coco_split, check_mode_args
from ssd_lightning.data.dali_datamodule import DALIDataModule, decode_error_reporter
from ssd_lightning.data.dali_iterator import DALILoader
from ssd_lightning.data.dali_pipelines import coco_train_pipeline, coco_val_pipeline
from ssd_lightning.errors import DataError, MissingDataError

__all__ = ["CocoDALIDataModule"]


class CocoDALIDataModule(DALIDataModule):
    """SSD300 data from a COCO-layout directory, decoded and augmented by DALI.

    Paths default to ``<root>/train2017``, ``<root>/val2017``,
    ``<root>/annotations/instances_{train,val}2017.json``. ``image_size``: 300 (SSD300's default boxes).
    ``shuffle``: global reshuffle every epoch, else a fixed order per shard. ``augment``: the reference
    augmentation (False: decode + resize only). ``include_crowd``: ``iscrowd=1`` boxes as ordinary ones (as
    the reference). ``check_files``: every listed image exists and looks like an image, in ``setup()``.
    ``train_image_ids``: ``"image_ids"`` (N,) int64 in training batches (tests, checking a resumed run).
    ``cache_dir``: where the annotation check's results (and normalised or clipped annotation copies) are
    kept, one check per machine for an unchanged split (default ``$XDG_CACHE_HOME/ssd_lightning``).
    ``val_skip_empty``: validate only annotated images as NVIDIA does (4,952 of val 2017's 5,000); the default
    is the official protocol (detections on empty images count as false positives). ``exif_check``,
    ``size_check`` (``"error"``, ``"warn"``, ``"off"``): EXIF-rotated images whose boxes cannot line up with
    what this DALI line decodes; images listed with another size than their file's ("warn" for images resized
    proportionally after labelling); see :func:`~ssd_lightning.data.coco_validation.check_coco_split`.
    ``**kwargs``: ``batch_size`` (per device) and the rest of :class:`.dali_datamodule.DALIDataModule`.

    Batches: training ``{"images" (N, 3, S, S), "boxes" (N, 8732, 4) float32 (cx, cy, w, h) in [0, 1],
    "labels" (N, 8732) int64}`` (incomplete last batch per rank dropped, images without boxes skipped);
    validation ``{"images", "image_ids" (N,) int64, "image_sizes" (N, 2) int64 original (height, width)}``,
    every image once across ranks. Labelling tools' exports work as written (category ids from 0, subfolders,
    PNGs, no ``iscrowd``/``area``/``id``, string image ids: read through a normalised copy whose image ids
    ``1..N`` the batches and :attr:`val_annotation_file` share; :mod:`ssd_lightning.data.coco_validation`).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        train_images: str | os.PathLike | None = None,
        val_images: str | os.PathLike | None = None,
        train_annotations: str | os.PathLike | None = None,
        val_annotations: str | os.PathLike | None = None,
        image_size: int = 300,
        shuffle: bool = True,
        augment: bool = True,
        include_crowd: bool = True,
        check_files: bool = True,
        train_image_ids: bool = False,
        cache_dir: str | os.PathLike | None = None,
        val_skip_empty: bool = False,
        exif_check: str = "error",
        size_check: str = "error",
        **kwargs: Any,
    ) -> None:
        super().__init__(image_size=image_size, **kwargs)
        check_mode_args(exif_check=exif_check, size_check=size_check)  # fails before anything is read
        if image_size != 300:
            # box_encoder's anchors are dboxes300_coco(), in relative units; other sizes need other anchors
            raise ValueError(f"image_size must be 300 (SSD300 default boxes), got {image_size}")
        self.root = Path(root)
        self.train_images = Path(train_images or self.root / "train2017")
        self.val_images = Path(val_images or self.root / "val2017")
        self.train_annotations = Path(train_annotations or self.root / "annotations/instances_train2017.json")
        self.val_annotations = Path(val_annotations or self.root / "annotations/instances_val2017.json")
        self.shuffle, self.augment, self.include_crowd = shuffle, augment, include_crowd
        self.check_files, self.train_image_ids, self.cache_dir = check_files, train_image_ids, cache_dir
        self.val_skip_empty, self.exif_check, self.size_check = val_skip_empty, exif_check, size_check
        self._splits: dict[str, CocoSplitInfo] = {}
        self._category_map: CategoryMap | None = None
        self._anchors: list[float] | None = None

    @property
    def val_annotation_file(self) -> Path:
        """The COCO evaluation's ground truth: ``val_annotations``, or its normalised copy (whose image ids
        the batches carry) where the export lacked COCO fields or integer image ids (``check_coco_split``)."""
        if "val" not in self._splits and self.val_annotations.is_file() and self.val_images.is_dir():
            self._split("val")  # checked (and cached) once; setup() reuses it
        info = self._splits.get("val")
        return self.val_annotations if info is None else info.evaluation_annotation_file

    @property
    def category_map(self) -> CategoryMap:
        """Contiguous labels <-> category ids, in the annotation file's category order (DALI's order)."""
        if self._category_map is None:
            split = "val" if self.val_annotations.is_file() else "train"
            images, ann = self._paths(split)
            if not ann.is_file():
                raise MissingDataError(
                    f"no annotation file at {self.val_annotations} or {self.train_annotations}; "
                    "the category map needs one (generate/download the dataset first)"
                )
            if images.is_dir():  # check the split (cached): sets _category_map, and setup() reuses it
                self._split(split)
            else:  # annotations without images (e.g. reading class names only)
                self._category_map = CategoryMap.from_coco(ann)
        return self._category_map

    @property
    def num_classes(self) -> int:
        """K + 1 (includes background)."""
        return self.category_map.num_classes

    def _paths(self, split: Literal["train", "val"]) -> tuple[Path, Path]:  # (image folder, annotation file)
        if split == "train":
            return self.train_images, self.train_annotations
        return self.val_images, self.val_annotations

    def check_split(self, split: Literal["train", "val"]) -> CocoSplitInfo:
        """:func:`~ssd_lightning.data.coco_validation.check_coco_split` of one split with this datamodule's
        settings (cached per machine, not kept here; the loaders use :meth:`_split`)."""
        return check_coco_split(
            *self._paths(split),
            check_files=self.check_files,
            cache_dir=self.cache_dir,
            exif_check=self.exif_check,
            size_check=self.size_check,
        )

    def _split(self, split: Literal["train", "val"]) -> CocoSplitInfo:
        if split not in self._splits:
            info = self.check_split(split)
            other = self._splits.get("val" if split == "train" else "train")
            if other is not None and other.category_map.category_ids != info.category_map.category_ids:
                raise DataError(
                    f"{self.train_annotations} and {self.val_annotations} list different categories (or the "
                    "same in a different order); DALI numbers labels by that order, so they must agree"
                )
            if self._category_map is None:
                self._category_map = info.category_map
            self._splits[split] = info
        return self._splits[split]

    def make_loader(
        self, split: str, *, shard_id: int = 0, num_shards: int = 1, with_image_ids: bool | None = None
    ) -> DALILoader:
        """The loader of ``"train"`` or ``"val"`` for one shard; ``with_image_ids`` adds ``"image_ids"`` to
        training batches (default: ``train_image_ids``)."""
        info = self._split(split)
        common = dict(shard_id=shard_id, num_shards=num_shards, on_error=_error_reporter(info, split))
        common.update(file_root=str(info.image_dir), annotations_file=str(info.reader_annotation_file))
        if split != "train":
            names = ["images", "image_ids", "image_sizes"]
            return self._loader(split, coco_val_pipeline, names, **common, skip_empty=self.val_skip_empty)
        with_image_ids = self.train_image_ids if with_image_ids is None else with_image_ids
        if self._anchors is None:
            from ssd_lightning.models import dboxes300_coco

            self._anchors = dboxes300_coco().ltrb.flatten().tolist()
        names = ["images", "boxes", "labels"] + (["image_ids"] if with_image_ids else [])
        return self._loader(
            split,
            coco_train_pipeline,
            names,
            **common,
            anchors_ltrb=self._anchors,
            shuffle=self.shuffle,
            shuffle_seed=self.seed,
            augment=self.augment,
            include_crowd=self.include_crowd,
            output_image_ids=with_image_ids,
        )


# what DALI's readers.coco says when it cannot parse the annotation file (JSON syntax, field types, bbox)
_PARSE_ERROR = re.compile(r"Invalid COCO annotation|JSON")


def _error_reporter(info: CocoSplitInfo, split: str) -> Callable[[Exception], Exception]:
    """``on_error`` for the COCO loaders: a failure of DALI's annotation parser becomes a DataError naming the
    annotation file; anything else goes to :func:`decode_error_reporter` (which names undecodable images)."""
    other = decode_error_reporter(lambda: _listed_files(info), f"{split} images in {info.image_dir}")

    def report(exc: Exception) -> Exception:
        # DALI: "Critical error ...\nError in CPU operator `...readers.coco`, ... encountered:\n\nInvalid COCO
        # annotation: ..." (ValueError or RuntimeError): the parser's own line is the one to show
        said = next((line for line in str(exc).splitlines() if _PARSE_ERROR.search(line)), None)
        if said is not None:
            first = said.strip().rstrip(".")
            copy = info.reader_annotation_file
            via = "" if copy == info.annotation_file else f" (read through its checked copy {copy})"
            return DataError(
                f"DALI could not parse the annotation file {info.annotation_file}{via}: {first}. Check its "
                "entries (COCO: 'bbox' is 4 numbers [x, y, w, h]; ids, width and height are integers)"
            )
        return other(exc)

    return report


def _listed_files(info: CocoSplitInfo) -> list[Path]:
    images = json.loads(Path(info.annotation_file).read_text(encoding="utf-8"))["images"]
    return [info.image_dir / img["file_name"] for img in images]
