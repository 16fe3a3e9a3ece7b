"""Training controls set from config: freezing, early stopping, gradient accumulation's LR, SyncBatchNorm."""

from __future__ import annotations

import functools
import logging
import math
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ssd_lightning.callbacks.early_stopping import EarlyStopping
from ssd_lightning.callbacks.eval_schedule import EvalSchedule
from ssd_lightning.errors import ConfigError
from ssd_lightning.models import ssd300
from ssd_lightning.modules.base import describe_lr
from ssd_lightning.modules.freezing import freeze_backbone
from ssd_lightning.modules.ssd import SSDLitModule
from ssd_lightning.optim import lr_factor, param_groups
from tests.helpers import (
    csv_rows,
    demo_run_overrides,
    last_checkpoint,
    metric_by_epoch,
    metric_by_step,
    quiet_trainer,
    requires_dali,
    run_train_py,
)


def _names(net: nn.Module, frozen: bool) -> set[str]:
    return {n for n, p in net.named_parameters() if p.requires_grad != frozen}


# ------------------------------------------------------------------------------------------------ freezing
@pytest.mark.parametrize("backbone", ["mobilenet_v2", "resnet18"])
def test_freeze_backbone_or_its_first_stages(backbone):
    net = ssd300(backbone=backbone, num_classes=3)
    freeze_backbone(net, "backbone")
    assert _names(net, frozen=True) == {
        f"feature_extractor.{n}" for n, _ in net.feature_extractor.named_parameters()
    }

    net = ssd300(backbone=backbone, num_classes=3)
    stages = net.feature_extractor.stages()
    assert len(stages) == 4
    freeze_backbone(net, 2)
    expected = {id(p) for stage in stages[:2] for m in stage for p in m.parameters()}
    assert {id(p) for p in net.parameters() if not p.requires_grad} == expected
    # the stages cover the whole backbone, first to last
    assert sum(p.numel() for s in stages for m in s for p in m.parameters()) == sum(
        p.numel() for p in net.feature_extractor.parameters()
    )
    # frozen parameters never reach the optimizer
    in_groups = {id(p) for g in param_groups(net, 1e-4) for p in g["params"]}
    assert in_groups.isdisjoint(expected) and len(in_groups) == sum(p.requires_grad for p in net.parameters())


@pytest.mark.parametrize("bad", ["head", 5, -1, True, 1.5])
def test_freeze_rejects_what_the_backbone_lacks(bad):
    with pytest.raises(ConfigError, match=r"model\.freeze=.*backbone.*from 0 to 4"):
        freeze_backbone(ssd300(backbone="resnet18", num_classes=3), bad)


