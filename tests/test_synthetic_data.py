"""Synthetic datamodules: contract shapes and valid encoded targets."""

from __future__ import annotations

import torch

from ssd_lightning.data.synthetic import SyntheticClassificationDataModule, SyntheticDetectionDataModule


def test_detection_batches_follow_contract():
    dm = SyntheticDetectionDataModule(batch_size=3, num_classes=5, steps_per_epoch=6, eval_batch_size=2)
    train = dm.train_dataloader()
    batches = list(train)
    assert len(train) == len(batches) == 6
    b = batches[0]
    assert b["images"].shape == (3, 3, 300, 300) and b["images"].dtype == torch.float32
    assert b["boxes"].shape == (3, 8732, 4) and b["boxes"].dtype == torch.float32
    assert b["labels"].shape == (3, 8732) and b["labels"].dtype == torch.int64
    assert b["labels"].min() >= 0 and b["labels"].max() < 5
    assert ((b["labels"] > 0).sum(dim=1) > 0).all()  # every image has matched default boxes
    v = next(iter(dm.val_dataloader()))
    assert v["image_ids"].tolist() == [1, 2] and v["image_sizes"].tolist() == [[300, 300]] * 2
    assert dm.num_classes == dm.category_map.num_classes == 5 and dm.val_annotation_file is None


def test_detection_targets_are_boxcoder_encodings():
    """Positives carry a real box (cx, cy, w, h) inside the image; negatives carry their default box."""
    from ssd_lightning.models.boxes import dboxes300_coco

    dm = SyntheticDetectionDataModule(batch_size=2, num_classes=3, steps_per_epoch=1, seed=3)
    b = next(iter(dm.train_dataloader()))
    dboxes = dboxes300_coco().cxcywh
    for k in range(2):
        neg = b["labels"][k] == 0
        torch.testing.assert_close(b["boxes"][k][neg], dboxes[neg])
        pos = b["boxes"][k][~neg]
        assert (pos[:, 2:] >= 0.1 - 1e-6).all() and (pos[:, 2:] <= 0.6 + 1e-6).all()
        assert (pos[:, :2] - pos[:, 2:] / 2 >= -1e-6).all() and (
            pos[:, :2] + pos[:, 2:] / 2 <= 1 + 1e-6
        ).all()


def test_bfloat16_and_classification():
    dm = SyntheticDetectionDataModule(batch_size=1, steps_per_epoch=1, output_dtype="bfloat16")
    assert next(iter(dm.train_dataloader()))["images"].dtype == torch.bfloat16
    cls = SyntheticClassificationDataModule(batch_size=4, num_classes=10, steps_per_epoch=3, image_size=32)
    batches = list(cls.train_dataloader())
    assert len(batches) == 3 and batches[0]["images"].shape == (4, 3, 32, 32)
    assert batches[0]["labels"].dtype == torch.int64 and batches[0]["labels"].max() < 10
