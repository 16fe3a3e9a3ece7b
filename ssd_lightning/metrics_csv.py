"""Read the ``metrics.csv`` that Lightning's ``CSVLogger`` writes: the one reader of run metrics.

Standard library only (Hydra callbacks import it in every job)."""

from __future__ import annotations

import contextlib
import csv
import fnmatch
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = ["BOOKKEEPING", "last_values", "read_last_metrics", "read_metrics_csv"]

BOOKKEEPING = ("epoch", "step")  # the x axes of every row: never a metric


def read_metrics_csv(path: str | os.PathLike) -> list[dict[str, float]]:
    """Rows of a ``metrics.csv`` in file order, each a dict of floats; empty and non-numeric cells left out.
    FileNotFoundError (saying where CSVLogger writes it) if there is no such file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no metrics file at {path}; CSVLogger writes <run dir>/csv/metrics.csv (logger=default or csv)"
        )
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for raw in csv.DictReader(f):
            rows.append({})
            for key, value in raw.items():
                with contextlib.suppress(ValueError, TypeError):  # empty, non-numeric, missing (None)
                    rows[-1][key] = float(value)
    return rows


def last_values(rows: Sequence[Mapping[str, float]], patterns: Iterable[str] = ("*",)) -> dict[str, float]:
    """Last value of each column (but epoch, step) matching an ``fnmatch`` pattern, first appearance order."""
    patterns = tuple(patterns)
    last: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key not in BOOKKEEPING and any(fnmatch.fnmatchcase(key, p) for p in patterns):
                last[key] = value
    return last


def read_last_metrics(metrics_csv: str | os.PathLike, patterns: Iterable[str] = ("*",)) -> dict[str, float]:
    """:func:`last_values` of a ``metrics.csv``; ``{}`` without one (logged elsewhere, failed early)."""
    return last_values(read_metrics_csv(metrics_csv), patterns) if Path(metrics_csv).is_file() else {}