def test_frozen_batchnorm_stays_in_eval_mode_while_training():
    module = SSDLitModule(ssd300(backbone="mobilenet_v2", num_classes=3), optimizer=torch.optim.SGD, freeze=1)
    module.train()
    first = {id(m) for s in module.net.feature_extractor.stages()[:1] for x in s for m in x.modules()}
    norms = [m for m in module.net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert {id(m) for m in norms if not m.training} == {id(m) for m in norms if id(m) in first} != set()
    module.eval()
    module.train()  # Lightning calls train() after every validation
    assert {id(m) for m in norms if not m.training} == {id(m) for m in norms if id(m) in first}


def test_frozen_batchnorm_stays_in_eval_after_syncbatchnorm_conversion():
    """The conversion in configure_model replaces BatchNorm layers: frozen ones are found again."""
    module = SSDLitModule(
        ssd300(backbone="resnet18", num_classes=3),
        optimizer=torch.optim.SGD,
        freeze="backbone",
        sync_batchnorm=True,
    )

    class _Trainer:  # two GPU processes, as far as the conversion can tell
        world_size = 2
        accelerator = object()

    module._trainer = _Trainer()  # noqa: SLF001 - the attribute LightningModule.trainer reads
    module.configure_model()
    module.train()
    synced = [m for m in module.net.feature_extractor.modules() if isinstance(m, nn.SyncBatchNorm)]
    assert synced and not any(m.training for m in synced)  # the stem's bn1 included
    assert all(m.training for m in module.net.additional_blocks.modules() if isinstance(m, nn.SyncBatchNorm))


# ------------------------------------------------------------------------------------------ early stopping
CURVE = [0.10, 0.20, 0.30, 0.40, 0.41, 0.50, 0.45, 0.52, 0.90, 0.95]  # the metric if evaluated at epoch e


class _CraftedMetric(pl.LightningModule):
    """Logs ``val/m`` = CURVE[epoch] at each validation; counts the training epochs it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.epochs_run = 0

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self) -> None:
        self.log("val/m", CURVE[self.current_epoch], sync_dist=True)

    def on_train_epoch_end(self) -> None:
        self.epochs_run += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(2, 2)), batch_size=1)


@pytest.mark.parametrize(
    ("eval_epochs", "patience", "min_delta", "stopped_after"),
    [
        # evaluated at 1, 3, 5, 7, 9: 0.2, 0.4, 0.5 (+0.1), 0.52 (+0.02), 0.95
        ([1, 3, 5, 7, 9], 1, 0.05, 7),  # 0.52 is not 0.05 better than 0.50: stop after epoch 7
        ([1, 3, 5, 7, 9], 1, 0.0, None),  # always improving at those epochs: runs all 10
        ([5, 6, 7], 1, 0.0, 6),  # 0.50, 0.45: stop; the epochs before are never checked, nor fail
        ([1, 3, 5, 6, 7, 8], 2, 0.05, 7),  # 0.45 and 0.52 (+0.02): two evaluations without improvement
        ([0, 2, 4, 6, 8], 2, 0.06, None),  # 0.45 (+0.04) waits one, 0.90 resets, the last (0.95) waits one
        ([4, 5, 6, 7], 0, 0.0, 6),  # patience 0: the first evaluation without improvement stops
    ],
)
def test_early_stopping_on_a_crafted_metric_curve(eval_epochs, patience, min_delta, stopped_after):
    module = _CraftedMetric()
    stopper = EarlyStopping("val/m", patience=patience, min_delta=min_delta)
    trainer = quiet_trainer(
        callbacks=[EvalSchedule(eval_epochs, always_last=True), stopper],
        max_epochs=len(CURVE),
        num_sanity_val_steps=0,
    )
    trainer.fit(module, _loader(), _loader())
    if stopped_after is None:
        assert module.epochs_run == len(CURVE) and stopper.stopped_epoch == 0
    else:
        assert stopper.stopped_epoch == stopped_after and module.epochs_run == stopped_after + 1


class _RankCurves(_CraftedMetric):
    """Rank 0 logs CURVE, rank 1 a value that always improves (not synchronised); each rank writes how many
    training epochs it ran to ``<out>/rank<r>.txt``."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def on_validation_epoch_end(self) -> None:
        value = CURVE[self.current_epoch] if self.global_rank == 0 else float(self.current_epoch)
        self.log("val/m", value, rank_zero_only=False)

    def on_fit_end(self) -> None:
        Path(self.out, f"rank{self.global_rank}.txt").write_text(str(self.epochs_run))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_early_stopping_stops_every_ddp_rank_together(tmp_path):
    """2 CPU processes (gloo): rank 0's metric stalls after epoch 5 (eval list 1, 3, 5, 7), rank 1's keeps
    improving; Lightning's decision (any rank) stops both after epoch 7, neither waits for the other."""
    from tests.test_coco_map_callback import DestroyProcessGroupAtExit

    trainer = quiet_trainer(
        callbacks=[
            EvalSchedule([1, 3, 5, 7, 9]),
            EarlyStopping("val/m", patience=1, min_delta=0.05),
            DestroyProcessGroupAtExit(),
        ],
        max_epochs=len(CURVE),
        num_sanity_val_steps=0,
        devices=2,
        strategy="ddp_spawn",
    )
    trainer.fit(_RankCurves(str(tmp_path)), _loader(), _loader())
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["8", "8"]


def test_early_stopping_without_patience_never_stops():
    module = _CraftedMetric()
    stopper = EarlyStopping("val/m", patience=None, min_delta=1.0)
    trainer = quiet_trainer(callbacks=[stopper], max_epochs=4, num_sanity_val_steps=0)
    trainer.fit(module, _loader(), _loader())
    assert module.epochs_run == 4 and not stopper.enabled


def test_early_stopping_resumed_with_another_patience_keeps_the_new_one():
    saved = EarlyStopping("val/m", patience=None)
    saved.wait_count, saved.best_score = 1, torch.tensor(0.5)
    resumed = EarlyStopping("val/m", patience=5)
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.patience, resumed.wait_count, float(resumed.best_score), resumed.enabled) == (
        5,
        1,
        0.5,
        True,
    )


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_early_stopping_patience_is_checked(bad):
    with pytest.raises(ValueError, match="callbacks.early_stopping.patience"):
        EarlyStopping("val/m", patience=bad)


