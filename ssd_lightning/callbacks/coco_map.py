"""COCO mAP of each validation pass: official evaluation on rank 0, the same values logged on all ranks."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_warn

from ssd_lightning.callbacks.evaluation_artifacts import from_datamodule
from ssd_lightning.evaluation import (
    BACKENDS,
    COCO_STAT_NAMES,
    DEFAULT_BACKEND,
    ClassAP,
    CocoEvaluation,
    detections_to_coco_array,
    evaluate_coco,
    evaluate_coco_detailed,
    format_per_class_table,
    per_class_metrics,
    per_class_records,
    write_coco_results_json,
)
from ssd_lightning.io.atomic import atomic_write, atomic_write_json

__all__ = ["CocoMAPCallback", "EvaluatedEpoch"]

log = logging.getLogger(__name__)

_EMPTY = np.zeros((0, 7), dtype=np.float64)


def _gather_to_rank_zero(obj: Any, trainer: pl.Trainer) -> list[Any] | None:
    """Pickle-gather ``obj`` from every rank: the list (one entry per rank) on rank 0, ``None`` elsewhere.
    Send numpy arrays, not per-detection objects: an array pickles as one buffer (250k detections: 14 MB)."""
    dist = torch.distributed
    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] | None = [None] * trainer.world_size if trainer.global_rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def _merge_ranks(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, int]:
    """Merge each rank's ``(image_ids (n_r,), rows (m_r, 7))`` (images validated, detections): an image seen
    by several ranks keeps the lowest rank's rows. Returns the sorted distinct image ids, their rows (stably
    sorted by image id) and the number of dropped duplicate images."""
    all_ids = np.concatenate([np.asarray(ids, dtype=np.int64).reshape(-1) for ids, _ in parts])
    owner = np.concatenate([np.full(len(ids), r) for r, (ids, _) in enumerate(parts)])
    image_ids, first = np.unique(all_ids, return_index=True)  # first occurrence = lowest rank
    owner = owner[first]
    kept = [_EMPTY]
    for r, (_, rows) in enumerate(parts):
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, 7)
        kept.append(rows[owner[np.searchsorted(image_ids, rows[:, 0].astype(np.int64))] == r])
    rows = np.concatenate(kept)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    return image_ids, rows, len(all_ids) - len(image_ids)


@dataclass(frozen=True)
class EvaluatedEpoch:
    """What rank 0 keeps of an evaluation for ``DetectionAnalysis``; ``detections``: all ranks' (M, 7)."""

    epoch: int
    evaluation: CocoEvaluation
    detections: np.ndarray


