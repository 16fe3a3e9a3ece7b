"""A CSV logger that continues a run's ``metrics.csv`` when the run is resumed in place."""

from __future__ import annotations

import csv
import os

from lightning_fabric.loggers.logger import rank_zero_experiment
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter

from ssd_lightning.io.atomic import atomic_write


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued instead of deleted.

    Rows already in the file whose ``step`` is at or past the first step logged now are dropped when the
    first new rows are saved: they were logged after the checkpoint the run resumed from, and the resumed
    run logs those steps again (so the file, and ``curves.png`` drawn from it, stay one continuous run).
    """

    def _check_log_dir_exists(self) -> None:
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
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return self._experiment