# ----------------------------------------------------------------------------- LR of an accumulated batch
def test_lr_line_states_the_accumulated_global_batch():
    line = describe_lr(2.6e-3, 2.6e-3 * 2 * 8 * 4 / 32, "linear", 2, 8 * 4, 4, 32)
    assert line == (
        "LR 0.0052 = base 0.0026 x linear rule of the global batch 64 "
        "(2 device(s) x 8 per device x 4 accumulated) / 32"
    )
    assert describe_lr(1e-3, 1e-3, "none", 4, 1, 2, 32).startswith("LR 0.001 (model.lr_scaling.rule=none")


# --------------------------------------------------------------------------------------------------- EMA
def test_checkpoints_without_ema_weights_start_the_average_and_the_reverse_is_an_error():
    from ssd_lightning.modules.ssd import reconcile_ema_weights

    state = {"net.w": torch.ones(2), "net.bn.num_batches_tracked": torch.tensor(3)}
    reconcile_ema_weights(state, has_ema=True)
    assert torch.equal(state["ema.module.w"], state["net.w"]) and state["ema.module.w"] is not state["net.w"]
    assert int(state["ema.n_averaged"]) == 0 and int(state["ema.module.bn.num_batches_tracked"]) == 3
    with pytest.raises(ConfigError, match="holds EMA weights.*set model.ema_decay"):
        reconcile_ema_weights(state, has_ema=False)
    module = SSDLitModule(
        ssd300(backbone="resnet18", num_classes=3), optimizer=torch.optim.SGD, ema_decay=0.9
    )
    checkpoint = {"state_dict": {f"net.{k}": v for k, v in module.net.state_dict().items()}}
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"], strict=True)  # every key of the module is there


