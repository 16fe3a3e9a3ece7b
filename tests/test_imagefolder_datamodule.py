"""ImageFolderDALIDataModule on the generated shapes ImageFolder dataset (CPU DALI)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.helpers import requires_dali

pytestmark = [pytest.mark.dali, requires_dali]


def _dm(root, **kwargs):
    from ssd_lightning.data.imagefolder_datamodule import ImageFolderDALIDataModule

    kwargs.setdefault("batch_size", 8)
    dm = ImageFolderDALIDataModule(root, device="cpu", image_size=64, val_resize=72, **kwargs)
    dm.setup("fit")
    return dm


def _counts(root, split):
    return {d.name: sum(1 for _ in d.iterdir()) for d in sorted((root / split).iterdir()) if d.is_dir()}


def test_class_names_and_batches(shapes_imagefolder):
    dm = _dm(shapes_imagefolder)
    counts = _counts(shapes_imagefolder, "train")
    assert dm.class_names == sorted(counts) and dm.num_classes == len(counts)
    loader = dm.train_dataloader()
    assert len(loader) == sum(counts.values()) // 8
    batch = next(iter(loader))
    assert batch["images"].shape == (8, 3, 64, 64) and batch["images"].dtype == torch.float32
    assert batch["labels"].shape == (8,) and batch["labels"].dtype == torch.int64


def test_val_exactly_once_with_folder_labels(shapes_imagefolder):
    dm = _dm(shapes_imagefolder, eval_batch_size=7)
    counts = _counts(shapes_imagefolder, "val")
    loader = dm.val_dataloader()
    total = sum(counts.values())
    assert len(loader) == -(-total // 7)
    for _ in range(2):  # stable across epochs
        labels = Counter(int(x) for b in loader for x in b["labels"])
        assert labels == Counter({i: n for i, n in enumerate(counts.values())})


def test_two_shards_cover_val_once(shapes_imagefolder):
    dm = _dm(shapes_imagefolder, eval_batch_size=4)
    per_shard = [
        Counter(int(x) for b in dm.make_loader("val", shard_id=s, num_shards=2) for x in b["labels"])
        for s in (0, 1)
    ]
    counts = _counts(shapes_imagefolder, "val")
    assert per_shard[0] + per_shard[1] == Counter({i: n for i, n in enumerate(counts.values())})


def test_bfloat16_and_errors(shapes_imagefolder, tmp_path):
    from ssd_lightning.data.imagefolder_datamodule import ImageFolderDALIDataModule

    dm = _dm(shapes_imagefolder, output_dtype="bfloat16")
    assert next(iter(dm.val_dataloader()))["images"].dtype == torch.bfloat16
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolderDALIDataModule(tmp_path / "nope").setup("fit")
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(ValueError, match="no class sub-directories"):
        ImageFolderDALIDataModule(tmp_path / "empty").setup("fit")
