"""The one place that maps a dataset's category ids to contiguous training labels and back.

Labels are ``1..K`` (``0``: background) in the order of the annotation file's ``categories`` list (not by
id): the rule of DALI's ``fn.readers.coco`` remapping (``avoid_class_remapping=False``; tests pin that both
agree). Categories that no annotation uses still get a label, as in DALI.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from ssd_lightning.errors import DataError

__all__ = ["COCO_CATEGORY_IDS", "COCO_CLASS_NAMES", "CategoryMap"]

#: The 80 COCO detection categories, label k (1..80) at index k, "background" at 0: the order of the
#: ``categories`` list of instances_val2017.json (ascending id), which is the NVIDIA reference's label order.
COCO_CLASS_NAMES: tuple[str, ...] = (
    "background",
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard",
    "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase",
    "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
#: COCO category id of label k at index k - 1 (ids 1..90 with gaps).
COCO_CATEGORY_IDS: tuple[int, ...] = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 27, 28, 31, 32,
    33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59,
    60, 61, 62, 63, 64, 65, 67, 70, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 84, 85, 86, 87, 88, 89, 90,
)  # fmt: skip

_T = TypeVar("_T", int, Tensor, np.ndarray)


@dataclass(frozen=True)
class CategoryMap:
    """Dataset category ids <-> contiguous labels (0 = background)."""

    category_ids: tuple[int, ...]  # dataset category id of label k at index k - 1 (annotation-file order)
    names: tuple[str, ...]  # class name of label k at index k; names[0] == "background"

    def __post_init__(self) -> None:
        if len(self.names) != len(self.category_ids) + 1:
            raise ValueError(
                f"names needs one entry per category plus 'background' at index 0: got {len(self.names)} "
                f"names for {len(self.category_ids)} categories"
            )
        if len(set(self.category_ids)) != len(self.category_ids):
            raise ValueError(f"category_ids must be unique, got {list(self.category_ids)}")

    @classmethod
    def from_coco(
        cls, source: str | os.PathLike | Mapping[str, Any], *, where: str | None = None
    ) -> CategoryMap:
        """From a COCO annotation file (path) or its parsed dict (only ``categories`` is read); ``where``
        names the source in error messages (default: the path, or "the annotation dict")."""
        if isinstance(source, Mapping):
            data, where = source, where or "the annotation dict"
        else:
            where = where or os.fspath(source)
            data = json.loads(Path(source).read_text(encoding="utf-8"))
        cats = data.get("categories") if isinstance(data, Mapping) else None
        if not isinstance(cats, list) or not cats:
            raise DataError(f"{where}: 'categories' must be a non-empty list of {{'id', 'name'}} dicts")
        ids, names = [], ["background"]
        for cat in cats:
            cat_id = cat.get("id") if isinstance(cat, Mapping) else None
            if not isinstance(cat_id, int) or isinstance(cat_id, bool):
                raise DataError(
                    f"{where}: every category needs an integer 'id' (0 is fine; the annotations' "
                    f"'category_id' refers to it), got {cat!r}"
                )
            ids.append(int(cat["id"]))
            names.append(str(cat.get("name", cat["id"])))
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise DataError(f"{where}: duplicate category ids {dup}; each category needs a unique id")
        return cls(tuple(ids), tuple(names))

    @classmethod
    def from_names(cls, names: Sequence[str]) -> CategoryMap:
        """Categories ``1..K`` named ``names`` (category id == label), for data without dataset ids."""
        return cls(tuple(range(1, len(names) + 1)), ("background", *names))

    @classmethod
    def coco(cls) -> CategoryMap:
        """COCO 2017 detection: :data:`COCO_CATEGORY_IDS` named :data:`COCO_CLASS_NAMES` (81 classes)."""
        return cls(COCO_CATEGORY_IDS, COCO_CLASS_NAMES)

    @property
    def num_classes(self) -> int:
        """K + 1 (includes background)."""
        return len(self.category_ids) + 1

    def label_to_category_id(self, labels: _T) -> _T:
        """Contiguous labels (1..K) -> dataset category ids; int, int64 tensor or numpy array in, same out."""
        table = np.asarray(self.category_ids, dtype=np.int64)
        return self._lookup(labels, table, offset=1, what="label", valid=f"1..{len(table)}")

    def category_id_to_label(self, category_ids: _T) -> _T:
        """Dataset category ids -> contiguous labels (1..K); same types as :meth:`label_to_category_id`."""
        min_id, max_id = min(min(self.category_ids), 0), max(self.category_ids)
        table = np.full(max_id - min_id + 1, -1, dtype=np.int64)
        table[np.asarray(self.category_ids) - min_id] = np.arange(1, len(self.category_ids) + 1)
        return self._lookup(category_ids, table, offset=min_id, what="category id", valid=self.category_ids)

    @staticmethod
    def _lookup(values: _T, table: np.ndarray, *, offset: int, what: str, valid: object) -> _T:
        is_tensor = isinstance(values, Tensor)
        arr = values.long() if is_tensor else np.asarray(values, dtype=np.int64)
        if is_tensor:
            table = torch.as_tensor(table, device=values.device)
        idx = arr - offset
        out = table[idx.clip(0, len(table) - 1)]
        bad = (idx < 0) | (idx >= len(table)) | (out < 0)
        if bad.any():
            unknown = values[bad].unique() if is_tensor else np.unique(arr[bad])
            raise ValueError(f"unknown {what}(s) {unknown.tolist()}; valid: {valid}")
        return out if is_tensor or isinstance(values, np.ndarray) else int(out)