@pytest.mark.parametrize("task", ["detector", "classifier"])
def test_a_fractional_warmup_in_epochs_is_one_warmup_for_the_lr_the_ema_and_the_log(task, caplog):
    """Both modules (one base): warmup_epochs=0.5 of 4 steps is 2 optimizer steps for the LR schedule, for the
    EMA's restarts (updates after the warm-up only: 4 - 2) and for the log line."""
    from ssd_lightning.data.synthetic import SyntheticClassificationDataModule, SyntheticDetectionDataModule
    from ssd_lightning.models import mobilenet_v2
    from ssd_lightning.modules.classifier import ClassifierLitModule

    torch.manual_seed(0)
    common = {
        "optimizer": functools.partial(torch.optim.SGD, lr=0.01),
        "scheduler": {"name": "cosine", "warmup_epochs": 0.5},
        "ema_decay": 0.5,
    }
    if task == "detector":
        module = SSDLitModule(ssd300(backbone="mobilenet_v2", num_classes=3, width_mult=0.25), **common)
        data = SyntheticDetectionDataModule(batch_size=2, num_classes=3, steps_per_epoch=4)
    else:
        module = ClassifierLitModule(mobilenet_v2(num_classes=3, width_mult=0.25), **common)
        data = SyntheticClassificationDataModule(
            batch_size=2, num_classes=3, steps_per_epoch=4, image_size=32
        )
    with caplog.at_level(logging.INFO, logger="ssd_lightning.modules.base"):
        quiet_trainer(max_epochs=1, limit_val_batches=0).fit(module, datamodule=data)
    schedule = module.trainer.lr_scheduler_configs[0].scheduler
    assert schedule.lr_lambdas[0].keywords["warmup_steps"] == module.warmup_steps == 2
    assert int(module.ema.n_averaged) == 4 - 2  # restarted after steps 1 and 2, then averaged twice
    assert "warm-up 2 optimizer steps" in caplog.text


# ------------------------------------------------------------------------------------------- SyncBatchNorm
def test_sync_batchnorm_is_ignored_on_cpu_with_a_warning():
    module = SSDLitModule(
        ssd300(backbone="resnet18", num_classes=3), optimizer=torch.optim.SGD, sync_batchnorm=True
    )

    class _Trainer:
        world_size = 2
        accelerator = pl.accelerators.CPUAccelerator()

    module._trainer = _Trainer()  # noqa: SLF001 - the attribute LightningModule.trainer reads
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.configure_model()
    assert any("sync_batchnorm=True is ignored on CPU" in str(w.message) for w in caught)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in module.net.modules())


