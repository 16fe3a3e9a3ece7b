"""``summary.csv`` and ``summary.md`` of a Hydra multirun: one row per job, its overrides and final metrics.

Each job writes ``<job dir>/.hydra/job_summary.json`` and refreshes the tables, so a sweep stopped by a
failed job still has them. Imports no torch or Lightning.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import numbers
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from ssd_lightning import compat
from ssd_lightning.io.atomic import atomic_write_text
from ssd_lightning.metrics_csv import read_last_metrics
from ssd_lightning.tables import markdown_table

RECORD_NAME = "job_summary.json"


def launcher_rank() -> int:
    """This process's rank as its launcher set it (``RANK``, ``SLURM_PROCID``, ``LOCAL_RANK``,
    ``SUBMITIT_LOCAL_GLOBALID``), else 0: every rank runs ``train.py`` and Hydra's callbacks."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "SUBMITIT_LOCAL_GLOBALID"):
        value = os.environ.get(var, "")
        if value.strip().isdigit():
            return int(value)
    return 0


def _fmt(value: Any) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


TABLE_METRICS = ("val/mAP", "val/mAP_50", "val/mAP_best", "val/acc1", "val/acc5", "val/acc1_best",
                 "train/loss_epoch")  # fmt: skip


def write_summary(sweep_dir: str | Path, table_metrics: Iterable[str] = TABLE_METRICS) -> tuple[Path, Path]:
    """Write ``summary.csv`` (every metric, the ``optimized_metric`` first, full precision; overrides that
    vary across jobs) and ``summary.md`` (the returned metric and ``table_metrics`` matches, 4 significant
    digits, shared overrides, failed jobs' errors) in ``sweep_dir``; return their paths.
    """
    sweep_dir, jobs = Path(sweep_dir), []
    for path in sweep_dir.rglob(RECORD_NAME):
        try:
            jobs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being written by a concurrent job; the next refresh picks it up
    jobs.sort(key=lambda r: (r.get("num", -1), r.get("output_dir", "")))
    lists = [list(job.get("overrides") or []) for job in jobs]
    shared = set(lists[0]).intersection(*map(set, lists[1:])) if len(lists) > 1 else set()
    varying = [[o for o in overrides if o not in shared] for overrides in lists]
    common = [o for o in lists[0] if o in shared] if lists else []
    first = next((j["optimized_metric"] for j in jobs if j.get("optimized_metric")), None)
    names = sorted({k for j in jobs for k in (j.get("metrics") or {})}, key=lambda n: (n != first, n))

    header = ["job", "overrides", "status", *names, "output_dir"]
    rows = [
        [job.get("num"), " ".join(overrides), job.get("status"), *map((job.get("metrics") or {}).get, names)]
        + [job.get("output_dir")]
        for job, overrides in zip(jobs, varying, strict=True)
    ]

    buffer = io.StringIO()
    csv.writer(buffer).writerows([header, *(["" if v is None else v for v in row] for row in rows)])
    csv_path = atomic_write_text(sweep_dir / "summary.csv", buffer.getvalue())

    lines = [f"# Sweep summary: {sweep_dir}", ""]
    if common:
        lines += ["Shared overrides: " + " ".join(f"`{o}`" for o in common), ""]
    patterns = tuple(table_metrics)
    shown = [i for i, n in enumerate(names) if n == first or any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    md_header = ["job", "overrides", "status", *[names[i] for i in shown]]
    md_rows = [
        [_fmt(row[0]), f"`{row[1]}`" if row[1] else "", _fmt(row[2]), *[_fmt(row[3 + i]) for i in shown]]
        for row in rows
    ]
    lines.append(markdown_table(md_header, md_rows, align="rll" + "r" * len(shown)))
    for job in (j for j in jobs if j.get("status") != JobStatus.COMPLETED.name):
        lines += ["", f"Job {job.get('num')} {job.get('status')}: {job.get('error') or ''}".rstrip()]
    return csv_path, atomic_write_text(sweep_dir / "summary.md", "\n".join(lines) + "\n")


class SweepSummary(Callback):
    """Hydra callback writing a multirun's summaries of each job's ``metrics_file``."""

    def __init__(
        self,
        metrics: Sequence[str] = ("val/*", "train/*_epoch"),
        metrics_file: str = "csv/metrics.csv",
        table_metrics: Sequence[str] = TABLE_METRICS,
    ) -> None:
        self.metrics = tuple(metrics)
        self.metrics_file = metrics_file
        self.table_metrics = tuple(table_metrics)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.get("mode") != RunMode.MULTIRUN or launcher_rank() != 0:
            return
        hydra_cfg = job_return.hydra_cfg.hydra if job_return.hydra_cfg is not None else config.hydra
        output_dir = Path(hydra_cfg.runtime.output_dir)
        metrics = read_last_metrics(output_dir / self.metrics_file, self.metrics)
        optimized = config.get("optimized_metric")
        error = None
        if job_return.status == JobStatus.COMPLETED:
            returned = job_return.return_value  # train.main's: a float or None
            if optimized and isinstance(returned, numbers.Real) and not isinstance(returned, bool):
                metrics[optimized] = float(returned)  # what train() returned is the reference value
        else:
            exc = compat.job_return_value(job_return)  # the property re-raises for failed jobs
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        record = {
            "num": int(hydra_cfg.job.num),
            "overrides": list(job_return.overrides or []),
            "status": job_return.status.name,
            "error": error,
            "optimized_metric": optimized,
            "metrics": metrics,
            "output_dir": str(output_dir),
        }
        subdir = hydra_cfg.get("output_subdir")
        record_dir = output_dir / subdir if subdir else output_dir
        atomic_write_text(record_dir / RECORD_NAME, json.dumps(record, indent=2) + "\n")
        write_summary(config.hydra.sweep.dir, table_metrics=self.table_metrics)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if launcher_rank() == 0 and Path(config.hydra.sweep.dir).is_dir():
            write_summary(config.hydra.sweep.dir, table_metrics=self.table_metrics)
