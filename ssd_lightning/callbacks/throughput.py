"""Images/s of training or inference iterations measured inside a Lightning run (the reference's benchmarks).

An iteration is one training batch (forward, loss, backward, step) or one validation/predict batch (forward,
decode), timed from its ``batch_start`` to its ``batch_end`` hook: data loading and the host-to-device copy
are excluded, as in the NVIDIA reference; ``include_data_loading`` times from one ``batch_end`` to the next.
The first ``warmup`` iterations are not timed; after ``iterations`` more, training stops
(``trainer.should_stop``); evaluation loops are bounded by the caller (``limit_val_batches``). On CUDA the
device is synchronised only at those clock readings; on CPU never.

Over ranks (``t[r, i]`` seconds, ``b[r, i]`` images): iteration ``i``'s rate is ``sum_r b[r, i] / max_r
t[r, i]`` (the slowest rank sets the pace), the overall rate ``sum b / max_r sum_i t[r, i]``; every rank
computes the same numbers, rank 0 prints the table and writes ``benchmark.json``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import logging
import os
import platform
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor

from ssd_lightning import compat
from ssd_lightning.io.atomic import atomic_write_json
from ssd_lightning.tables import markdown_table

log = logging.getLogger(__name__)

MODES = ("training", "inference")
RESULTS_FILENAME = "benchmark.json"


def percentile(values: Sequence[float], q: float) -> float:
    """``q``-th percentile (0..100), interpolated linearly between closest ranks (NumPy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def throughput_statistics(iteration_times: Tensor, batch_sizes: Tensor) -> dict[str, float]:
    """Statistics (floats) of (R ranks, n iterations) seconds ``iteration_times`` and images ``batch_sizes``:
    ``images_per_second_*`` of the n global rates (``_p90``: the rate 90 % of iterations reached;
    ``_average``: all images / the slowest rank's time, the reference's ``avg_img/sec``), ``latency_ms_*``
    of the per-iteration max over ranks, ``global_batch_size`` (median), ``iterations``, ``world_size``.
    """
    if iteration_times.dim() != 2 or iteration_times.shape != batch_sizes.shape:
        raise ValueError(
            f"iteration_times and batch_sizes must both be (ranks, iterations); got "
            f"{tuple(iteration_times.shape)} and {tuple(batch_sizes.shape)}"
        )
    world_size, n = iteration_times.shape
    if n == 0:
        raise ValueError("no timed iterations: nothing to report (raise iterations or the data length)")
    times = iteration_times.detach().to("cpu", torch.float64)
    batches = batch_sizes.detach().to("cpu", torch.float64)
    if bool((times <= 0).any()):
        raise ValueError("iteration times must be positive; is the clock monotonic?")
    step_time = times.max(dim=0).values  # (n,) the slowest rank sets the pace
    global_batch = batches.sum(dim=0)  # (n,) each rank's images counted once
    rates = (global_batch / step_time).tolist()
    latency_ms = (step_time * 1e3).tolist()
    elapsed = float(times.sum(dim=1).max())
    return {
        "images_per_second_median": percentile(rates, 50),
        "images_per_second_mean": sum(rates) / n,
        "images_per_second_min": min(rates),
        "images_per_second_max": max(rates),
        "images_per_second_p90": percentile(rates, 10),
        "images_per_second_average": float(batches.sum()) / elapsed,
        "latency_ms_median": percentile(latency_ms, 50),
        "latency_ms_mean": sum(latency_ms) / n,
        **{f"latency_ms_p{q}": percentile(latency_ms, q) for q in (90, 95, 99)},
        "global_batch_size": percentile(global_batch.tolist(), 50),
        "iterations": float(n),
        "world_size": float(world_size),
    }


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak memory in bytes and its kind: CUDA's ``max_memory_allocated``, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process_peak_rss"


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` on CUDA, else the CPU model (``/proc/cpuinfo``) or ``platform`` info."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def dali_version() -> str | None:
    """Installed NVIDIA DALI version, or ``None`` (DALI is optional for benchmarks)."""
    for dist in ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110", "nvidia-dali"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def format_table(results: Mapping[str, Any]) -> str:
    """``benchmark.json`` content as a line saying what ran and a padded two-column table (``.2f``)."""
    s = results["statistics"]
    head = (
        f"{results['mode']} benchmark: {results.get('model')} ({results.get('backbone')}), "
        f"{int(results['world_size'])} x {results.get('batch_size_per_device')} images, "
        f"{results.get('precision')}, channels_last={results.get('channels_last')}, "
        f"data loading {'timed' if results.get('include_data_loading') else 'excluded'}, "
        f"{int(s['iterations'])} iterations after {results.get('warmup')} warm-up, "
        f"{results.get('device_name')}"
    )
    rows = [(f"img/s {k}", s[f"images_per_second_{k}"]) for k in ("median", "mean", "min", "max")]
    rows += [("img/s p90 (90% reach)", s["images_per_second_p90"])]
    rows += [("img/s all images/time", s["images_per_second_average"])]
    rows += [(f"latency ms {k}", s[f"latency_ms_{k}"]) for k in ("median", "p90", "p99")]
    rows += [(f"peak memory MiB ({results.get('peak_memory_kind')})", results["peak_memory_bytes"] / 2**20)]
    table = markdown_table(("statistic", "value"), [(n, f"{v:.2f}") for n, v in rows], align="lr", pad=True)
    return head + "\n" + table


def _batch_size(batch: Any) -> int:
    """Images in a batch: ``batch["images"]`` of a dict batch, else the first tensor's leading dimension."""
    if isinstance(batch, Mapping):
        batch = batch["images"] if "images" in batch else next(iter(batch.values()))
    while isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if isinstance(batch, Tensor):
        return int(batch.shape[0])
    raise ValueError(f"cannot tell the batch size of a batch of type {type(batch).__name__}")


def gather_rows(
    trainer: pl.Trainer, values: Sequence[float], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """This rank's ``values`` -> (world size, len(values)) on every rank (one ``all_gather``)."""
    gathered = trainer.strategy.all_gather(torch.tensor(values, dtype=dtype, device=device))
    return gathered if gathered.dim() == 2 else gathered.unsqueeze(0)


def _measuring(mode: str, action: Callable[..., None]) -> Callable[..., None]:
    """A Lightning hook: ``action`` when the benchmark measures ``mode``, never in the sanity check."""

    def hook(
        self: ThroughputBenchmark, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        if self.mode == mode and not trainer.sanity_checking:
            action(self, trainer, pl_module, *args)

    return hook


class ThroughputBenchmark(pl.Callback):
    """Images/s of ``iterations`` batches of ``mode`` after ``warmup`` (the module docstring says what is
    timed), kept in ``results`` and written to ``output_dir/benchmark.json``; ``config_summary`` (the run's
    settings) goes into the table and the file, its ``backbone``/``channels_last`` winning over what is read
    from the model; ``clock`` is the timer (tests pass a fake one); ``print_table``: rank 0 prints it."""

    def __init__(
        self,
        mode: str = "training",
        *,
        warmup: int = 100,
        iterations: int = 200,
        include_data_loading: bool = False,
        output_dir: str | os.PathLike | None = None,
        config_summary: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        print_table: bool = True,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if int(warmup) < 0:
            raise ValueError(f"warmup must be >= 0 iterations, got {warmup}")
        if int(iterations) < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        self.mode, self.warmup, self.iterations = mode, int(warmup), int(iterations)
        self.include_data_loading = bool(include_data_loading)
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.config_summary: dict[str, Any] = dict(config_summary or {})
        self.clock, self.print_table = clock, print_table
        self.results: dict[str, Any] | None = None
        self.statistics: dict[str, float] | None = None
        self._reset()

    @property
    def total_iterations(self) -> int:
        return self.warmup + self.iterations

    @property
    def iteration_times(self) -> list[float]:
        """Seconds of each timed iteration on this rank (warm-up excluded), in order."""
        return list(self._times)

    def _reset(self, *_: Any) -> None:
        self._seen = 0  # iterations finished (warm-up included)
        self._times: list[float] = []
        self._batches: list[int] = []
        self._since: float | None = None  # the open timed region's start
        self._finished = False

    def _now(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return self.clock()

    @property
    def _timing(self) -> bool:
        return self.warmup <= self._seen < self.total_iterations

    def _loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._seen == 0 and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)  # peak of this measured loop only
        if self.include_data_loading and self._seen < self.total_iterations:
            self._since = self._now(pl_module.device)

    def _batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        if not self.include_data_loading and self._timing:
            self._since = self._now(pl_module.device)

    def _batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        if self._seen < self.total_iterations:
            if self._timing or self.include_data_loading:
                now = self._now(pl_module.device)
                if self._timing and self._since is not None:
                    self._times.append(now - self._since)
                    self._batches.append(_batch_size(batch))
                self._since = now  # the next one's start, when data loading is timed
            self._seen += 1
        if self._seen >= self.total_iterations and self.mode == "training":
            trainer.should_stop = True

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._finished:
            return
        self._finished = True
        device = pl_module.device
        # ranks agree on the number of timed iterations first: all_gather needs equal shapes
        n = int(gather_rows(trainer, [len(self._times)], torch.int64, device).min())
        if n < self.iterations:
            log.warning(
                "throughput benchmark timed %d of %d iterations (the loop ended first: give it at least "
                "warmup + iterations = %d batches, e.g. more data or data.steps_per_epoch)",
                *(n, self.iterations, self.total_iterations),
            )
        if n == 0:
            return
        times = gather_rows(trainer, self._times[:n], torch.float64, device)
        batches = gather_rows(trainer, self._batches[:n], torch.int64, device)
        memory, memory_kind = peak_memory(device)
        memory = int(gather_rows(trainer, [memory], torch.int64, device).max())  # the largest rank's
        self.statistics = {**throughput_statistics(times, batches), "peak_memory_mib": memory / 2**20}
        self.results = self._describe(trainer, pl_module, batches, (memory, memory_kind))
        if trainer.is_global_zero:
            out_dir = self.output_dir or Path(trainer.default_root_dir)
            path = atomic_write_json(out_dir / RESULTS_FILENAME, self.results, indent=2)
            if self.print_table:
                print(format_table(self.results) + f"\nwritten to {path}", flush=True)

    def _describe(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches: Tensor, memory: tuple[int, str]
    ) -> dict[str, Any]:
        net, statistics = getattr(pl_module, "net", None), self.statistics
        summary, device = self.config_summary, pl_module.device
        # what ran, not the config: compiled in place (module.compile()) or wrapped (torch.compile(module))
        modules = [m for m in (pl_module, net) if m is not None]
        compiled = any(
            compat.is_compiled_in_place(m) or type(m).__name__ == "OptimizedModule" for m in modules
        )
        return {
            "mode": self.mode,
            "model": type(pl_module).__name__,
            "net": type(net).__name__ if net is not None else None,
            "backbone": summary.get("backbone", getattr(net, "backbone_name", None)),
            "batch_size_per_device": int(Counter(batches.flatten().tolist()).most_common(1)[0][0]),
            "global_batch_size": statistics["global_batch_size"],
            "world_size": int(trainer.world_size),
            "precision": str(trainer.precision),
            "channels_last": bool(summary.get("channels_last", getattr(pl_module, "channels_last", False))),
            "compile": compiled,
            "include_data_loading": self.include_data_loading,
            "warmup": self.warmup,
            "iterations": int(statistics["iterations"]),
            "device": device.type,
            "device_name": device_name(device),
            "torch_version": torch.__version__,
            "dali_version": dali_version(),
            "peak_memory_bytes": memory[0],
            "peak_memory_kind": memory[1],
            "statistics": statistics,
            "config": {k: v for k, v in summary.items() if _is_jsonable(v)},
            "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }

    # Lightning hooks: the train loop measures training; the validation and predict loops, inference
    on_train_start = _measuring("training", _reset)
    on_train_epoch_start = _measuring("training", _loop_start)
    on_train_batch_start = _measuring("training", _batch_start)
    on_train_batch_end = _measuring("training", _batch_end)
    on_train_end = _measuring("training", _finish)
    on_validation_start = _measuring("inference", _reset)
    on_validation_epoch_start = _measuring("inference", _loop_start)
    on_validation_batch_start = _measuring("inference", _batch_start)
    on_validation_batch_end = _measuring("inference", _batch_end)
    on_validation_end = _measuring("inference", _finish)
    on_predict_start = _measuring("inference", _reset)
    on_predict_epoch_start = _measuring("inference", _loop_start)
    on_predict_batch_start = _measuring("inference", _batch_start)
    on_predict_batch_end = _measuring("inference", _batch_end)
    on_predict_end = _measuring("inference", _finish)


def _is_jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
