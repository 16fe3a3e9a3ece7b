"""A CSV logger that continues a run's ``metrics.csv`` when the run is resumed in place."""

from __future__ import annotations

import csv
import os

from lightning_fabric.loggers.logger import rank_zero_experiment
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter

from ssd_lightning import compat
from ssd_lightning.io.atomic import atomic_write


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued instead of deleted: at the
    first save, its rows from the first step logged now on are dropped (the resumed run logs them again)."""

    def _check_log_dir_exists(self) -> None:  # Lightning's hook, checked by compat.csv_logger_experiment
        self._continued = os.path.isfile(self.metrics_file_path)
        if self._continued:
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])

    def save(self) -> None:
        if self._continued and self.metrics:
            self._continued = False
            self._drop_rows_from(min(int(row["step"]) for row in self.metrics))
        super().save()

    def _drop_rows_from(self, step: int) -> None:
        with open(self.metrics_file_path, newline="") as f:
            rows = [row for row in csv.DictReader(f) if not row["step"] or int(row["step"]) < step]

        def write(f) -> None:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)

        atomic_write(self.metrics_file_path, write)


class ContinuingCSVLogger(CSVLogger):
    """:class:`~pytorch_lightning.loggers.CSVLogger` that appends to the ``metrics.csv`` of a resumed run
    (``resume=<run dir>``) rather than deleting it, dropping the rows logged after the checkpoint it resumed
    from; in a fresh directory it writes a fresh file, as Lightning's does."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        return compat.csv_logger_experiment(self, _ContinuingWriter)
