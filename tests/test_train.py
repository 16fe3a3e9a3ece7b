"""train(cfg) end to end on generated data: the real Trainer, DALI CPU pipelines, COCO evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssd_lightning.cli.train import train
from ssd_lightning.evaluation import evaluate_coco
from tests.helpers import demo_run_overrides, load_checkpoint, metric_by_epoch, requires_dali, train_config

pytestmark = requires_dali


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, shapes_coco):
    """Two tiny epochs of the demo experiment, evaluated after epoch 0 and after the last one."""
    run_dir = tmp_path_factory.mktemp("demo_run")
    # not make_cfg: that fixture is function-scoped
    cfg = train_config([*demo_run_overrides(shapes_coco), "logger=csv"], output_dir=run_dir)
    return cfg, train(cfg), run_dir


@pytest.mark.dali
@pytest.mark.slow
def test_fit_trains_evaluates_and_checkpoints(demo_run, shapes_coco):
    cfg, metrics, run_dir = demo_run
    assert 0.0 <= metrics["val/mAP"] <= 1.0 and metrics["train/loss_epoch"] > 0
    # validation (and COCO mAP) only after the listed epoch and the last one
    assert sorted(metric_by_epoch(run_dir, "val/mAP")) == [0, 1]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    # the written detections are the evaluated ones: pycocotools by hand gives the logged number
    written = json.loads((run_dir / "detections_epoch_1.json").read_text())
    by_hand = evaluate_coco(
        shapes_coco / "annotations" / "instances_val2017.json", written, "pycocotools", verbose=False
    )  # the reference implementation, independent of the callback's default faster-coco-eval
    assert by_hand["mAP"] == pytest.approx(metrics["val/mAP"], abs=1e-6)


@pytest.mark.dali
@pytest.mark.slow
def test_validate_task_reproduces_the_last_evaluation(demo_run, make_cfg, shapes_coco):
    cfg, metrics, run_dir = demo_run
    out = make_cfg(
        [
            "experiment=demo",
            "task=validate",
            f"data.root={shapes_coco}",
            "data.eval_batch_size=7",  # another batch size: same detections
            f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
            "logger=csv",
        ]
    )
    validated = train(out)
    assert validated["val/mAP"] == pytest.approx(metrics["val/mAP"], abs=1e-6)
    assert validated["val/mAP_50"] == pytest.approx(metrics["val/mAP_50"], abs=1e-6)


def _recompute_val_accuracy(cfg, checkpoint: Path) -> tuple[float, float, int, int]:
    """(top-1, mean cross-entropy, classes, images) of the checkpoint's network on the val split, computed
    with plain torch (argmax), not the module's torchmetrics."""
    import hydra
    import torch
    import torch.nn.functional as F

    module = hydra.utils.instantiate(cfg.model)
    module.load_state_dict(load_checkpoint(checkpoint)["state_dict"])
    net = module.net.eval()
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("validate")
    correct, losses, n = 0, [], 0
    from ssd_lightning.models.cpu_bf16 import cpu_has_native_bf16

    # precision=bf16, as the run: float32 on a CPU without native bf16 (train.py's cpu_bf16=auto)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_native_bf16()):
        for batch in datamodule.val_dataloader():
            logits, labels = net(batch["images"]).float(), batch["labels"].long()
            correct += int((logits.argmax(1) == labels).sum())
            losses.append(F.cross_entropy(logits, labels, reduction="none"))
            n += len(labels)
    return correct / n, float(torch.cat(losses).mean()), logits.shape[1], n


@pytest.mark.dali
@pytest.mark.slow
def test_mobilenetv2_demo_fits_on_generated_imagefolder(make_cfg, shapes_imagefolder, tmp_path):
    cfg = make_cfg(
        [
            "experiment=mobilenetv2_demo",
            f"data.root={shapes_imagefolder}",
            "data.batch_size=8",
            "data.eval_batch_size=7",
            "trainer.max_epochs=2",
            "logger=csv",
        ]
    )
    metrics = train(cfg)
    # the logged top-1 and loss equal an independent pass of last.ckpt's weights over the val images
    acc1, loss, top_k, n = _recompute_val_accuracy(cfg, tmp_path / "checkpoints" / "last.ckpt")
    assert n == 20 and top_k == 4  # 4 classes x 5 images; acc5 is top-min(5, classes) = top-4 here
    assert metrics["val/acc1"] == pytest.approx(acc1, abs=1.01 / n)  # bf16: at most one image flips
    assert metrics["val/loss"] == pytest.approx(loss, rel=0.02)
    assert metrics["val/acc5"] == 1.0  # top-4 of 4 classes is always right: acc5 proves nothing more here
    assert metrics["val/acc1_best"] >= metrics["val/acc1"]
    assert sorted(metric_by_epoch(tmp_path, "val/acc1")) == [0, 1]  # classification validates every epoch
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
