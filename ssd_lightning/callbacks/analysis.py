"""The model's mistakes after each evaluation: PR curves and a detection confusion matrix, on rank 0."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl

from ssd_lightning.callbacks.coco_map import CocoMAPCallback, EvaluatedEpoch
from ssd_lightning.callbacks.evaluation_artifacts import EvaluationArtifacts
from ssd_lightning.error_analysis import (
    detection_confusion_matrix,
    ground_truth_array,
    pr_curves_from_precision,
    top_confusions,
)
from ssd_lightning.io.atomic import atomic_write_json
from ssd_lightning.visualize import log_picture, plot_confusion_matrix, plot_pr_curves

__all__ = ["DetectionAnalysis"]

log = logging.getLogger(__name__)

PR_IOUS: tuple[float, ...] = (0.5, 0.75)


class DetectionAnalysis(EvaluationArtifacts):
    """What the detector gets wrong, from :class:`CocoMAPCallback`'s own evaluation: on rank 0, after each,
    ``<output_dir>/analysis/epoch_<e>/pr_curves.json``/``.png`` (precision at 101 recall points per class and
    for all, IoU 0.5 and 0.75) and ``confusion_matrix.json``/``.png`` (at ``confusion_iou`` in (0, 1] and
    ``confusion_score_thresh``; top three confusions logged), pictures also to a ``TensorBoardLogger``.
    Cadence: ``every_n_evals``; the sanity check draws nothing; a failure warns once, never fatal."""

    def __init__(
        self,
        *,
        output_dir: str | os.PathLike | None = None,
        pr_curves: bool = True,
        confusion: bool = True,
        confusion_iou: float = 0.5,
        confusion_score_thresh: float = 0.3,
        every_n_evals: int = 1,
    ) -> None:
        super().__init__(output_dir=output_dir, every_n_evals=every_n_evals)
        if not 0.0 < confusion_iou <= 1.0:
            raise ValueError(f"confusion_iou must be in (0, 1], got {confusion_iou}")
        self.pr_curves, self.confusion = pr_curves, confusion
        self.confusion_iou, self.confusion_score_thresh = float(confusion_iou), float(confusion_score_thresh)

    def _coco_callback(self, trainer: pl.Trainer) -> CocoMAPCallback | None:
        found = [cb for cb in trainer.callbacks if isinstance(cb, CocoMAPCallback)]
        main = [cb for cb in found if cb.detections_key == "detections"]  # the run's weights (val/*)
        return (main or found or [None])[0]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        wanted = self.pr_curves or self.confusion
        if wanted and trainer.is_global_zero and self._coco_callback(trainer) is None:
            log.info("DetectionAnalysis: no CocoMAPCallback (callbacks.coco_map) to read from; no analysis")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        due = self._count_evaluation(trainer)
        coco = self._coco_callback(trainer)
        evaluated = coco.take_evaluation() if coco is not None else None
        if evaluated is None or not (due and trainer.is_global_zero and (self.pr_curves or self.confusion)):
            return
        try:
            self.analyse(evaluated, self._out_dir(trainer), trainer)
        except Exception as e:  # a picture must never end a training run
            self._warn_once(f"error:{type(e).__name__}", f"could not write the analysis: {e}")

    def analyse(self, evaluated: EvaluatedEpoch, run_dir: Path, trainer: pl.Trainer | None = None) -> Path:
        """Write the files of one evaluation under ``run_dir/analysis/epoch_<e>``; returns that folder."""
        folder = run_dir / "analysis" / f"epoch_{evaluated.epoch}"
        names = [row.name or str(row.category_id) for row in evaluated.evaluation.classes]
        title = f"{run_dir.name}: epoch {evaluated.epoch}"
        pictures = {}
        if self.pr_curves:
            pictures["analysis/pr_curves"] = self._write_pr_curves(evaluated.evaluation, names, folder, title)
        if self.confusion:
            pictures["analysis/confusion_matrix"] = self._write_confusion(evaluated, names, folder, title)
        for tag, path in pictures.items() if trainer is not None else ():
            log_picture(trainer.loggers, tag, path, trainer.global_step)
        log.info("DetectionAnalysis: wrote %s", folder)
        return folder

    def _write_pr_curves(self, ev: Any, names: list[str], folder: Path, title: str) -> Path:
        indices = {"area_index": ev.area_index, "max_dets_index": ev.max_dets_index}
        curves = pr_curves_from_precision(
            ev.precision, ev.iou_thresholds, ev.recall_thresholds, ious=PR_IOUS, **indices
        )

        def curve(ap: float, precision: np.ndarray) -> dict[str, Any]:  # NaN: null
            points = None if np.isnan(precision).all() else [float(v) for v in precision]
            return {"AP": float(ap) if math.isfinite(ap) else None, "precision": points}

        def classes(i: int) -> list[dict[str, Any]]:
            return [
                {"category_id": row.category_id, "name": row.name, "num_gt": row.num_gt}
                | curve(curves.ap[i, k], curves.precision[i, k])
                for k, row in enumerate(ev.classes)
            ]

        record = {"area": "all", "max_dets": ev.max_dets, "recall": curves.recall.tolist()}
        record["curves"] = [
            {"iou": float(iou)} | curve(curves.all_ap[i], curves.all_precision[i]) | {"classes": classes(i)}
            for i, iou in enumerate(curves.iou_thresholds)
        ]
        atomic_write_json(folder / "pr_curves.json", record, allow_nan=False)
        arrays = (curves.recall, curves.precision, curves.ap, curves.all_precision, curves.all_ap)
        return plot_pr_curves(
            *arrays, curves.iou_thresholds.tolist(), names, folder / "pr_curves.png",
            title=f"{title}: precision/recall (area all, {ev.max_dets} detections per image)",
        )  # fmt: skip

    def _write_confusion(self, evaluated: EvaluatedEpoch, names: list[str], folder: Path, title: str) -> Path:
        ev = evaluated.evaluation
        thresholds = {"iou_threshold": self.confusion_iou, "score_threshold": self.confusion_score_thresh}
        gt = ground_truth_array(ev.gt_dataset.get("annotations", []))
        matrix = detection_confusion_matrix(
            evaluated.detections, gt, ev.category_ids, image_ids=ev.image_ids, **thresholds
        )
        labels = [*names, "background"]
        top = top_confusions(matrix, 3)
        record = {
            **thresholds,
            "rows": "true class (last: background = false positives)",
            "columns": "predicted class (last: background = missed ground truth)",
            "category_ids": [int(c) for c in ev.category_ids],
            "names": labels,
            "matrix": matrix.tolist(),
            "top_confusions": [{"true": labels[t], "predicted": labels[p], "count": n} for t, p, n in top],
        }
        atomic_write_json(folder / "confusion_matrix.json", record, allow_nan=False)
        if top:
            text = ", ".join(f"{labels[t]} -> {labels[p]} ({n})" for t, p, n in top)
            log.info(
                "DetectionAnalysis: epoch %d, top confusions (true -> predicted): %s", evaluated.epoch, text
            )
        title += f"\ndetections: IoU >= {self.confusion_iou:g}, score >= {self.confusion_score_thresh:g}"
        return plot_confusion_matrix(
            matrix, labels, folder / "confusion_matrix.png", title=title + "; share of each true row"
        )
