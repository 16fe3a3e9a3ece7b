"""TrainingSpeed: images/s and data-wait fraction at the logging interval, measured without device syncs.

A real Lightning Trainer runs with a fake clock that only the data (fetch), the training step, validation
and epoch-end work advance, so the logged values are known exactly; the DALI datamodule run checks the
metrics in metrics.csv against the training steps' own durations (no timed thresholds).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ssd_lightning.callbacks import TrainingSpeed
from ssd_lightning.callbacks.training_speed import interval_speed
from tests.ddp_probes import SyncCounter
from tests.helpers import metric_by_step

BATCH, FETCH, COMPUTE = 4, 0.25, 0.75  # seconds of fake time per batch: 4 images / 1 s, a quarter waiting
VALIDATION, EPOCH_END, FIRST_STEP = 100.0, 50.0, 1000.0  # excluded: validation, between epochs, warm-up


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowItems(Dataset):
    """Each item costs FETCH / BATCH seconds of fake time: a batch's fetch costs FETCH."""

    def __init__(self, clock: FakeClock, n: int, cost: float) -> None:
        self.clock, self.n, self.cost = clock, n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.clock.now += self.cost
        return torch.full((3, 2, 2), float(i))


class FakeTimeModule(pl.LightningModule):
    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.layer = torch.nn.Linear(12, 1)

    def training_step(self, batch, batch_idx):
        self.clock.now += COMPUTE + (FIRST_STEP if self.global_step == 0 else 0.0)
        return self.layer(batch.flatten(1)).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.clock.now += VALIDATION

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class EpochEndWork(pl.Callback):
    """Stands for checkpoint saving between epochs (runs after TrainingSpeed's epoch-end hook)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.clock.now += EPOCH_END


def _rates_and_waits(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """``{step: value}`` of ``train/images_per_second`` and ``train/data_wait_fraction`` in the run's CSV."""
    return (
        metric_by_step(run_dir, "train/images_per_second"),
        metric_by_step(run_dir, "train/data_wait_fraction"),
    )


def f32(x: float) -> float:
    """``x`` as the float32 tensor ``LightningModule.log`` makes of it."""
    return float(torch.tensor(x, dtype=torch.float32))


@pytest.mark.no_dali
@pytest.mark.parametrize("warmup", [1, 2])
def test_exact_rate_and_wait_fraction_with_a_fake_clock(tmp_path, warmup):
    clock = FakeClock()
    speed = TrainingSpeed(warmup_steps=warmup, clock=clock)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        log_every_n_steps=2,
        val_check_interval=3,  # validation inside the epoch (after batch 3) and at its end (after batch 6)
        num_sanity_val_steps=0,
        logger=pl.loggers.CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[speed, EpochEndWork(clock)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train = DataLoader(SlowItems(clock, 6 * BATCH, FETCH / BATCH), batch_size=BATCH)
    val = DataLoader(SlowItems(clock, 2, 0.0), batch_size=1)
    trainer.fit(FakeTimeModule(clock), train, val)

    rates, waits = _rates_and_waits(tmp_path)
    # Lightning's logging steps are 1, 3, ..., 11; the one inside the warm-up logs nothing
    assert sorted(rates) == sorted(waits) == [s for s in range(1, 12, 2) if s >= warmup]
    # validation (200 s per run), epoch-end work (50 s) and the first step (1000 s) are all left out
    assert rates == {s: BATCH / (FETCH + COMPUTE) for s in rates}
    assert waits == {s: FETCH / (FETCH + COMPUTE) for s in waits}
    last = speed.last_interval
    assert (last.step, last.batches, last.images, last.elapsed, last.wait) == (11, 2, 8, 2.0, 0.5)
    assert last.images_per_second * last.elapsed == last.images
    assert vars(trainer.profiler).keys().isdisjoint({"start", "stop"}), "the profiler is left as it was"


@pytest.mark.no_dali
def test_intervals_tile_the_measured_time_when_step_costs_vary(tmp_path):
    """Each interval's images/s x its elapsed time gives its images; the elapsed times add up."""
    clock = FakeClock()
    costs = iter([3.0, 0.5, 1.25, 2.0, 0.25, 4.0, 1.5, 0.75, 2.5, 1.0])  # compute of batches 0..9

    class Varying(FakeTimeModule):
        def training_step(self, batch, batch_idx):
            self.clock.now += next(costs)
            return self.layer(batch.flatten(1)).pow(2).mean()

    speed = TrainingSpeed(warmup_steps=1, clock=clock)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        log_every_n_steps=3,
        logger=pl.loggers.CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[speed],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        profiler="simple",  # a profiler of the user's: it still records the fetches it wraps
    )
    trainer.fit(Varying(clock), DataLoader(SlowItems(clock, 10 * 2, 0.125), batch_size=2))
    fetches = trainer.profiler.recorded_durations["[_TrainingEpochLoop].train_dataloader_next"]
    assert len(fetches) == 10 and vars(trainer.profiler).keys().isdisjoint({"start", "stop"})
    rates, waits = _rates_and_waits(tmp_path)
    # steps 2, 5, 8: batches 1-2, 3-5, 6-8 (batch 0 is the warm-up); each fetch costs 0.25 s
    compute = {2: 0.5 + 1.25, 5: 2.0 + 0.25 + 4.0, 8: 1.5 + 0.75 + 2.5}
    batches = {2: 2, 5: 3, 8: 3}
    assert rates == {s: f32(2 * batches[s] / (compute[s] + 0.25 * batches[s])) for s in compute}
    assert waits == {s: f32(0.25 * batches[s] / (compute[s] + 0.25 * batches[s])) for s in compute}
    elapsed = sum(2 * batches[s] / rates[s] for s in rates)  # float32 values, hence approx
    assert elapsed == pytest.approx(sum(compute.values()) + 0.25 * 8, rel=1e-6)
    assert speed.last_interval.elapsed == compute[8] + 0.75 and speed.last_interval.images == 6