class CocoMAPCallback(Callback):
    """Official COCO bbox mAP of each validation pass (``validation_step``'s ``{"detections": [...]}``, see
    docs/architecture.md), evaluated on rank 0, logged on every rank: ``val/mAP``, ... (``COCO_STAT_NAMES``),
    ``val/mAP_best``/``val/mAP_best_epoch`` while fitting (callback state: survives a resume), with
    ``per_class`` ``val/AP/<name>``/``val/AP50/<name>``. With ``save_detections``, rank 0 writes
    ``detections_epoch_<e>.json`` (and with ``per_class`` ``per_class_epoch_<e>.json``) to ``output_dir``
    (default ``trainer.log_dir``)
    and keeps an :class:`EvaluatedEpoch` for :meth:`take_evaluation`. The sanity check runs the whole path
    but logs nothing; an error on one rank is raised on every rank.

    ``backend``: ``"faster_coco_eval"`` or ``"pycocotools"`` (same numbers, slower); ``verbose``: print the
    summary (and per-class table); ``annotation_file``, ``category_map``: instead of the datamodule's;
    ``prefix``: of the metric names, another than ``val/`` also of the file names (``val_raw_...``);
    ``detections_key``: the output to evaluate, another than ``"detections"`` optional (nothing evaluated
    unless the module's ``validation_output_keys`` name it, e.g. EMA weights).
    """

    def __init__(
        self,
        *,
        backend: str = DEFAULT_BACKEND,
        output_dir: str | os.PathLike | None = None,
        save_detections: bool = True,
        verbose: bool = True,
        annotation_file: str | os.PathLike | None = None,
        category_map: Any = None,
        prefix: str = "val/",
        per_class: bool = True,
        detections_key: str = "detections",
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend, self.save_detections, self.verbose = backend, save_detections, verbose
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.annotation_file, self.category_map = annotation_file, category_map
        self.prefix, self.per_class, self.detections_key = prefix, per_class, detections_key
        self.file_tag = "" if prefix == "val/" else prefix.strip("/").replace("/", "_") + "_"
        self._absent = False
        self.best_map: float | None = None
        self.best_epoch: int | None = None
        self.last_stats: dict[str, float] | None = None
        self._reset()

    def take_evaluation(self) -> EvaluatedEpoch | None:
        """Rank 0: this validation pass's evaluation, handed over once (else, sanity check, failure: None)."""
        evaluated, self._evaluated = self._evaluated, None
        return evaluated

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    def state_dict(self) -> dict[str, Any]:
        return {"best_map": self.best_map, "best_epoch": self.best_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_map = state_dict.get("best_map")
        self.best_epoch = state_dict.get("best_epoch")

    def _resolve(self, trainer: pl.Trainer) -> tuple[Path, Any]:
        ann = from_datamodule(trainer, self.annotation_file, "val_annotation_file")
        cmap = from_datamodule(trainer, self.category_map, "category_map")
        if ann is None or cmap is None:
            raise ValueError(
                "CocoMAPCallback needs the validation annotation file and a category map: give the trainer a "
                "datamodule with `val_annotation_file` and `category_map`, or pass `annotation_file=` and "
                "`category_map=` to CocoMAPCallback"
            )
        return Path(ann), cmap

    def _reset(self) -> None:
        self._per_image: dict[int, np.ndarray] = {}
        self._local_duplicates = 0
        self._error: Exception | None = None
        self._evaluated: EvaluatedEpoch | None = None

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        # decided by the module's settings, the same on every rank (not by the batches a rank happens to see)
        produced = getattr(pl_module, "validation_output_keys", ("detections",))
        self._absent = self.detections_key != "detections" and self.detections_key not in produced

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any
    ) -> None:
        # Converted (and evaluated at epoch end) in the sanity check too: contract errors show up early.
        if self._absent:
            return
        key = self.detections_key
        if not isinstance(outputs, Mapping) or key not in outputs:
            raise ValueError(
                "CocoMAPCallback: validation_step must return {'detections': [per-image dict, ...]} "
                f"(see docs/architecture.md), got {type(outputs).__name__}"
            )
        _, cmap = self._resolve(trainer)
        if self._error is not None:
            return
        try:
            for det in outputs[key]:
                image_id = int(det["image_id"])
                if image_id in self._per_image:
                    self._local_duplicates += 1
                    continue
                self._per_image[image_id] = detections_to_coco_array([det], cmap)
        except Exception as e:  # data-dependent: may hit one rank only; raised on all ranks at epoch end
            self._error = e

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._absent:
            return
        ann_file, _ = self._resolve(trainer)
        sanity, epoch, out_dir = trainer.sanity_checking, trainer.current_epoch, None
        if self.save_detections and not sanity:
            # trainer.log_dir broadcasts from rank 0: called on every rank
            out_dir = self.output_dir or Path(trainer.log_dir or trainer.default_root_dir)
        local_error, message = self._error, None
        if local_error is not None:
            message = f"rank {trainer.global_rank}: {type(local_error).__name__}: {local_error}"
        ids = np.fromiter(self._per_image, dtype=np.int64, count=len(self._per_image))
        rows = np.concatenate(list(self._per_image.values())) if self._per_image else _EMPTY
        gathered = _gather_to_rank_zero((ids, rows, self._local_duplicates, message), trainer)
        self._reset()
        payload: tuple[str, Any] = ("ok", None)
        if gathered is not None:  # rank 0
            errors = [g[3] for g in gathered if g[3] is not None]
            if errors:
                payload = ("error", "; ".join(errors))
            else:
                try:
                    payload = ("ok", self._evaluate(gathered, ann_file, out_dir, epoch, sanity))
                except Exception as e:  # tell the other ranks instead of leaving them waiting in broadcast
                    payload, local_error = ("error", f"rank 0: {type(e).__name__}: {e}"), e
        payload = trainer.strategy.broadcast(payload, src=0)
        if payload[0] == "error":
            if local_error is not None:
                raise local_error
            raise RuntimeError(f"CocoMAPCallback: COCO evaluation failed: {payload[1]}")
        if sanity:
            return
        stats: dict[str, float] = payload[1]
        self.last_stats = stats
        metrics = {f"{self.prefix}{name}": value for name, value in stats.items()}  # the 12, then per class
        if trainer.state.fn == "fit":
            if self.best_map is None or stats["mAP"] > self.best_map:
                self.best_map, self.best_epoch = stats["mAP"], epoch
            metrics[f"{self.prefix}mAP_best"] = float(self.best_map)
            metrics[f"{self.prefix}mAP_best_epoch"] = float(self.best_epoch)
        # The values are already identical on every rank; a max-reduce keeps them exact and tells Lightning
        # the metric is synchronised (no "use sync_dist=True" warning, ModelCheckpoint agrees on all ranks).
        for name, value in metrics.items():
            pl_module.log(name, value, prog_bar=name == f"{self.prefix}mAP", sync_dist=True, reduce_fx="max")

    def _evaluate(
        self, gathered: list[Any], ann_file: Path, out_dir: Path | None, epoch: int, sanity: bool
    ) -> dict[str, float]:
        image_ids, rows, duplicates = _merge_ranks([(ids, rows) for ids, rows, _, _ in gathered])
        duplicates += sum(local_duplicates for _, _, local_duplicates, _ in gathered)
        if duplicates:
            rank_zero_warn(
                f"CocoMAPCallback: dropped {duplicates} duplicate image(s) in the validation outputs (kept "
                "the first). Every validation image must appear exactly once across ranks; look for padding "
                "or a sampler that repeats images."
            )
        if out_dir is not None:
            path = out_dir / f"{self.file_tag}detections_epoch_{epoch}.json"
            atomic_write(path, lambda f: write_coco_results_json(f, rows))  # COCO results JSON
        if len(image_ids) == 0:
            if not sanity:
                rank_zero_warn("CocoMAPCallback: the validation pass produced no images; logging mAP 0")
            return dict.fromkeys(COCO_STAT_NAMES, 0.0)
        if sanity:  # the evaluator runs on the few images seen, so a broken one fails now; nothing is logged
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="evaluating on .* images", category=UserWarning)
                evaluate_coco(ann_file, rows, self.backend, verbose=False, image_ids=image_ids)
            log.info(f"CocoMAPCallback: sanity check evaluated {len(image_ids)} image(s) (not logged)")
            return {}
        ev = evaluate_coco_detailed(ann_file, rows, self.backend, verbose=self.verbose, image_ids=image_ids)
        self._evaluated = EvaluatedEpoch(epoch, ev, rows)
        if not self.per_class:
            return dict(ev.stats)
        self._report_per_class(ev.classes, out_dir, epoch)
        return {**ev.stats, **per_class_metrics(ev.classes)}

    def _report_per_class(self, classes: Sequence[ClassAP], out_dir: Path | None, epoch: int) -> None:
        """Rank 0: ``per_class_epoch_<epoch>.json`` in ``out_dir`` (if any) and, if verbose, the table."""
        if out_dir is not None:
            path = out_dir / f"{self.file_tag}per_class_epoch_{epoch}.json"
            atomic_write_json(path, per_class_records(classes), indent=1, allow_nan=False)
        if self.verbose:
            print(f"Per-class AP (area all, maxDets 100), epoch {epoch}, worst first:")
            print(format_per_class_table(classes))
