"""The training step never waits for the device: no sync-prone call outside the logging interval.

On a CPU nothing really syncs, so the test counts the calls that would (``.item()``, ``.tolist()``,
``bool(tensor)``, ``torch.tensor(python value)`` ...) with a TorchFunctionMode during a short fit of each
module, through the configs' callbacks (progress bar, NaN guard, LR monitor, checkpointing).

Under DDP (2 CPU processes, gloo) the same holds, and no collective runs on an ordinary step either:
Lightning 2.6's own per-step broadcast of a SIGTERM flag (``_broadcast_sigterm_tensor``, a device sync
before every step) is switched off by ``InterruptCheckpoint``, whose one small all-reduce runs every
``check_every_n_steps`` steps only; the epoch metrics (``train/loss_epoch``, ``train/acc1_epoch``) are
reduced over the ranks once, at the epoch's end, and equal the mean over every rank's batches.
"""

from __future__ import annotations

import json

import pytest
import pytorch_lightning as pl

from ssd_lightning.cli.train import train
from tests.ddp_probes import SyncCounter
from tests.helpers import csv_rows, launch_train_py, train_config

STEPS, LOG_EVERY = 8, 4


class _CountSyncs(SyncCounter, pl.Callback):
    """Counts sync-prone torch calls per training batch index while a batch runs."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.inside = batch_idx

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.inside = None  # epoch-end work (checkpoint, epoch metrics) may sync once per epoch


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["data=synthetic", "model.net.backbone=resnet18", "model.net.num_classes=5", "~callbacks.coco_map"],
        ["data=synthetic_cls", "model=mobilenetv2", "callbacks=classification", "data.image_size=64"],
    ],
    ids=["ssd300", "mobilenetv2"],
)
def test_only_logging_steps_touch_the_host(overrides, tmp_path, monkeypatch):
    counter = _CountSyncs()
    cfg = train_config(
        [
            *overrides,
            "data.batch_size=2",
            f"data.steps_per_epoch={STEPS}",
            "trainer=cpu",
            "trainer.max_epochs=1",
            f"trainer.log_every_n_steps={LOG_EVERY}",
            "+trainer.limit_val_batches=0",
            "eval_epochs=[]",
            "precision=bf16",
            "logger=csv",
        ],
        output_dir=tmp_path,
    )
    import ssd_lightning.cli.train as train_module

    real = train_module.instantiate_group
    monkeypatch.setattr(
        train_module,
        "instantiate_group",
        lambda group: [*real(group), counter] if group is cfg.callbacks else real(group),
    )
    with counter:
        train(cfg)
    # Lightning logs at batches 3 and 7, the LR monitor the batch before; the first batch sets up the
    # logged-metric buffers once; the last one runs the epoch-end hooks. Ordinary batches: 1, 4, 5.
    logging_batches = {0, STEPS - 1} | {b for b in range(STEPS) if (b + 1) % LOG_EVERY in (0, LOG_EVERY - 1)}
    assert set(range(STEPS)) - logging_batches == {1, 4, 5}
    busy = {b: dict(c) for b, c in counter.calls.items() if b not in logging_batches}
    assert busy == {}, f"sync-prone calls on ordinary steps: {busy}"
    assert counter.calls, "the counter saw nothing: the test is not measuring"


DDP_STEPS, CHECK_EVERY = 8, 4  # per epoch, 2 epochs; the interrupt check at global steps 4, 8, 12, 16


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.no_dali  # synthetic data
@pytest.mark.timeout(400)
def test_ddp_steps_have_no_collective_and_epoch_metrics_cover_all_ranks(tmp_path):
    probe = tmp_path / "probe"
    with launch_train_py(
        "data=synthetic_cls",
        "model=mobilenetv2",
        "callbacks=classification",
        "data._target_=tests.ddp_probes.PerRankSyntheticClassification",  # the ranks' losses differ
        "data.image_size=32",
        "data.batch_size=4",
        f"data.steps_per_epoch={DDP_STEPS}",
        "model.net.num_classes=4",
        "trainer=ddp_cpu",  # Lightning's launcher: 2 processes
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1000",  # no logging interval inside the epoch
        "+trainer.limit_val_batches=0",
        "eval_epochs=[]",
        "logger=csv",
        "+trainer.enable_progress_bar=false",
        f"callbacks.interrupt.check_every_n_steps={CHECK_EVERY}",
        "+callbacks.probe._target_=tests.ddp_probes.RecordCollectives",
        f"+callbacks.probe.directory={probe}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ) as run:
        done = run.finish(timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    ranks = [json.loads((probe / f"rank_{r}.json").read_text()) for r in (0, 1)]
    steps = [{int(k): v for k, v in r["steps"].items()} for r in ranks]

    for rank, record in enumerate(steps):
        assert sorted(record) == list(range(2 * DDP_STEPS))
        for step, seen in record.items():
            if step % DDP_STEPS in (0, DDP_STEPS - 1):
                continue  # the first batch sets up the logged-metric buffers; the last runs epoch-end work
            check = (step + 1) % CHECK_EVERY == 0
            # the interrupt check: one all-reduce of 3 numbers, one read back; nothing on other steps
            assert seen["collectives"] == (["all_reduce"] if check else []), (rank, step, seen)
            assert seen["syncs"] == ({"tensor": 1, "tolist": 1} if check else {}), (rank, step, seen)
    ordinary = [s for s in range(2 * DDP_STEPS) if s % DDP_STEPS not in (0, DDP_STEPS - 1)]
    assert any((s + 1) % CHECK_EVERY for s in ordinary) and any((s + 1) % CHECK_EVERY == 0 for s in ordinary)
    # the epoch metrics' reduction happens at the epoch's end (torchmetrics gathers the states)
    assert "all_gather" in ranks[0]["outside"] and "all_gather" in ranks[1]["outside"]

    rows = csv_rows(tmp_path / "run" / "csv" / "metrics.csv")
    for epoch in (0, 1):
        batches = [record[s] for record in steps for s in range(epoch * DDP_STEPS, (epoch + 1) * DDP_STEPS)]
        images = sum(b["batch_size"] for b in batches)
        loss = sum(b["loss"] * b["batch_size"] for b in batches) / images
        acc1 = sum(b["acc1"] * b["batch_size"] for b in batches) / images
        rank0 = [steps[0][s]["loss"] for s in range(epoch * DDP_STEPS, (epoch + 1) * DDP_STEPS)]
        assert sum(rank0) / DDP_STEPS != pytest.approx(loss, rel=1e-3)  # the ranks' losses differ
        logged = next(r for r in rows if r.get("train/loss_epoch") and int(r["epoch"]) == epoch)
        assert float(logged["train/loss_epoch"]) == pytest.approx(loss, rel=1e-5)
        assert float(logged["train/acc1_epoch"]) == pytest.approx(acc1, rel=1e-6)
