"""Checkpoint writing that never leaves a half-written file under a checkpoint's name, and reading that
never runs code from the file."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.plugins import TorchCheckpointIO

from ssd_lightning.errors import CheckpointWriteError
from ssd_lightning.io.weights import UntrustedCheckpointError, untrusted_message

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``<dir>/.<name>.<pid>.tmp``, fsyncs it, renames it over ``<dir>/<name>``, fsyncs ``<dir>``.

    A kill or a full disk during a save leaves the previous checkpoint intact; write errors become
    :class:`CheckpointWriteError`. Reading uses ``weights_only=True`` unless ``trust_checkpoint`` (Lightning
    leaves it to torch's default, which an environment variable or an http URL turns off).
    """

    def __init__(self, trust_checkpoint: bool = False) -> None:
        super().__init__()
        self.trust_checkpoint = bool(trust_checkpoint)

    def load_checkpoint(
        self,
        path,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        weights_only = not self.trust_checkpoint if weights_only is None else weights_only
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as e:
            if not weights_only:
                raise
            raise UntrustedCheckpointError(untrusted_message("ckpt_path", path, e)) from None

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        needed = _tensor_bytes(checkpoint)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                if shutil.disk_usage(path.parent).free < needed:  # nothing written: nothing to clean up
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                with open(tmp, "wb") as f:
                    self._write(checkpoint, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                directory = os.open(path.parent, os.O_RDONLY)  # fsynced: the rename itself is durable
                try:
                    os.fsync(directory)
                finally:
                    os.close(directory)
            finally:
                tmp.unlink(missing_ok=True)
        except (OSError, RuntimeError) as e:
            # torch's writer reports a failed write (a disk that filled meanwhile) as a RuntimeError
            free = shutil.disk_usage(path.parent).free if path.parent.is_dir() else None
            if isinstance(e, RuntimeError) and (free is None or free >= needed):
                raise
            why = e.strerror if isinstance(e, OSError) and e.strerror else "the disk is full"
            space = f" (it needs about {_mb(needed)}, {_mb(free)} free there)" if free is not None else ""
            kept = f"The previous {path.name} is untouched. " if path.exists() else ""
            raise CheckpointWriteError(
                f"could not write checkpoint {path}: {why}{space}. {kept}Free space in {path.parent}, or "
                "write checkpoints elsewhere: paths.output_dir=... (callbacks.model_checkpoint.dirpath=...)"
            ) from e

    @staticmethod
    def _write(checkpoint: dict[str, Any], f) -> None:
        torch.save(checkpoint, f)


def _tensor_bytes(value: Any) -> int:
    """What the tensors in ``value`` (dicts, lists, tuples of them) hold: a checkpoint's size, nearly."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        value = list(value.values())
    return sum(map(_tensor_bytes, value)) if isinstance(value, (list, tuple)) else 0


def _mb(size: int) -> str:
    return f"{size / 2**20:.0f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
