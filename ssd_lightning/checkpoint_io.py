"""Checkpoint writing that never leaves a half-written file under a checkpoint's name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.plugins import TorchCheckpointIO

from ssd_lightning.errors import CheckpointWriteError

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``<dir>/.<name>.<pid>.tmp``, fsyncs it, renames it over ``<dir>/<name>``, fsyncs ``<dir>``.

    A run killed during a save, or a disk that fills up, leaves the previous checkpoint of that name intact
    and no temporary file behind (a kill -9 can leave a ``.tmp``, never a truncated ``.ckpt``). Write errors
    become :class:`CheckpointWriteError` naming the file and what to do. Remote URLs (``s3://`` ...) go
    through Lightning's own fsspec writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    self._write(checkpoint, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                _fsync_directory(path.parent)  # make the rename itself durable
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as e:
            kept = f"The previous {path.name} is untouched. " if path.exists() else ""
            raise CheckpointWriteError(
                f"could not write checkpoint {path}: {e.strerror or e}. {kept}Free space there, or write "
                "checkpoints elsewhere with paths.output_dir=... (or callbacks.model_checkpoint.dirpath=...)"
            ) from e

    @staticmethod
    def _write(checkpoint: dict[str, Any], f) -> None:
        torch.save(checkpoint, f)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
