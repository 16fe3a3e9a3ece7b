"""Detections drawn on a few validation images after evaluations, for a person to look at during training."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
from PIL import Image, ImageOps

from ssd_lightning.callbacks.evaluation_artifacts import EvaluationArtifacts, from_datamodule
from ssd_lightning.visualize import draw_detections

__all__ = ["PredictionPictures"]

log = logging.getLogger(__name__)


class PredictionPictures(EvaluationArtifacts):
    """After evaluations, rank 0 draws predictions (score >= ``score_thresh``) over the ground truth (green)
    on the first ``max_images`` validation images it sees, ``<output_dir>/predictions/epoch_<e>/<id>.jpg``,
    enlarged if the longer side is under ``min_display_size`` (0: never). ``image_dir``, ``annotation_file``,
    ``category_map``: default the datamodule's ``val_images``, ``val_annotation_file``, ``category_map``.
    Cadence: ``every_n_evals``; the sanity check draws nothing; a problem warns once, never fatal."""

    def __init__(
        self,
        *,
        output_dir: str | os.PathLike | None = None,
        max_images: int = 8,
        every_n_evals: int = 1,
        score_thresh: float = 0.3,
        min_display_size: int = 480,
        image_dir: str | os.PathLike | None = None,
        annotation_file: str | os.PathLike | None = None,
        category_map: Any = None,
    ) -> None:
        if max_images < 0:
            raise ValueError(f"max_images must be >= 0, got {max_images}")
        super().__init__(output_dir=output_dir, every_n_evals=every_n_evals)
        if min_display_size < 0:
            raise ValueError(f"min_display_size must be >= 0, got {min_display_size}")
        self.max_images, self.score_thresh, self.min_display_size = max_images, score_thresh, min_display_size
        self.image_dir, self.annotation_file, self.category_map = image_dir, annotation_file, category_map
        self._active = False
        self._collected: list[dict[str, Any]] = []
        self._annotations: tuple[Path, dict[int, dict], dict[int, list[dict]]] | None = None

    def _load_annotations(self, path: Path) -> tuple[dict[int, dict], dict[int, list[dict]]]:
        if self._annotations is None or self._annotations[0] != path:
            data = json.loads(path.read_text(encoding="utf-8"))
            anns: dict[int, list[dict]] = defaultdict(list)
            for ann in data.get("annotations", []):
                anns[int(ann["image_id"])].append(ann)
            self._annotations = (path, {int(img["id"]): img for img in data.get("images", [])}, anns)
        return self._annotations[1], self._annotations[2]

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collected = []
        wanted = trainer.is_global_zero and not trainer.sanity_checking and self.max_images > 0
        self._active = wanted and self._is_due(trainer)

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any
    ) -> None:
        if not self._active or len(self._collected) >= self.max_images:
            return
        if not isinstance(outputs, Mapping) or "detections" not in outputs:
            self._warn_once("outputs", "validation_step did not return {'detections': [...]}; no pictures")
            self._active = False
            return
        for det in outputs["detections"][: self.max_images - len(self._collected)]:
            kept = {k: det[k].detach().cpu() for k in ("boxes", "scores", "labels")}
            self._collected.append({"image_id": int(det["image_id"]), **kept})

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._count_evaluation(trainer)
        if trainer.is_global_zero and self._collected:
            try:
                self._write_pictures(trainer)
            except Exception as e:  # a picture must never end a training run
                self._warn_once(f"pictures:{type(e).__name__}", f"could not draw pictures: {e}")
        self._collected = []

    def _write_pictures(self, trainer: pl.Trainer) -> None:
        image_dir = from_datamodule(trainer, self.image_dir, "val_images")
        ann_file = from_datamodule(trainer, self.annotation_file, "val_annotation_file")
        cmap = from_datamodule(trainer, self.category_map, "category_map")
        if image_dir is None or ann_file is None:
            self._warn_once(
                "inputs",
                "needs the validation image folder and annotation file: a datamodule with `val_images` and "
                "`val_annotation_file`, or image_dir= and annotation_file=; no pictures",
            )
            return
        images, anns = self._load_annotations(Path(ann_file))
        folder = self._out_dir(trainer) / "predictions" / f"epoch_{trainer.current_epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        for det in self._collected:
            info = images.get(det["image_id"])
            if info is None:
                self._warn_once("id", f"image id {det['image_id']} is not in {ann_file}; skipped")
                continue
            picture = self._draw(
                det, Path(image_dir) / info["file_name"], anns.get(det["image_id"], []), cmap
            )
            picture.save(folder / f"{det['image_id']}.jpg", quality=92, subsampling=0)  # 4:4:4: crisp lines
        log.info("PredictionPictures: wrote %d pictures to %s", len(self._collected), folder)

    def _draw(self, det: dict[str, Any], path: Path, anns: list[dict], cmap: Any) -> Image.Image:
        with Image.open(path) as img:
            original = ImageOps.exif_transpose(img).convert("RGB")
        gt = [a for a in anns if "bbox" in a]
        gt_labels = None
        if cmap is not None and gt:
            gt_labels = cmap.category_id_to_label(np.asarray([int(a["category_id"]) for a in gt]))
        longer = max(original.size)
        return draw_detections(
            original,
            det["boxes"],
            det["labels"],
            det["scores"],
            class_names=list(cmap.names) if cmap is not None else None,
            gt_boxes=[[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in gt)],
            gt_labels=gt_labels,
            score_thresh=self.score_thresh,
            scale=self.min_display_size / longer if 0 < longer < self.min_display_size else 1.0,
        )
