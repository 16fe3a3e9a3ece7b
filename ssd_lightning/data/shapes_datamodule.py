"""The demos' data: the DALI datamodules over generated shapes datasets, made on first use."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ssd_lightning.data.coco_datamodule import CocoDALIDataModule
from ssd_lightning.data.imagefolder_datamodule import ImageFolderDALIDataModule
from ssd_lightning.data.shapes import (
    DEFAULT_MAX_SCALE,
    DEFAULT_MIN_SCALE,
    MAX_OBJECTS,
    check_max_objects,
    ensure_classification_dataset,
    ensure_detection_dataset,
    resolve_categories,
)


class ShapesDataModule(CocoDALIDataModule):
    """:class:`CocoDALIDataModule` reading ``root``, which is generated there (in COCO's own layout, so
    everything downstream is real COCO's code path) if missing, once, by Lightning's ``prepare_data``.

    ``min_scale``/``max_scale``: the shapes' extent as fractions of the image's short side. ``categories``:
    names from :data:`~ssd_lightning.data.shapes.SHAPE_CATALOGUE` (``None``: the demo's four); another set
    needs another ``root`` (by convention ``<data dir>/shapes_<names>``; one holding another set is an
    error) and ``num_classes`` = its size + 1. ``max_objects_train`` (1-9): the most shapes in a training
    image (the val split keeps 1-6).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        num_train: int = 2000,
        num_val: int = 200,
        dataset_seed: int = 0,
        min_scale: float = DEFAULT_MIN_SCALE,
        max_scale: float = DEFAULT_MAX_SCALE,
        categories: Sequence[str] | None = None,
        max_objects_train: int = MAX_OBJECTS,
        **kwargs,
    ) -> None:
        categories = None if categories is None else resolve_categories(categories)  # fail at config time
        check_max_objects(max_objects_train)
        super().__init__(root, **kwargs)
        self.dataset_kwargs = dict(
            num_train=num_train,
            num_val=num_val,
            seed=dataset_seed,
            min_scale=min_scale,
            max_scale=max_scale,
            categories=categories,
            max_objects_train=max_objects_train,
        )

    def prepare_data(self) -> None:
        ensure_detection_dataset(self.root, **self.dataset_kwargs)


class ShapesClassificationDataModule(ImageFolderDALIDataModule):
    """:class:`ImageFolderDALIDataModule` reading ``root``, which is generated there if missing."""

    def __init__(
        self,
        root: str | Path,
        *,
        num_train_per_class: int = 300,
        num_val_per_class: int = 50,
        dataset_seed: int = 0,
        dataset_image_size: int = 96,
        **kwargs,
    ) -> None:
        super().__init__(root, **kwargs)
        self.dataset_kwargs = dict(
            num_train_per_class=num_train_per_class,
            num_val_per_class=num_val_per_class,
            seed=dataset_seed,
            image_size=dataset_image_size,
        )

    def prepare_data(self) -> None:
        ensure_classification_dataset(self.root, **self.dataset_kwargs)
