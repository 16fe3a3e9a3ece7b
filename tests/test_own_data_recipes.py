"""The own-data recipes (`experiment=ssd300_own_data`, `experiment=mobilenetv2_own_data`), shrunk to a few CPU
steps on generated data: what README promises of them (class count and names from the data, a warm-up then
a cosine LR, an evaluation after the last epoch) holds in a real run."""

from __future__ import annotations

import json

import pytest

from ssd_lightning.cli.train import train
from ssd_lightning.io.model_record import MODEL_KEY
from tests.helpers import load_checkpoint, metric_by_step, requires_dali, train_config

# DALI is only the road here (the recipes' values are the point): run once, not per DALI line
pytestmark = [requires_dali, pytest.mark.no_dali, pytest.mark.slow]

SHRINK = ["trainer=cpu", "trainer.max_epochs=1", "+trainer.limit_train_batches=3"]
SHRINK += ["trainer.log_every_n_steps=1", "data.num_threads=1", "logger=csv"]


def test_ssd300_own_data_reads_its_classes_from_the_data_and_warms_up_into_a_cosine(shapes_coco, tmp_path):
    # ResNet-18 for ResNet-50: the recipe's values are the point, and a ResNet-50 step takes ~30 s on 2 cores
    overrides = ["experiment=ssd300_own_data", f"data.root={shapes_coco}", "model.net.weights_backbone=null"]
    overrides += ["model.net.backbone=resnet18"]
    cfg = train_config(
        [*overrides, *SHRINK, "data.batch_size=2", "data.eval_batch_size=4"], output_dir=tmp_path
    )
    assert cfg.model.net.num_classes is None and cfg.model.scheduler.name == "cosine"
    metrics = train(cfg)

    categories = json.loads((shapes_coco / "annotations" / "instances_train2017.json").read_text())[
        "categories"
    ]
    record = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")[MODEL_KEY]
    assert record["architecture"]["args"]["num_classes"] == len(categories) + 1
    by_id = sorted(categories, key=lambda c: c["id"])
    assert record["classes"]["names"][1:] == [c["name"] for c in by_id]
    assert record["classes"]["category_ids"] == [c["id"] for c in by_id]
    assert "val/mAP" in metrics  # evaluated after the last epoch although eval_epochs starts at 9
    # 2 warm-up epochs of 3 steps: the LR climbs linearly over 6 steps to 2.6e-3 x 2 / 32 (the linear rule)
    lr = [v for _, v in sorted(metric_by_step(tmp_path, "lr-SGD/other").items())]
    assert lr == pytest.approx([0.0, 2.6e-3 * 2 / 32 / 6, 2 * 2.6e-3 * 2 / 32 / 6], rel=1e-6)


def test_mobilenetv2_own_data_fine_tunes_on_an_imagefolder(shapes_imagefolder, tmp_path):
    overrides = [
        "experiment=mobilenetv2_own_data",
        f"data.root={shapes_imagefolder}",
        "model.net.weights=null",
    ]
    cfg = train_config(
        [*overrides, *SHRINK, "data.batch_size=8", "data.eval_batch_size=10"], output_dir=tmp_path
    )
    assert cfg.model.label_smoothing == 0.1 and cfg.model.net.num_classes is None
    metrics = train(cfg)

    record = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")[MODEL_KEY]
    classes = sorted(p.name for p in (shapes_imagefolder / "train").iterdir() if p.is_dir())
    assert record["classes"]["names"] == classes and record["architecture"]["args"]["num_classes"] == len(
        classes
    )
    assert 0.0 <= metrics["val/acc1"] <= 1.0
    # 1 warm-up epoch of 3 steps towards 4e-3 x 8 / 256 (AdamW, the linear rule)
    lr = [v for _, v in sorted(metric_by_step(tmp_path, "lr-AdamW/other").items())]
    assert lr == pytest.approx([0.0, 4e-3 * 8 / 256 / 3, 2 * 4e-3 * 8 / 256 / 3], rel=1e-6)
