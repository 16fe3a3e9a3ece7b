"""Redraw ``curves.png`` (training loss, LR, validation mAP) from the CSV log of runs or sweeps.

    python scripts/plot_run.py outputs/demo/2026-01-01_12-00-00          # -> <run>/curves.png
    python scripts/plot_run.py multirun/2026-01-01/12-00-00               # sweep: one line per job
    python scripts/plot_run.py RUN_A RUN_B --output compare.png           # several runs in one figure

A run directory holds ``csv/metrics.csv`` (CSVLogger, ``logger=default`` or ``csv``). A directory without
one is treated as a multirun sweep: every ``<dir>/<job>/csv/metrics.csv`` becomes one line, labelled with
the job's overrides (``<job>/.hydra/overrides.yaml``) or its folder name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from ssd_lightning.visualize import plot_curves

METRICS = Path("csv") / "metrics.csv"


def _job_label(job_dir: Path) -> str:
    overrides = job_dir / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        items = yaml.safe_load(overrides.read_text()) or []
        # the overrides shared by every job (experiment=...) only add noise; keep the swept ones short
        short = [str(o) for o in items if not str(o).startswith(("experiment=", "hydra."))]
        if short:
            return f"{job_dir.name}: " + " ".join(short)
    return job_dir.name


def find_runs(directory: Path) -> dict[str, Path]:
    """label -> metrics.csv for a run directory (one entry) or a sweep directory (one per job)."""
    if (directory / METRICS).is_file():
        return {directory.name: directory / METRICS}
    jobs = sorted(
        (p.parent.parent for p in directory.glob(f"*/{METRICS.as_posix()}")),
        key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name),
    )
    if not jobs:
        raise FileNotFoundError(
            f"{directory}: no {METRICS} in it nor in its subfolders; give a run directory (outputs/<task>/"
            "<date>_<time>) or a multirun sweep directory, from a run logged with logger=default or csv"
        )
    return {_job_label(job): job / METRICS for job in jobs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run or multirun sweep directories")
    parser.add_argument(
        "--output", type=Path, help="one figure with every run; default: <dir>/curves.png for each directory"
    )
    args = parser.parse_args(argv)
    for directory in args.runs:
        if not directory.is_dir():
            parser.error(f"{directory} is not a directory")
    found = {d: find_runs(d) for d in args.runs}
    if args.output is not None:
        merged: dict[str, Path] = {}
        for d, runs in found.items():
            for label, path in runs.items():
                merged[label if label not in merged else f"{d}/{label}"] = path
        written = [plot_curves(merged, args.output)]
    else:
        written = [plot_curves(runs, d / "curves.png", title=str(d)) for d, runs in found.items()]
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
