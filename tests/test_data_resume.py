"""Resuming restores the DALI training stream: same images, same order, same augmentation as a straight run.

Two levels: the loader state alone (what Lightning stores under ``loops.fit_loop.state_dict.combined_loader``)
restored into a fresh datamodule, and a real ``trainer.fit(..., ckpt_path=...)`` after an end-of-epoch and a
mid-epoch checkpoint.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from tests.helpers import requires_dali

pytestmark = [
    pytest.mark.dali,
    requires_dali,
]

BATCH = 4


def _loader(root, *, shard_id=0, num_shards=1, augment=True):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    dm = CocoDALIDataModule(root, batch_size=BATCH, device="cpu", num_threads=1, seed=7, augment=augment)
    dm.setup("fit")
    return dm.make_loader("train", shard_id=shard_id, num_shards=num_shards, with_image_ids=True)


def _ids(batches) -> list[list[int]]:
    return [b["image_ids"].tolist() for b in batches]


def _clone(batches) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for b in batches]


def _roundtrip(state):
    """Through torch.save/torch.load, as in a checkpoint file (weights_only: plain types only)."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_end_of_epoch_state_restores_the_next_epoch_exactly(shapes_coco):
    straight = _loader(shapes_coco)
    epoch0 = _clone(straight)
    state = _roundtrip(straight.state_dict())
    assert state["epoch_batches"] == len(straight) and state["reader_batches"] == 0
    epoch1 = _clone(straight)
    assert _ids(epoch0) != _ids(epoch1)  # reshuffled, so restarting at epoch 0 would be caught

    fresh = _loader(shapes_coco)
    assert _ids(fresh) == _ids(epoch0)  # without the state a new loader starts over

    resumed = _loader(shapes_coco)
    resumed.load_state_dict(state)
    got = _clone(resumed)
    assert _ids(got) == _ids(epoch1)
    for a, b in zip(got, epoch1, strict=True):  # augmentation too: crops, flips, colour jitter
        for key in a:
            assert torch.equal(a[key], b[key]), key
    # and the stream goes on identically afterwards
    assert _ids(resumed) == _ids(straight)


def test_mid_epoch_state_yields_the_rest_of_the_epoch(shapes_coco):
    straight = _loader(shapes_coco, augment=False)
    list(straight)
    it = iter(straight)
    head = [next(it) for _ in range(2)]
    state = _roundtrip(straight.state_dict())
    tail = _ids(it)
    assert state["epoch_batches"] == 2 and len(head) + len(tail) == len(straight)

    resumed = _loader(shapes_coco, augment=False)
    resumed.load_state_dict(state)
    assert _ids(resumed) == tail  # the rest of the saved epoch ...
    assert _ids(resumed) == _ids(straight)  # ... then full epochs, as in the straight run


def test_other_rank_restores_from_the_anchor(shapes_coco):
    """Lightning saves rank 0's state only; rank 1 rebuilds from its own anchor checkpoint and re-runs.

    The anchors of both shards are merged by hand here, as ``all_gather_object`` does under DDP.
    """
    loaders = [_loader(shapes_coco, shard_id=s, num_shards=2) for s in (0, 1)]
    for loader in loaders:
        list(loader)  # epoch 0; the reader epoch wraps, each loader records its anchor
    its = [iter(loader) for loader in loaders]
    for it in its:
        next(it)
    state = loaders[0].state_dict()
    state["anchor"].update(loaders[1]._anchor)
    assert state["reader_batches"] == 1 and set(state["current"]) == {0}
    rest1 = _ids(its[1])

    rank1 = _loader(shapes_coco, shard_id=1, num_shards=2)
    rank1.load_state_dict(_roundtrip(state))
    assert _ids(rank1) == rest1


def test_imagefolder_datamodule_state_roundtrip(shapes_imagefolder):
    """The classification datamodule (file reader) resumes through its own state_dict/load_state_dict."""
    from ssd_lightning.data.imagefolder_datamodule import ImageFolderDALIDataModule

    def dm():
        m = ImageFolderDALIDataModule(shapes_imagefolder, batch_size=8, device="cpu", num_threads=1, seed=2)
        m.setup("fit")
        return m

    straight = dm()
    loader = straight.train_dataloader()
    list(loader)
    state = _roundtrip(straight.state_dict())
    epoch1 = _clone(loader)

    resumed = dm()
    resumed.load_state_dict(state)  # before the loader exists, as in trainer.fit(ckpt_path=...)
    got = _clone(resumed.train_dataloader())
    assert [b["labels"].tolist() for b in got] == [b["labels"].tolist() for b in epoch1]
    assert all(torch.equal(a["images"], b["images"]) for a, b in zip(got, epoch1, strict=True))
    assert not torch.equal(got[0]["images"], _clone(dm().train_dataloader())[0]["images"])


def test_state_from_other_data_is_ignored_with_a_warning(shapes_coco):
    a = _loader(shapes_coco)
    list(a)
    state = a.state_dict()
    b = _loader(shapes_coco, shard_id=0, num_shards=2)
    with pytest.warns(UserWarning, match="cannot be restored"):
        b.load_state_dict(state)
    assert len(list(b)) == len(b)


# ------------------------------------------------------------------------------------------- Lightning
class IdRecorder(pl.LightningModule):
    """Records ``(epoch, batch_idx, image ids)`` of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch_idx, batch["image_ids"].tolist()))
        return self.weight * batch["images"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _datamodule(root):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    return CocoDALIDataModule(
        root, batch_size=BATCH, device="cpu", num_threads=1, seed=3, train_image_ids=True
    )


def _fit(root, ckpt_dir, *, max_epochs=2, max_steps=-1, ckpt_path=None, every_n_train_steps=None):
    from pytorch_lightning.callbacks import ModelCheckpoint

    model = IdRecorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps
            )
        ],
    )
    trainer.fit(model, datamodule=_datamodule(root), ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.timeout(120)
def test_fit_resumed_from_a_checkpoint_sees_the_same_batches(shapes_coco, tmp_path):
    straight = _fit(shapes_coco, tmp_path / "straight")
    per_epoch = len(straight) // 2
    assert [e for e, _, _ in straight] == [0] * per_epoch + [1] * per_epoch
    assert straight[:per_epoch] != straight[per_epoch:]

    # end of epoch 0
    first = _fit(shapes_coco, tmp_path / "first", max_epochs=1)
    assert first == straight[:per_epoch]
    resumed = _fit(shapes_coco, tmp_path / "resumed", ckpt_path=tmp_path / "first" / "last.ckpt")
    assert resumed == straight[per_epoch:]

    # mid-epoch 1: a step checkpoint two batches into the epoch
    steps = per_epoch + 2
    _fit(shapes_coco, tmp_path / "mid", max_steps=steps, every_n_train_steps=1)
    rest = _fit(shapes_coco, tmp_path / "rest", ckpt_path=tmp_path / "mid" / "last.ckpt")
    assert rest == straight[steps:]