# ----------------------------------------------------------------------------------- through train.py
@requires_dali
@pytest.mark.no_dali  # the recipe's switches: DALI only carries the data
@pytest.mark.slow
def test_finetune_recipe_through_train_py(tmp_path, shapes_coco):
    """model.init_from + model.freeze=backbone + accumulate 2 + linear LR rule + early stopping + EMA, one run
    (then its validation and its resume). EMA: val/* are the EMA weights, val_raw/* the raw ones; the detector
    loads the EMA; a validation with model.use_ema=false swaps the two (val/* raw, val_ema/* the EMA) with the
    same numbers."""
    from ssd_lightning.evaluation import evaluate_coco
    from ssd_lightning.inference.detector import load_detector

    init = tmp_path / "init.pt"
    torch.manual_seed(123)
    source = ssd300(backbone="mobilenet_v2", num_classes=5, zero_init_residual=True, width_mult=0.5)
    for m in source.modules():  # running statistics that differ from a fresh network's
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
    torch.save(source.state_dict(), init)
    run_dir = tmp_path / "run"
    done = run_train_py(
        *demo_run_overrides(shapes_coco),
        f"hydra.run.dir={run_dir}",
        "logger=csv",
        "trainer.max_epochs=4",
        "eval_epochs=[0,1,2,3]",
        f"model.init_from={init}",
        "model.freeze=backbone",
        "trainer.accumulate_grad_batches=2",
        "model.lr_scaling.rule=linear",
        "model.lr_scaling.reference_batch_size=16",
        "callbacks.early_stopping.patience=1",
        "callbacks.early_stopping.min_delta=1.0",  # no mAP improves by 1: stop at the second evaluation
        "model.ema_decay=0.5",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = (run_dir / "demo.log").read_text()
    # the LR rule counts the accumulated batch: 2e-3 x (1 x 4 x 2) / 16
    rule = "LR 0.001 = base 0.002 x linear rule of the global batch 8"
    assert f"{rule} (1 device(s) x 4 per device x 2 accumulated) / 16" in log
    assert sorted(metric_by_epoch(run_dir, "val/mAP")) == [0, 1]  # stopped after the second evaluation
    ckpt = last_checkpoint(run_dir)
    assert ckpt["epoch"] == 1
    # optimizer steps: the batches of two epochs / 2, and the LR the schedule gives at each of them
    steps_per_epoch = ckpt["global_step"] // 2
    lrs = metric_by_step(run_dir, "lr-AdamW/other")
    assert lrs, "LearningRateMonitor logged no LR"
    for step, lr in lrs.items():
        expected = 1e-3 * lr_factor(
            step,
            schedule="cosine",
            steps_per_epoch=steps_per_epoch,
            total_steps=4 * steps_per_epoch,
            warmup_steps=2,
            min_factor=0.1,  # the demo's cosine ends at 10 % of the peak
        )
        assert lr == pytest.approx(expected, rel=1e-5), step
    # frozen: every backbone tensor (BatchNorm statistics too) is the init file's, bit for bit
    state = ckpt["state_dict"]
    init_state = torch.load(init, weights_only=True)
    backbone = [k for k in init_state if k.startswith("feature_extractor.")]
    assert backbone and all(torch.equal(state[f"net.{k}"], init_state[k]) for k in backbone)
    trained = [k for k in init_state if k.startswith(("additional_blocks.", "loc.")) and k.endswith("weight")]
    assert any(not torch.equal(state[f"net.{k}"], init_state[k]) for k in trained)
    assert not any(math.isnan(v) for v in lrs.values())
    averaged = int(state["ema.n_averaged"])
    assert averaged > 0

    # EMA: both evaluations logged and written, the checkpoint holds both weights, the detector takes the EMA
    ema_map, raw_map = metric_by_epoch(run_dir, "val/mAP"), metric_by_epoch(run_dir, "val_raw/mAP")
    assert sorted(ema_map) == sorted(raw_map) == [0, 1]
    ann = shapes_coco / "annotations" / "instances_val2017.json"
    for name, logged in (
        ("detections_epoch_1.json", ema_map[1]),
        ("val_raw_detections_epoch_1.json", raw_map[1]),
    ):
        assert evaluate_coco(ann, str(run_dir / name), verbose=False)["mAP"] == pytest.approx(
            logged, abs=1e-6
        )
    ema = {k[len("ema.module.") :]: v for k, v in state.items() if k.startswith("ema.module.")}
    raw = {k[len("net.") :]: v for k, v in state.items() if k.startswith("net.")}
    assert ema.keys() == raw.keys() and any(not torch.equal(ema[k], raw[k]) for k in raw)
    detector = load_detector(ckpt_path=run_dir / "checkpoints" / "last.ckpt")
    assert all(torch.equal(v, ema[k]) for k, v in detector.net.state_dict().items())
    check = tmp_path / "validate"
    done = run_train_py(
        "task=validate",
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        *demo_run_overrides(shapes_coco),
        "logger=csv",
        "model.ema_decay=0.5",
        "model.use_ema=false",
        f"hydra.run.dir={check}",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in csv_rows(next(check.glob("csv/**/metrics.csv"))) if r.get("val/mAP")]
    assert float(rows[-1]["val/mAP"]) == pytest.approx(raw_map[1], abs=1e-6)
    assert float(rows[-1]["val_ema/mAP"]) == pytest.approx(ema_map[1], abs=1e-6)

    # resumed with a patience of 5 (the checkpoint's 1 would stop at once): two more evaluated epochs; frozen
    # tensors still the file's, the optimizer state (no frozen parameters) and the EMA continued
    done = run_train_py(
        f"resume={run_dir}", "trainer.max_epochs=4", "callbacks.early_stopping.patience=5", timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(metric_by_epoch(run_dir, "val/mAP")) == [0, 1, 2, 3]
    state = last_checkpoint(run_dir)["state_dict"]
    assert all(torch.equal(state[f"net.{k}"], init_state[k]) for k in backbone)
    assert int(state["ema.n_averaged"]) > averaged
