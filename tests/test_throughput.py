"""ThroughputBenchmark: exact statistics on a fake clock, warm-up, stopping, DDP aggregation, JSON schema."""

from __future__ import annotations

import json
import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ssd_lightning.callbacks.throughput import (
    RESULTS_FILENAME,
    ThroughputBenchmark,
    format_table,
    percentile,
    throughput_statistics,
)


# --------------------------------------------------------------------------------------------------------
# Test doubles (module level: picklable for ddp_spawn)
# --------------------------------------------------------------------------------------------------------
class ListClock:
    """Returns the given timestamps in order; fails loudly when read more often than expected."""

    def __init__(self, stamps: list[float]) -> None:
        self.stamps = list(stamps)
        self.calls = 0

    def __call__(self) -> float:
        if self.calls >= len(self.stamps):
            raise AssertionError(f"clock read {self.calls + 1} times, expected {len(self.stamps)}")
        self.calls += 1
        return self.stamps[self.calls - 1]


class RankClock:
    """Start/end pairs: iteration ``i`` on rank ``r`` lasts ``durations[r][i]`` s (100 s gaps between)."""

    def __init__(self, durations: list[list[float]]) -> None:
        self.durations = durations
        self.calls = 0
        self.t = 0.0

    def __call__(self) -> float:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        i, is_end = divmod(self.calls, 2)
        self.calls += 1
        if not is_end:
            self.t += 100.0
            return self.t
        return self.t + self.durations[rank][i]


