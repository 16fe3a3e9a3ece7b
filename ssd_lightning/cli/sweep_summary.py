"""``summary.csv`` and ``summary.md`` of a Hydra multirun: one row per job, its overrides and final metrics.

Registered in ``configs/hydra/default.yaml``. Each job (rank 0, where it ran) writes
``<job dir>/.hydra/job_summary.json`` (number, overrides, status, error, the returned ``optimized_metric``,
the last values of ``csv/metrics.csv``) and refreshes the tables, so a sweep stopped by a failed job still
has them; ``on_multirun_end`` writes the final ones. Any launcher gives the same table. Imports only the
standard library, Hydra, OmegaConf and the package's stdlib-only leaves.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
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


def _to_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def launcher_rank() -> int:
    """This process's rank as the launcher set it (``RANK``, ``SLURM_PROCID``, ``LOCAL_RANK``,
    ``SUBMITIT_LOCAL_GLOBALID``), else 0. Lightning's DDP launcher re-runs ``train.py`` (a multirun too) for
    the other ranks, and every submitit task runs the Hydra job's callbacks: only rank 0 may write."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "SUBMITIT_LOCAL_GLOBALID"):
        value = os.environ.get(var, "")
        if value.strip().isdigit():
            return int(value)
    return 0


def collect_jobs(sweep_dir: str | Path) -> list[dict]:
    """Every job record (``job_summary.json``) under ``sweep_dir``, sorted by job number."""
    records = []
    for path in Path(sweep_dir).rglob(RECORD_NAME):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being written by a concurrent job; the next refresh picks it up
    return sorted(records, key=lambda r: (r.get("num", -1), r.get("output_dir", "")))


def _varying_overrides(jobs: Sequence[dict]) -> tuple[list[list[str]], list[str]]:
    """Per job, the overrides that not every job shares; and the shared ones (all of them for one job)."""
    lists = [list(job.get("overrides") or []) for job in jobs]
    if len(lists) < 2:
        return lists, []
    common = set(lists[0]).intersection(*map(set, lists[1:]))
    return [[o for o in overrides if o not in common] for overrides in lists], [
        o for o in lists[0] if o in common
    ]


def _fmt(value: Any) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


TABLE_METRICS = ("val/mAP", "val/mAP_50", "val/mAP_best", "val/acc1", "val/acc5", "val/acc1_best",
                 "train/loss_epoch")  # fmt: skip


def write_summary(
    sweep_dir: str | Path, jobs: Sequence[dict] | None = None, table_metrics: Iterable[str] = TABLE_METRICS
) -> tuple[Path, Path]:
    """Write ``summary.csv`` (every metric, full precision) and ``summary.md`` in ``sweep_dir``; return them.

    CSV columns: ``job``, ``overrides`` (those that vary across jobs), ``status``, every metric (sorted, the
    returned ``optimized_metric`` first), ``output_dir``. The markdown table has the returned metric and
    those matching ``table_metrics`` (``fnmatch``), 4 significant digits, the shared overrides and the errors
    of failed jobs. ``jobs`` defaults to :func:`collect_jobs` of ``sweep_dir``.
    """
    sweep_dir = Path(sweep_dir)
    jobs = collect_jobs(sweep_dir) if jobs is None else list(jobs)
    varying, common = _varying_overrides(jobs)
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
    """Hydra callback writing ``summary.csv``/``summary.md`` in the sweep directory of a multirun: the
    ``metrics`` (``fnmatch`` patterns; the returned ``optimized_metric`` always) of each job's
    ``metrics_file`` (relative to its output directory), those of ``table_metrics`` in ``summary.md``."""

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
            returned = _to_float(job_return.return_value)
            if optimized and returned is not None:
                metrics[optimized] = returned  # what train() returned is the reference value
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
