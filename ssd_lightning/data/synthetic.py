"""Synthetic batches (no dataset, no DALI) for measuring model throughput.

Batches follow docs/architecture.md, so any LightningModule runs on them unchanged. A handful of distinct
batches is generated once and cycled through, so a batch costs nothing and a measured speed is the model's.
There is no annotation file: ``val_annotation_file`` is ``None`` and no COCO mAP can be computed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytorch_lightning as pl
import torch
from torch import Tensor

from ssd_lightning.data.categories import CategoryMap

__all__ = ["SyntheticDetectionDataModule", "SyntheticClassificationDataModule", "make_detection_targets"]

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


def make_detection_targets(
    num_images: int, num_classes: int, generator: torch.Generator, max_objects: int = 4
) -> tuple[Tensor, Tensor]:
    """Encoded SSD300 targets: boxes (N, 8732, 4) float32 (cx, cy, w, h), labels (N, 8732) int64, of 1..
    ``max_objects`` random boxes per image (sides 0.1-0.6 of the image, labels 1..K; IoU threshold 0.5)."""
    from ssd_lightning.models.boxes import BoxCoder, dboxes300_coco

    coder = BoxCoder(dboxes300_coco())
    all_boxes, all_labels = [], []
    for _ in range(num_images):
        m = int(torch.randint(1, max_objects + 1, (1,), generator=generator))
        wh = 0.1 + 0.5 * torch.rand(m, 2, generator=generator)
        lt = torch.rand(m, 2, generator=generator) * (1 - wh)
        gt = torch.cat([lt, lt + wh], dim=1)
        labels = torch.randint(1, num_classes, (m,), generator=generator)
        boxes, enc_labels = coder.encode(gt, labels)
        all_boxes.append(boxes.float())
        all_labels.append(enc_labels.long())
    return torch.stack(all_boxes), torch.stack(all_labels)


class _SyntheticDataModule(pl.LightningDataModule):
    """Loaders of ``steps_per_epoch`` batches cycling through the subclass's :meth:`_split_batches`."""

    min_classes = 1

    def __init__(
        self,
        batch_size: int,
        num_classes: int,
        steps_per_epoch: int,
        eval_batch_size: int | None,
        output_dtype: str,
        seed: int,
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

    def _split_batches(self, split: str) -> list[dict[str, Tensor]]:
        raise NotImplementedError

    def train_dataloader(self) -> _RepeatBatches:
        return _RepeatBatches(self._split_batches("train"), self.steps_per_epoch)

    def val_dataloader(self) -> _RepeatBatches:
        return _RepeatBatches(self._split_batches("val"), self.steps_per_epoch)


class SyntheticDetectionDataModule(_SyntheticDataModule):
    """Random SSD300 batches: images (N, 3, 300, 300) ~ N(0, 1) and valid encoded targets; ``num_classes``
    is K + 1. Validation: ``{"images", "image_ids" (N,) int64 (unique, from 1), "image_sizes" (N, 2) = 300}``.
    """

    min_classes = 2

    def __init__(
        self,
        *,
        batch_size: int,
        num_classes: int = 81,
        steps_per_epoch: int = 100,
        eval_batch_size: int | None = None,
        output_dtype: str = "float32",
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_classes, steps_per_epoch, eval_batch_size, output_dtype, seed)
        self.val_annotation_file = None  # benchmarking only: no COCO evaluation
        self._train: list[dict[str, Tensor]] | None = None
        self._val: list[dict[str, Tensor]] = []

    @property
    def category_map(self) -> CategoryMap:
        return CategoryMap.from_names([f"class{k}" for k in range(1, self.num_classes)])

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        g = torch.Generator().manual_seed(self.seed)
        n, self._train = self.batch_size, []
        for _ in range(_NUM_DISTINCT):
            boxes, labels = make_detection_targets(n, self.num_classes, g)
            images = torch.randn(n, 3, 300, 300, generator=g).to(self.dtype)
            self._train.append({"images": images, "boxes": boxes, "labels": labels})
        m = self.eval_batch_size
        self._val = [
            {
                "images": torch.randn(m, 3, 300, 300, generator=g).to(self.dtype),
                "image_ids": torch.arange(i * m + 1, (i + 1) * m + 1, dtype=torch.int64),
                "image_sizes": torch.full((m, 2), 300, dtype=torch.int64),
            }
            for i in range(_NUM_DISTINCT)
        ]

    def _split_batches(self, split: str) -> list[dict[str, Tensor]]:
        self.setup()
        return self._train if split == "train" else self._val


class SyntheticClassificationDataModule(_SyntheticDataModule):
    """Random classification batches: images (N, 3, S, S) ~ N(0, 1), labels (N,) int64 in [0, num_classes)."""

    def __init__(
        self,
        *,
        batch_size: int,
        num_classes: int = 1000,
        steps_per_epoch: int = 100,
        eval_batch_size: int | None = None,
        output_dtype: str = "float32",
        image_size: int = 224,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_classes, steps_per_epoch, eval_batch_size, output_dtype, seed)
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
