"""The ``benchmark_training`` / ``benchmark_inference`` tasks: drive a configured Trainer for a timed run.

``python -m ssd_lightning.cli.benchmark <run or multirun dir>`` prints one table row per ``benchmark.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import Checkpoint

from ssd_lightning.callbacks.throughput import RESULTS_FILENAME, ThroughputBenchmark
from ssd_lightning.tables import markdown_table

log = logging.getLogger(__name__)

TASK_MODES = {"benchmark_training": "training", "benchmark_inference": "inference"}


def run_benchmark_task(
    task: str,
    *,
    trainer: pl.Trainer,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule,
    output_dir: str | os.PathLike,
    config_summary: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Run a throughput benchmark and return its statistics: ``trainer.fit`` on ``warmup + iterations``
    training batches without validation and checkpoints, or ``trainer.validate`` on that many batches. The
    trainer's :class:`ThroughputBenchmark` (a default one if none) measures and writes to ``output_dir``.
    """
    if task not in TASK_MODES:
        raise ValueError(f"task={task!r} is not a benchmark task; expected one of {tuple(TASK_MODES)}")
    mode = TASK_MODES[task]
    found = [cb for cb in trainer.callbacks if isinstance(cb, ThroughputBenchmark)]
    if len(found) > 1:
        raise ValueError(
            f"the trainer has {len(found)} ThroughputBenchmark callbacks; keep one (callbacks=benchmark)"
        )
    callback = found[0] if found else ThroughputBenchmark(mode)
    if not found:
        log.info("no ThroughputBenchmark callback in the trainer: adding one with the default settings")
        trainer.callbacks.append(callback)
    if callback.mode != mode:
        log.info("ThroughputBenchmark mode %r -> %r (from task=%s)", callback.mode, mode, task)
        callback.mode = mode
    callback.output_dir = Path(output_dir)
    callback.config_summary = {**callback.config_summary, **dict(config_summary or {}), "task": task}
    callback.results = callback.statistics = None
    needed = callback.total_iterations

    if mode == "training":
        if removed := [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, Checkpoint)]:
            log.info("benchmark_training: not checkpointing (removed %s)", ", ".join(removed))
            trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, Checkpoint)]
        trainer.limit_val_batches = 0  # no validation (also not the one `should_stop` would trigger)
        # stop even if `should_stop` were overridden; the configured epochs must give `needed` batches
        trainer.fit_loop.epoch_loop.max_steps = needed
        trainer.fit(model, datamodule=datamodule)
    else:
        trainer.limit_val_batches = needed
        trainer.validate(model, datamodule=datamodule, verbose=False)

    if callback.statistics is None:
        raise ValueError(
            f"{task} timed no iteration: the data gave fewer than warmup + 1 = {callback.warmup + 1} batches "
            f"(needs warmup + iterations = {needed})"
        )
    return dict(callback.statistics)


def config_summary_from_cfg(cfg: DictConfig) -> dict[str, Any]:
    """Facts of a composed run config worth recording next to the numbers (plain JSON values)."""
    return {
        "task_name": cfg.get("task_name"),
        "backbone": OmegaConf.select(cfg, "model.net.backbone"),
        "width_mult": OmegaConf.select(cfg, "model.net.width_mult"),
        "num_classes": OmegaConf.select(cfg, "model.net.num_classes"),
        "channels_last": bool(OmegaConf.select(cfg, "model.channels_last", default=False)),
        "compile": bool(cfg.get("compile", False)),
        "data": OmegaConf.select(cfg, "data._target_"),
        "batch_size": OmegaConf.select(cfg, "data.batch_size"),
        "eval_batch_size": OmegaConf.select(cfg, "data.eval_batch_size"),
        "precision": OmegaConf.select(cfg, "trainer.precision"),
    }


def collect_results(root: str | os.PathLike) -> list[dict[str, Any]]:
    """Every ``benchmark.json`` below ``root`` (a run or multirun directory), sorted by mode and batch."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist; pass a run or multirun directory")
    results = [
        {**json.loads(p.read_text(encoding="utf-8")), "path": str(p)}
        for p in sorted(root.rglob(RESULTS_FILENAME))
    ]
    return sorted(results, key=itemgetter("mode", "precision", "world_size", "batch_size_per_device"))


SWEEP_COLUMNS = ("mode", "precision", "devices", "batch/device", "img/s median", "img/s mean", "img/s p90",
                 "latency ms p90", "peak MiB")  # fmt: skip


def format_sweep_table(results: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table, one row per ``benchmark.json`` content: the reference's img/s-per-batch-size layout."""
    rows = []
    for r in results:
        s = r["statistics"]
        rows.append([
            r["mode"], r["precision"], r["world_size"], r["batch_size_per_device"],
            f"{s['images_per_second_median']:.1f}", f"{s['images_per_second_mean']:.1f}",
            f"{s['images_per_second_p90']:.1f}", f"{s['latency_ms_p90']:.1f}",
            f"{r['peak_memory_bytes'] / 2**20:.0f}",
        ])  # fmt: skip
    return markdown_table(SWEEP_COLUMNS, rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Summarise benchmark.json files of a run or a sweep.")
    parser.add_argument("root", help="run or multirun directory (searched recursively)")
    args = parser.parse_args(argv)
    results = collect_results(args.root)
    if not results:
        raise FileNotFoundError(f"no {RESULTS_FILENAME} below {args.root}")
    first = results[0]
    print(f"{first.get('model')} ({first.get('backbone')}) on {first.get('device_name')}")
    print(format_sweep_table(results))


if __name__ == "__main__":
    main()