def test_ranks_combine_into_global_images_and_the_slowest_wait():
    # two ranks, 32 images each; rank 1 waited longer for data and took a little longer
    rate, wait = interval_speed([(32.0, 2.0, 0.5), (32.0, 2.5, 1.5)])
    assert rate == 64 / 2.5 and wait == 1.5 / 2.5
    assert interval_speed([(8.0, 4.0, 1.0)]) == (2.0, 0.25)
    with pytest.raises(ValueError, match="positive elapsed"):
        interval_speed([(8.0, 0.0, 0.0)])
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainingSpeed(warmup_steps=-1)


class RankBatches:
    """A sized iterable of ``BATCH - 1`` images on rank 0, ``BATCH + 1`` on rank 1; rank r's fetch costs
    ``FETCH * (1 + 2r)`` s of fake time (no sampler: each rank has its own)."""

    def __init__(self, clock: FakeClock, n: int) -> None:
        self.clock, self.n = clock, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        rank = torch.distributed.get_rank()
        for _ in range(self.n):
            self.clock.now += FETCH * (1 + 2 * rank)
            yield torch.zeros(BATCH - 1 + 2 * rank, 3, 2, 2)


class RankModule(FakeTimeModule):
    def train_dataloader(self):
        return RankBatches(self.clock, 6)