class Batches:
    """A sized iterable of ready batches (one loader, not a list of loaders; no sampler for DDP)."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


class TinyModule(pl.LightningModule):
    """Linear model on dict batches ``{"images": (B, 4)}``; batch size per rank from ``rank_batch``."""

    def __init__(self, rank_batch: tuple[int, ...] = (4,), num_batches: int = 10) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.rank_batch = rank_batch
        self.num_batches = num_batches

    def _batches(self) -> Batches:
        n = self.rank_batch[self.global_rank % len(self.rank_batch)]
        return Batches([{"images": torch.randn(n, 4)} for _ in range(self.num_batches)])

    def train_dataloader(self):
        return self._batches()

    def val_dataloader(self):
        return self._batches()

    def training_step(self, batch, batch_idx):
        return self.layer(batch["images"]).square().mean()

    def validation_step(self, batch, batch_idx):
        return self.layer(batch["images"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(callback: ThroughputBenchmark, tmp_path, **kwargs) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
        **kwargs,
    }
    return pl.Trainer(callbacks=[callback], **options)


# --------------------------------------------------------------------------------------------------------
# Pure statistics
# --------------------------------------------------------------------------------------------------------
def test_percentile_interpolates_linearly():
    values = [4.0, 16.0, 8.0]
    assert percentile(values, 50) == 8.0
    assert percentile(values, 10) == pytest.approx(4.8)  # rank 0.2 between 4 and 8
    assert percentile(values, 90) == pytest.approx(14.4)  # rank 1.8: 8 + 0.8 * (16 - 8)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_statistics_single_rank_known_answer():
    times = torch.tensor([[0.5, 0.25, 1.0]])
    batches = torch.tensor([[4, 4, 4]])
    s = throughput_statistics(times, batches)  # rates 8, 16, 4
    assert s["images_per_second_median"] == pytest.approx(8.0)
    assert s["images_per_second_mean"] == pytest.approx(28 / 3)
    assert s["images_per_second_min"] == pytest.approx(4.0)
    assert s["images_per_second_max"] == pytest.approx(16.0)
    assert s["images_per_second_p90"] == pytest.approx(4.8)  # 90 % of iterations reach it
    assert s["images_per_second_average"] == pytest.approx(12 / 1.75)  # the reference's avg_img/sec
    assert s["latency_ms_median"] == pytest.approx(500.0)
    assert s["latency_ms_p90"] == pytest.approx(900.0)
    assert (s["iterations"], s["world_size"], s["global_batch_size"]) == (3.0, 1.0, 4.0)


def test_statistics_two_ranks_sum_batches_and_take_the_slowest_rank():
    # rank 0: batch 3; rank 1: batch 5 -> 8 images per global iteration
    times = torch.tensor([[0.5, 0.25, 1.0], [1.0, 0.5, 0.5]])
    batches = torch.tensor([[3, 3, 3], [5, 5, 5]])
    s = throughput_statistics(times, batches)
    # per iteration: 8 / max(0.5, 1.0), 8 / max(0.25, 0.5), 8 / max(1.0, 0.5) = 8, 16, 8
    assert s["images_per_second_median"] == pytest.approx(8.0)
    assert s["images_per_second_max"] == pytest.approx(16.0)
    assert s["images_per_second_mean"] == pytest.approx(32 / 3)
    # all 24 images over the slowest rank's elapsed time (rank 1: 2.0 s; rank 0: 1.75 s)
    assert s["images_per_second_average"] == pytest.approx(12.0)
    assert s["global_batch_size"] == 8.0 and s["world_size"] == 2.0
    # neither the naive sum of per-rank rates (3/0.5 + 5/1.0 = 11) nor batch x world size x world size
    assert s["images_per_second_min"] == pytest.approx(8.0)


def test_statistics_reject_bad_input():
    with pytest.raises(ValueError, match="ranks, iterations"):
        throughput_statistics(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="positive"):
        throughput_statistics(torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="no timed iterations"):
        throughput_statistics(torch.zeros(1, 0), torch.zeros(1, 0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"mode": "eval"}, "mode='eval'"), ({"warmup": -1}, "warmup"), ({"iterations": 0}, "iterations")],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ThroughputBenchmark(**kwargs)


# --------------------------------------------------------------------------------------------------------
# The callback inside real Lightning loops, on a fake clock
# --------------------------------------------------------------------------------------------------------
def test_training_excludes_warmup_and_loading_and_stops(tmp_path):
    # Two warm-up iterations read no clock; three timed ones read (start, end). The 9-10 s gaps between
    # an end and the next start are the "data loading" that must not count.
    clock = ListClock([0.0, 0.5, 10.0, 10.25, 20.0, 21.0])
    callback = ThroughputBenchmark("training", warmup=2, iterations=3, clock=clock, print_table=False)
    trainer = _trainer(callback, tmp_path)
    trainer.fit(TinyModule(num_batches=10))

    assert trainer.global_step == 5  # stopped after warm-up + iterations, not after the 10-batch epoch
    assert clock.calls == 6
    s = callback.statistics
    assert s["images_per_second_median"] == pytest.approx(8.0)
    assert s["images_per_second_mean"] == pytest.approx(28 / 3)
    assert s["images_per_second_min"] == pytest.approx(4.0)
    assert s["images_per_second_max"] == pytest.approx(16.0)
    assert s["images_per_second_p90"] == pytest.approx(4.8)
    assert s["iterations"] == 3.0
    assert (tmp_path / RESULTS_FILENAME).is_file()


def test_training_with_data_loading_times_end_to_end(tmp_path):
    # Reads: epoch start, then every batch end (warm-up included, to anchor the first timed iteration).
    clock = ListClock([0.0, 1.0, 2.0, 2.5, 3.5, 3.75])
    callback = ThroughputBenchmark(
        "training", warmup=2, iterations=3, include_data_loading=True, clock=clock, print_table=False
    )
    trainer = _trainer(callback, tmp_path)
    trainer.fit(TinyModule(num_batches=10))
    assert trainer.global_step == 5 and clock.calls == 6
    s = callback.statistics  # times 0.5, 1.0, 0.25 with batch 4 -> 8, 4, 16 img/s
    assert (s["images_per_second_min"], s["images_per_second_median"], s["images_per_second_max"]) == (
        pytest.approx(4.0),
        pytest.approx(8.0),
        pytest.approx(16.0),
    )
    assert s["images_per_second_average"] == pytest.approx(12 / 1.75)


def test_inference_mode_times_validation_batches_only(tmp_path):
    clock = ListClock([0.0, 0.5, 10.0, 10.25])
    callback = ThroughputBenchmark("inference", warmup=1, iterations=2, clock=clock, print_table=False)
    trainer = _trainer(callback, tmp_path, limit_val_batches=3)
    trainer.validate(TinyModule(rank_batch=(6,)), verbose=False)
    s = callback.statistics  # 6 / 0.5, 6 / 0.25
    assert s["images_per_second_min"] == pytest.approx(12.0)
    assert s["images_per_second_max"] == pytest.approx(24.0)
    assert callback.results["mode"] == "inference" and callback.results["batch_size_per_device"] == 6


def test_training_mode_ignores_validation(tmp_path):
    clock = ListClock([0.0, 1.0])
    callback = ThroughputBenchmark("training", warmup=0, iterations=1, clock=clock, print_table=False)
    trainer = _trainer(callback, tmp_path, limit_val_batches=3)
    trainer.validate(TinyModule(), verbose=False)
    assert clock.calls == 0 and callback.statistics is None


def test_short_epoch_reports_what_was_timed(tmp_path, caplog):
    clock = ListClock([0.0, 0.5, 1.0, 2.0])
    callback = ThroughputBenchmark("training", warmup=1, iterations=5, clock=clock, print_table=False)
    trainer = _trainer(callback, tmp_path)
    trainer.fit(TinyModule(num_batches=3))  # 1 warm-up + 2 timed, then the epoch ends
    assert callback.statistics["iterations"] == 2.0
    assert "timed 2 of 5 iterations" in caplog.text


def test_benchmark_json_schema(tmp_path):
    out = tmp_path / "run"
    clock = ListClock([0.0, 0.5, 1.0, 2.0])
    callback = ThroughputBenchmark(
        "training",
        warmup=1,
        iterations=2,
        clock=clock,
        output_dir=out,
        config_summary={"backbone": "tiny", "compile": False, "experiment": "unit", "sweep": [2, 4]},
        print_table=False,
    )
    trainer = _trainer(callback, tmp_path, precision="bf16-mixed")
    trainer.fit(TinyModule(num_batches=10))
    data = json.loads((out / RESULTS_FILENAME).read_text())
    assert not list(out.glob("*.tmp"))  # atomic write leaves no temporary file behind
    expected_types = {
        "mode": str,
        "model": str,
        "backbone": str,
        "batch_size_per_device": int,
        "global_batch_size": float,
        "world_size": int,
        "precision": str,
        "channels_last": bool,
        "compile": bool,
        "include_data_loading": bool,
        "warmup": int,
        "iterations": int,
        "device": str,
        "device_name": str,
        "torch_version": str,
        "peak_memory_bytes": int,
        "peak_memory_kind": str,
        "statistics": dict,
        "config": dict,
        "timestamp": str,
    }
    for key, kind in expected_types.items():
        assert isinstance(data[key], kind), (key, data[key])
    assert data["dali_version"] is None or isinstance(data["dali_version"], str)
    assert data["mode"] == "training" and data["model"] == "TinyModule" and data["backbone"] == "tiny"
    assert (
        data["precision"] == "bf16-mixed"
        and data["world_size"] == 1
        and data["torch_version"] == torch.__version__
    )
    assert data["batch_size_per_device"] == 4 and data["iterations"] == 2 and data["warmup"] == 1
    assert data["peak_memory_kind"] == "process_peak_rss" and data["peak_memory_bytes"] > 2**20
    assert data["config"]["sweep"] == [2, 4]
    stats = data["statistics"]
    for key in (
        "images_per_second_median",
        "images_per_second_mean",
        "images_per_second_min",
        "images_per_second_max",
        "images_per_second_p90",
        "images_per_second_average",
        "latency_ms_median",
        "latency_ms_p90",
        "latency_ms_p99",
        "peak_memory_mib",
    ):
        assert isinstance(stats[key], float) and math.isfinite(stats[key]), key
    assert stats["images_per_second_median"] == pytest.approx(6.0)  # times 0.5, 1.0 with batch 4 -> 8, 4
    assert stats["images_per_second_average"] == pytest.approx(8 / 1.5)
    table = format_table(data).splitlines()
    assert table[0].startswith("training benchmark: TinyModule (tiny), 1 x 4 images, bf16-mixed")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[1:]]
    assert cells[0] == ["statistic", "value"] and cells[1][1].endswith("-:")  # values right-aligned
    assert cells[2] == ["img/s median", "6.00"] and cells[7] == ["img/s all images/time", f"{8 / 1.5:.2f}"]
    assert len(table) == 3 + 10 and len({len(line) for line in table[1:]}) == 1  # padded: aligned as text


# --------------------------------------------------------------------------------------------------------
# DDP: two real CPU processes (gloo)
# --------------------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_ddp_global_throughput_sums_rank_batches_over_the_slowest_rank(tmp_path):
    durations = [[0.5, 0.25, 1.0], [1.0, 0.5, 0.5]]  # rank 0 batch 3, rank 1 batch 5
    callback = ThroughputBenchmark(
        "training", warmup=1, iterations=3, clock=RankClock(durations), output_dir=tmp_path, print_table=False
    )
    # fork is quick (no re-import in the workers); it is impossible once CUDA is initialised or without fork
    can_fork = "fork" in torch.multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized()
    trainer = _trainer(callback, tmp_path, devices=2, strategy="ddp_fork" if can_fork else "ddp_spawn")
    trainer.fit(TinyModule(rank_batch=(3, 5), num_batches=10))
    data = json.loads((tmp_path / RESULTS_FILENAME).read_text())  # written by rank 0 of the workers
    s = data["statistics"]
    assert data["world_size"] == 2 and s["world_size"] == 2.0
    assert s["global_batch_size"] == 8.0  # 3 + 5, counted once
    assert s["images_per_second_median"] == pytest.approx(8.0)
    assert s["images_per_second_max"] == pytest.approx(16.0)
    assert s["images_per_second_mean"] == pytest.approx(32 / 3)
    assert s["images_per_second_average"] == pytest.approx(24 / 2.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_synchronises_and_reports_device_memory(tmp_path):
    callback = ThroughputBenchmark("training", warmup=1, iterations=2, print_table=False)
    trainer = _trainer(callback, tmp_path, accelerator="gpu")
    trainer.fit(TinyModule(num_batches=10))
    data = callback.results
    assert trainer.global_step == 3
    assert data["device"] == "cuda" and data["device_name"] == torch.cuda.get_device_name(0)
    assert data["peak_memory_kind"] == "cuda_max_memory_allocated" and data["peak_memory_bytes"] > 0
