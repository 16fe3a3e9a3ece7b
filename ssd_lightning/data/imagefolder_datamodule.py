"""ImageFolder-layout classification data (MobileNetV2) through DALI, as a LightningDataModule."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.data.coco_validation import check_image_headers
from ssd_lightning.data.dali_datamodule import DALIDataModule, decode_error_reporter
from ssd_lightning.data.dali_iterator import DALILoader
from ssd_lightning.data.dali_pipelines import classification_train_pipeline, classification_val_pipeline
from ssd_lightning.errors import DataError, MissingDataError

__all__ = ["ImageFolderDALIDataModule", "list_image_folder"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")


def list_image_folder(directory: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """(sorted class names, [(file, class index)]) of ``directory/<class>/<image>``; class index = position in
    the sorted folder names, as DALI's file reader assigns labels."""
    if not directory.is_dir():
        raise MissingDataError(
            f"image folder {directory} does not exist; expected <root>/train and <root>/val with one "
            "sub-directory per class (or pass train_dir/val_dir)"
        )
    classes = sorted(p.name for p in directory.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"image folder {directory} has no class sub-directories (<class>/<image>.jpg)")
    files = [
        (p, idx)
        for idx, name in enumerate(classes)
        for p in sorted((directory / name).iterdir())
        if p.suffix.lower() in IMAGE_EXTENSIONS
    ]
    if not files:
        raise DataError(f"image folder {directory} has class directories {classes[:5]} but no images in them")
    return classes, files


class ImageFolderDALIDataModule(DALIDataModule):
    """``<root>/train/<class>/*.jpg`` and ``<root>/val/<class>/*.jpg`` decoded and augmented by DALI.

    Class index = position of the folder name in sorted order (``class_names``). Training: random-resized
    crop (area 0.08-1) to ``image_size``, horizontal flip p=0.5, ImageNet normalisation; validation: shorter
    side resized to ``val_resize``, centre crop ``image_size``. Batches: ``{"images" (N, 3, S, S), "labels"
    (N,) int64}``; training drops the incomplete last batch, validation sees every image exactly once.
    ``**kwargs`` (``batch_size`` per device, ...): see :class:`.dali_datamodule.DALIDataModule`.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        train_dir: str | os.PathLike | None = None,
        val_dir: str | os.PathLike | None = None,
        image_size: int = 224,
        val_resize: int = 256,
        shuffle: bool = True,
        check_files: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(image_size=image_size, **kwargs)
        if val_resize < image_size:
            raise ValueError(f"val_resize ({val_resize}) must be >= image_size ({image_size})")
        self.root = Path(root)
        self.train_dir = Path(train_dir) if train_dir else self.root / "train"
        self.val_dir = Path(val_dir) if val_dir else self.root / "val"
        self.val_resize, self.shuffle, self.check_files = val_resize, shuffle, check_files
        self._listing: dict[str, tuple[list[str], list[tuple[Path, int]]]] = {}

    @property
    def class_names(self) -> list[str]:
        """Sorted class folder names of the training split (class index = position)."""
        return self._split("train" if self.train_dir.is_dir() else "val")[0]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def category_map(self) -> CategoryMap:
        """Label k <-> class ``class_names[k]`` (no background: ids equal labels, offset by one)."""
        return CategoryMap.from_names(self.class_names)

    def _split(self, split: str) -> tuple[list[str], list[tuple[Path, int]]]:
        if split not in self._listing:
            directory = self.train_dir if split == "train" else self.val_dir
            classes, files = list_image_folder(directory)
            if self.check_files:
                check_image_headers(p for p, _ in files)
            other = self._listing.get("val" if split == "train" else "train")
            if other is not None and other[0] != classes:
                raise DataError(
                    f"{self.train_dir} and {self.val_dir} have different class folders "
                    f"({other[0][:5]}... vs {classes[:5]}...); class indices would not match"
                )
            self._listing[split] = (classes, files)
        return self._listing[split]

    def make_loader(self, split: str, *, shard_id: int = 0, num_shards: int = 1) -> DALILoader:
        """The loader of ``"train"`` or ``"val"`` for one shard."""
        _, files = self._split(split)
        directory = self.train_dir if split == "train" else self.val_dir
        pipeline, graph_kwargs = (
            (classification_train_pipeline, {"shuffle": self.shuffle, "shuffle_seed": self.seed})
            if split == "train"
            else (classification_val_pipeline, {"resize_size": self.val_resize})
        )
        on_error = decode_error_reporter(lambda: [p for p, _ in files], f"{split} images in {directory}")
        kwargs = dict(shard_id=shard_id, num_shards=num_shards, on_error=on_error, file_root=str(directory))
        return self._loader(split, pipeline, ["images", "labels"], **kwargs, **graph_kwargs)