@pytest.mark.no_dali
@pytest.mark.multiprocess
def test_ddp_ranks_log_summed_images_over_the_slowest_rank_and_its_wait(tmp_path):
    clock = FakeClock()
    can_fork = "fork" in torch.multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork" if can_fork else "ddp_spawn",
        log_every_n_steps=2,
        logger=pl.loggers.CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[TrainingSpeed(warmup_steps=1, clock=clock)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(RankModule(clock))
    # metrics.csv written by rank 0
    rates, waits = _rates_and_waits(tmp_path)
    # per batch: rank 0 takes 0.25 + 0.75 s for 3 images, rank 1 0.75 + 0.75 s for 5 images
    per_batch = {1: 1, 3: 2, 5: 2}  # measured batches in each interval (batch 0 is the warm-up)
    assert rates == {s: f32(8 * n / (1.5 * n)) for s, n in per_batch.items()}  # 8 images per 1.5 s
    assert waits == {s: 0.5 for s in per_batch}  # rank 1 waits 0.75 of its 1.5 s


class CountedSpeed(TrainingSpeed):
    """TrainingSpeed whose hooks and profiler wrappers run under the counter, keyed by global step."""

    def __init__(self, counter: SyncCounter, **kwargs) -> None:
        super().__init__(**kwargs)
        self.counter = counter
        self.step = 0
        for name in (
            "on_train_batch_end",
            "on_train_epoch_start",
            "on_train_epoch_end",
            "_fetch_start",
            "_fetch_stop",
        ):
            setattr(self, name, self._counted(getattr(self, name)))

    def _counted(self, hook):
        def run(*args, **kwargs):
            trainer = next((a for a in args if isinstance(a, pl.Trainer)), None)
            if trainer is not None:  # Lightning's logging step of this batch (the csv's step column)
                self.step = trainer.fit_loop.epoch_loop._batches_that_stepped
            self.counter.inside = self.step
            try:
                return hook(*args, **kwargs)
            finally:
                self.counter.inside = None

        return run


@pytest.mark.dali
@pytest.mark.slow
def test_demo_run_logs_speed_at_the_logging_steps_without_syncs(make_cfg, shapes_coco, tmp_path, monkeypatch):
    """SSD300 on the DALI shapes datamodule: the metrics land in metrics.csv at Lightning's logging steps,
    each interval's elapsed time holds its training steps, and only logging steps touch torch."""
    import ssd_lightning.cli.train as train_module
    from ssd_lightning.modules.ssd import SSDLitModule

    warmup, every = 2, 2
    cfg = make_cfg(
        [
            "experiment=demo",
            f"data.root={shapes_coco}",
            "data.batch_size=4",
            "data.eval_batch_size=5",
            "trainer.max_epochs=2",
            f"trainer.log_every_n_steps={every}",
            "eval_epochs=[0]",  # a validation (with COCO evaluation) between the two epochs
            "logger=csv",
        ]
    )
    counter = SyncCounter()
    speed = CountedSpeed(counter, warmup_steps=warmup)
    real_group = train_module.instantiate_group
    monkeypatch.setattr(
        train_module,
        "instantiate_group",
        lambda group: [*real_group(group), speed] if group is cfg.callbacks else real_group(group),
    )
    step_seconds: dict[int, float] = {}
    real_step = SSDLitModule.training_step

    def timed_step(self, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return real_step(self, *args, **kwargs)
        finally:
            step_seconds[self.trainer.global_step] = time.perf_counter() - begin

    monkeypatch.setattr(SSDLitModule, "training_step", timed_step)
    with counter:
        train_module.train(cfg)

    loss_steps = sorted(metric_by_step(tmp_path, "train/loss_step"))  # Lightning's logging steps
    rates, waits = _rates_and_waits(tmp_path)
    total_batches = len(step_seconds)
    assert loss_steps == [s for s in range(total_batches) if (s + 1) % every == 0] and len(loss_steps) >= 4
    assert sorted(rates) == sorted(waits) == [s for s in loss_steps if s >= warmup]
    previous = warmup - 1
    for step in sorted(rates):
        batches = range(previous + 1, step + 1)
        elapsed = BATCH * len(batches) / rates[step]  # every batch holds 4 images
        compute = sum(step_seconds[b] for b in batches)
        assert 0.0 < compute <= elapsed  # the interval encloses its training steps ...
        assert 0.0 < waits[step] <= 1.0 - compute / elapsed + 1e-9  # ... and the wait lies outside them
        previous = step
    assert (speed.last_interval.step, speed.last_interval.images) == (max(rates), BATCH * len(batches))
    # no torch call that could sync on an ordinary step; the logging steps make the two logged tensors
    assert set(counter.calls) == set(rates), dict(counter.calls)
    # (the first also makes Lightning's buffers of the two new keys: zero tensors)
    first, *others = sorted(rates)
    assert set(counter.calls[first]) == {"tensor"}, dict(counter.calls)
    assert all(counter.calls[s] == {"tensor": 2} for s in others), dict(counter.calls)
