"""Test helpers for multi-process runs of `train.py`, added from the command line like any callback/data.

``data._target_=tests.ddp_probes.PerRankSyntheticClassification`` gives every rank its own batches;
``+callbacks.probe._target_=tests.ddp_probes.RecordCollectives`` writes what each rank did per step;
``+callbacks.pause._target_=tests.ddp_probes.PauseForSignal`` holds rank 0 at a step until a signal arrives.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import time
from pathlib import Path

import pytorch_lightning as pl
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ssd_lightning.callbacks import InterruptCheckpoint
from ssd_lightning.data.synthetic import SyntheticClassificationDataModule

# calls that wait for the device on a GPU (counted on the CPU, where they don't)
SYNC_PRONE = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "unique", "cpu"}
FROM_PYTHON = {"tensor", "as_tensor", "scalar_tensor"}  # a host-to-device copy that waits on CUDA
COLLECTIVES = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
    "monitored_barrier",
]


class SyncCounter(TorchFunctionMode):
    """Counts the sync-prone torch calls (``SYNC_PRONE``, ``FROM_PYTHON``) made while ``inside`` names a key
    (a batch index, a step) into ``calls[key][name]``; nothing while ``inside`` is None. Counts inside
    ``with counter:``."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: int | None = None
        self.calls: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.inside is not None and (name in SYNC_PRONE or name in FROM_PYTHON):
            self.calls[self.inside][name] += 1
        return func(*args, **(kwargs or {}))


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


class PerRankSyntheticClassification(SyntheticClassificationDataModule):
    """Synthetic classification batches drawn with ``seed + 1000 * rank``: the ranks see different data."""

    def __init__(self, *, seed: int = 0, **kwargs) -> None:
        super().__init__(seed=seed + 1000 * _rank(), **kwargs)


class RecordCollectives(TorchFunctionMode, pl.Callback):
    """Per training step of this rank: sync-prone torch calls, torch.distributed collectives, loss, acc1.

    Writes ``<directory>/rank_<r>.json`` when training ends: ``{"steps": {global_step: {"syncs": {...},
    "collectives": [...], "loss": float, "acc1": float, "batch_size": int}}, "outside": [...]}``, where a
    step's record covers ``on_train_batch_start`` to the start of the next batch (its epoch-end work
    excluded: that goes to ``outside``).
    """

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.step: int | None = None
        self.syncs: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.collectives: dict[int, list[str]] = collections.defaultdict(list)
        self.outside: list[str] = []
        self.values: dict[int, dict] = {}
        self._originals: dict[str, object] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.step is not None and (name in SYNC_PRONE or name in FROM_PYTHON):
            self.syncs[self.step][name] += 1
        return func(*args, **(kwargs or {}))

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self.step is not None:
                self.collectives[self.step].append(name)
            else:
                self.outside.append(name)
            return original(*args, **kwargs)

        return counted

    def on_train_start(self, trainer, pl_module) -> None:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._originals[name]))
        self.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, self.step = self.step, None  # reading the values below is the test's own sync
        acc1 = trainer.callback_metrics.get("train/acc1_step")
        self.values[step] = {
            "loss": float(outputs["loss"]),
            "acc1": None if acc1 is None else float(acc1),
            "batch_size": len(batch["labels"]),
        }
        self.step = step

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.step = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.step = None
        self.__exit__(None, None, None)
        for name, original in self._originals.items():
            setattr(dist, name, original)
        steps = {
            step: {"syncs": dict(self.syncs[step]), "collectives": self.collectives[step], **values}
            for step, values in self.values.items()
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        out = self.directory / f"rank_{trainer.global_rank}.json"
        out.write_text(json.dumps({"steps": steps, "outside": self.outside}))


class PauseForSignal(pl.Callback):
    """On rank 0 after global step ``step``: writes ``<directory>/paused``, then waits until this process has
    received SIGINT or SIGTERM (at most ``timeout`` s), so that a test's signal lands in the middle of
    training however fast the steps are. The other ranks wait in the next step's gradient all-reduce."""

    def __init__(self, directory: str, step: int, timeout: float = 180.0) -> None:
        self.directory, self.step, self.timeout = Path(directory), step, timeout
        self._done = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._done or trainer.global_step != self.step or trainer.global_rank != 0:
            return
        self._done = True
        interrupt = next(c for c in trainer.callbacks if isinstance(c, InterruptCheckpoint))
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "paused").write_text(str(time.time()))
        deadline = time.monotonic() + self.timeout
        while interrupt._received is None and time.monotonic() < deadline:
            time.sleep(0.02)
        (self.directory / "signalled").write_text(str(time.time()))
