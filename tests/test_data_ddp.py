"""Exactly-once validation and lock-step training under a real 2-process CPU DDP run (gloo)."""

from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl
import torch

from tests.helpers import requires_dali

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.dali,
    requires_dali,
]


class IdRecorder(pl.LightningModule):
    """Records the image ids each rank validates and the number of training steps; rank files in out_dir."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.val_ids: list[int] = []
        self.runs: list[list[int]] = []
        self.train_steps = 0

    def training_step(self, batch, batch_idx):
        self.train_steps += 1
        return (self.weight * batch["images"].float().mean()).sum() + (batch["labels"] > 0).float().mean() * 0

    def validation_step(self, batch, batch_idx):
        assert batch["image_ids"].shape[0] == batch["images"].shape[0] == batch["image_sizes"].shape[0]
        self.val_ids += batch["image_ids"].tolist()

    def on_validation_epoch_end(self):
        self.runs.append(self.val_ids)
        self.val_ids = []
        path = f"{self.out_dir}/{self.trainer.state.fn.value}-rank{self.global_rank}.json"
        with open(path, "w") as f:
            json.dump(
                {"runs": self.runs, "train_steps": self.train_steps, "sanity": self.trainer.sanity_checking},
                f,
            )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.slow
def test_ddp_two_ranks_validate_each_image_once(shapes_coco, tmp_path):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    val = json.loads((shapes_coco / "annotations" / "instances_val2017.json").read_text())
    val_ids = sorted(im["id"] for im in val["images"])
    assert len(val_ids) % (2 * 4) != 0  # padding is really exercised
    dm = CocoDALIDataModule(shapes_coco, batch_size=4, eval_batch_size=4, device="cpu", num_threads=1)
    model = IdRecorder(str(tmp_path))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        num_sanity_val_steps=1,  # abandons a validation epoch part-way
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    trainer.validate(model, datamodule=dm)  # re-validation after fit: fresh loaders, full epoch

    ranks = [json.loads((tmp_path / f"fit-rank{r}.json").read_text()) for r in (0, 1)]
    runs0, runs1 = ranks[0]["runs"], ranks[1]["runs"]
    assert len(runs0) == len(runs1) == 3  # sanity check (partial) + 2 epochs
    for r0, r1 in [(runs0[1], runs1[1]), (runs0[2], runs1[2])]:
        assert sorted(r0 + r1) == val_ids, "each val image exactly once across ranks"
        assert not set(r0) & set(r1)
    train_ids = {
        a["image_id"]
        for a in json.loads((shapes_coco / "annotations" / "instances_train2017.json").read_text())[
            "annotations"
        ]
    }
    steps = (len(train_ids) // 2) // 4
    assert ranks[0]["train_steps"] == ranks[1]["train_steps"] == 2 * steps
    again = [json.loads((tmp_path / f"validate-rank{r}.json").read_text())["runs"] for r in (0, 1)]
    assert sorted(again[0][0] + again[1][0]) == val_ids


class TrainIdRecorder(pl.LightningModule):
    """Appends ``[epoch, batch_idx, image ids]`` of each step to ``<out_dir>/train-rank<r>.jsonl``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        with open(f"{self.out_dir}/train-rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps([self.current_epoch, batch_idx, batch["image_ids"].tolist()]) + "\n")
        return self.weight * batch["images"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _ddp_fit(root, out_dir, ckpt_path=None, max_steps=-1):
    from pytorch_lightning.callbacks import ModelCheckpoint

    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    out_dir.mkdir()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=out_dir, save_last=True, save_top_k=0, every_n_train_steps=1)],
    )
    dm = CocoDALIDataModule(root, batch_size=4, device="cpu", num_threads=1, seed=11, train_image_ids=True)
    trainer.fit(TrainIdRecorder(str(out_dir)), datamodule=dm, ckpt_path=ckpt_path)
    files = [out_dir / f"train-rank{r}.jsonl" for r in (0, 1)]
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_resume_mid_epoch_restores_every_rank(shapes_coco, tmp_path):
    """Rank 0's saved state restores rank 1 too (its anchor checkpoint, gathered over gloo, then a replay)."""
    straight = _ddp_fit(shapes_coco, tmp_path / "straight")
    per_epoch = len(straight[0]) // 2
    assert per_epoch >= 2 and len(straight[1]) == 2 * per_epoch
    assert straight[0][:per_epoch] != straight[0][per_epoch:]  # reshuffled between epochs
    stop = per_epoch + 1  # one step into epoch 1
    _ddp_fit(shapes_coco, tmp_path / "first", max_steps=stop)
    resumed = _ddp_fit(shapes_coco, tmp_path / "resumed", ckpt_path=tmp_path / "first" / "last.ckpt")
    for rank in (0, 1):
        assert resumed[rank] == straight[rank][stop:], rank
