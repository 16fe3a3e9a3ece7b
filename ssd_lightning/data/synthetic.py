"""Synthetic batches (no dataset, no DALI) for measuring model throughput.

Batches follow docs/architecture.md (any LightningModule runs on them); a few are generated once and cycled
through, so a measured speed is the model's. No annotation file (``val_annotation_file`` is ``None``): no mAP.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor

from ssd_lightning.data.categories import CategoryMap

__all__ = ["SyntheticDetectionDataModule", "SyntheticClassificationDataModule"]

_NUM_DISTINCT = 4  # distinct precomputed batches cycled through
# torch dtypes of the images: no DALI involved, so synthetic data works where DALI is absent
_IMAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _RepeatBatches:
    """``steps`` batches cycling through ``batches``; resumable mid-epoch (loader ``state_dict``)."""

    def __init__(self, batches: list[dict[str, Tensor]], steps: int) -> None:
        self.batches, self.steps = batches, steps
        self._yielded = self._resume_at = 0  # batches handed out in this epoch, where the next one starts

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        start, self._resume_at = self._resume_at, 0
        for i in range(start, self.steps):
            self._yielded = i + 1
            yield self.batches[i % len(self.batches)]

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = int(state["yielded"]) % self.steps


class _SyntheticDataModule(pl.LightningDataModule):
    """Loaders of ``steps_per_epoch`` batches cycling through the subclass's :meth:`_split_batches`."""

    min_classes = 1

    def __init__(
        self,
        *,
        batch_size: int,
        num_classes: int,
        steps_per_epoch: int = 100,
        eval_batch_size: int | None = None,
        output_dtype: str = "float32",
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1 or steps_per_epoch < 1 or num_classes < self.min_classes:
            raise ValueError(
                f"need batch_size >= 1, steps_per_epoch >= 1, num_classes >= {self.min_classes}; got "
                f"{batch_size}, {steps_per_epoch}, {num_classes}"
            )
        if output_dtype not in _IMAGE_DTYPES:
            raise ValueError(f"output_dtype must be one of {sorted(_IMAGE_DTYPES)}, got {output_dtype!r}")
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.steps_per_epoch, self.num_classes = steps_per_epoch, num_classes
        self.dtype, self.seed = _IMAGE_DTYPES[output_dtype], seed

    def train_dataloader(self) -> _RepeatBatches:
        return _RepeatBatches(self._split_batches("train"), self.steps_per_epoch)

    def val_dataloader(self) -> _RepeatBatches:
        return _RepeatBatches(self._split_batches("val"), self.steps_per_epoch)


class SyntheticDetectionDataModule(_SyntheticDataModule):
    """Random SSD300 batches: images (N, 3, 300, 300) ~ N(0, 1) and valid encoded targets; ``num_classes``
    is K + 1. Validation: ``{"images", "image_ids" (N,) int64 (unique, from 1), "image_sizes" (N, 2) = 300}``.
    """

    min_classes = 2

    def __init__(self, *, num_classes: int = 81, **kwargs: Any) -> None:  # kwargs: see _SyntheticDataModule
        super().__init__(num_classes=num_classes, **kwargs)
        self.val_annotation_file = None  # benchmarking only: no COCO evaluation

    @property
    def category_map(self) -> CategoryMap:
        return CategoryMap.from_names([f"class{k}" for k in range(1, self.num_classes)])

    @cached_property
    def _batches(self) -> dict[str, list[dict[str, Tensor]]]:
        """The distinct batches of each split, made on first use (train first: one generator draws both)."""
        from ssd_lightning.models.boxes import BoxCoder, dboxes300_coco

        coder, g = BoxCoder(dboxes300_coco()), torch.Generator().manual_seed(self.seed)
        n, train = self.batch_size, []
        for _ in range(_NUM_DISTINCT):
            targets = []  # 1..4 random boxes per image: sides 0.1-0.6 of the image, labels 1..K
            for _ in range(n):
                m = int(torch.randint(1, 5, (1,), generator=g))
                wh = 0.1 + 0.5 * torch.rand(m, 2, generator=g)
                lt = torch.rand(m, 2, generator=g) * (1 - wh)
                labels = torch.randint(1, self.num_classes, (m,), generator=g)
                targets.append(coder.encode(torch.cat([lt, lt + wh], 1), labels))
            boxes, labels = (torch.stack([t[i] for t in targets]) for i in (0, 1))
            images = torch.randn(n, 3, 300, 300, generator=g).to(self.dtype)
            train.append({"images": images, "boxes": boxes.float(), "labels": labels.long()})
        m = self.eval_batch_size
        val = [
            {
                "images": torch.randn(m, 3, 300, 300, generator=g).to(self.dtype),
                "image_ids": torch.arange(i * m + 1, (i + 1) * m + 1, dtype=torch.int64),
                "image_sizes": torch.full((m, 2), 300, dtype=torch.int64),
            }
            for i in range(_NUM_DISTINCT)
        ]
        return {"train": train, "val": val}

    def _split_batches(self, split: str) -> list[dict[str, Tensor]]:
        return self._batches[split]


class SyntheticClassificationDataModule(_SyntheticDataModule):
    """Random classification batches: images (N, 3, S, S) ~ N(0, 1), labels (N,) int64 in [0, num_classes)."""

    def __init__(self, *, num_classes: int = 1000, image_size: int = 224, **kwargs: Any) -> None:
        super().__init__(num_classes=num_classes, **kwargs)
        self.class_names = [f"class{k}" for k in range(num_classes)]
        self.image_size = image_size

    def _split_batches(self, split: str) -> list[dict[str, Tensor]]:
        n, offset = (self.batch_size, 0) if split == "train" else (self.eval_batch_size, 1)
        g = torch.Generator().manual_seed(self.seed + offset)
        s = self.image_size
        return [
            {
                "images": torch.randn(n, 3, s, s, generator=g).to(self.dtype),
                "labels": torch.randint(0, self.num_classes, (n,), generator=g),
            }
            for _ in range(_NUM_DISTINCT)
        ]
