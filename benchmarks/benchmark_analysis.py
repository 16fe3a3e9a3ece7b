"""Time the error analysis of one evaluation (PR curves, confusion matrix, pictures) next to the evaluation.

Generates a COCO-val-sized ground truth (5,000 images by default, ~7.3 objects per image, 80 category ids,
~1 % crowd) and ``--detections`` per image (jittered copies of the ground truth, 10 % with another class,
then random boxes; scores in [0.05, 1)), runs the COCO evaluation the way ``CocoMAPCallback`` does
(``evaluate_coco_detailed``), then what ``DetectionAnalysis`` adds on rank 0: PR curves read from the
precision array, their JSON and picture, the confusion matrix, its JSON and picture. Prints seconds per
phase (median over ``--repeats``) and the analysis' share of the evaluation.

    python benchmarks/benchmark_analysis.py                      # COCO val size, faster_coco_eval
    python benchmarks/benchmark_analysis.py --images 500         # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ssd_lightning.callbacks.analysis import DetectionAnalysis
from ssd_lightning.callbacks.coco_map import EvaluatedEpoch
from ssd_lightning.error_analysis import (
    detection_confusion_matrix,
    ground_truth_array,
    pr_curves_from_precision,
)
from ssd_lightning.evaluation import BACKENDS, DEFAULT_BACKEND, evaluate_coco_detailed
from ssd_lightning.tables import markdown_table

from benchmark_eval import COCO_CATEGORY_IDS, coco_like_box, coco_like_image  # isort: skip (beside this file)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=5000, help="validation images (COCO val2017: 5,000)")
    p.add_argument("--detections", type=int, default=100, help="detections per image")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND)
    p.add_argument("--repeats", type=int, default=3, help="passes (median reported)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_data(path: Path, num_images: int, per_image: int, seed: int) -> np.ndarray:
    """Write the ground truth to ``path``; return the ``(M, 7)`` detections."""
    rng = np.random.default_rng(seed)
    images, anns, dets = [], [], []
    for image_id in range(1, num_images + 1):
        w, h = coco_like_image(rng, image_id, images)
        rows = []
        for _ in range(int(rng.poisson(7.3))):
            x, y, bw, bh = coco_like_box(rng, w, h)
            cat = int(rng.choice(COCO_CATEGORY_IDS))
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": image_id,
                    "category_id": cat,
                    "bbox": [x, y, bw, bh],
                    "area": bw * bh,
                    "iscrowd": int(rng.random() < 0.01),
                }
            )
            for _ in range(int(rng.integers(1, 4))):
                jitter = rng.normal(0, 0.1, 4) * [bw, bh, bw, bh]
                det_cat = cat if rng.random() < 0.9 else int(rng.choice(COCO_CATEGORY_IDS))
                rows.append(
                    [image_id, x + jitter[0], y + jitter[1], bw + jitter[2], bh + jitter[3], 0, det_cat]
                )
        while len(rows) < per_image:
            bw, bh = rng.uniform(8, 200, 2)
            rows.append(
                [
                    image_id,
                    rng.uniform(0, w - bw),
                    rng.uniform(0, h - bh),
                    bw,
                    bh,
                    0,
                    int(rng.choice(COCO_CATEGORY_IDS)),
                ]
            )
        rows = np.asarray(rows[:per_image], dtype=np.float64)
        rows[:, 5] = rng.uniform(0.05, 1.0, len(rows))
        dets.append(rows)
    cats = [{"id": c, "name": f"category_{c}"} for c in COCO_CATEGORY_IDS]
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    out = np.concatenate(dets)
    out[:, 1:5] = np.round(out[:, 1:5], 3)
    out[:, 5] = np.round(out[:, 5], 5)
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    args = parse_args()
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        ann_file = tmp_dir / "instances_val.json"
        dets = make_data(ann_file, args.images, args.detections, args.seed)
        print(f"{args.images} images, {len(dets)} detections, {len(COCO_CATEGORY_IDS)} categories")
        analysis = DetectionAnalysis()
        for _ in range(args.repeats):
            t_eval, ev = timed(lambda: evaluate_coco_detailed(ann_file, dets, args.backend, verbose=False))
            evaluated = EvaluatedEpoch(0, ev, dets)
            t_pr, _ = timed(
                lambda ev=ev: pr_curves_from_precision(ev.precision, ev.iou_thresholds, ev.recall_thresholds)
            )
            t_gt, gt = timed(lambda ev=ev: ground_truth_array(ev.gt_dataset["annotations"]))
            t_cm, matrix = timed(
                lambda ev=ev, gt=gt: detection_confusion_matrix(
                    dets, gt, ev.category_ids, image_ids=ev.image_ids
                )
            )
            names = [row.name for row in ev.classes]
            t_pr_files, _ = timed(
                lambda ev=ev, names=names: analysis._write_pr_curves(ev, names, tmp_dir / "a", "t")
            )
            t_cm_files, _ = timed(
                lambda evaluated=evaluated, names=names: analysis._write_confusion(
                    evaluated, names, tmp_dir / "a", "t"
                )
            )
            t_all, _ = timed(lambda evaluated=evaluated: analysis.analyse(evaluated, tmp_dir / "run"))
            for key, value in (
                ("COCO evaluation (evaluate_coco_detailed)", t_eval),
                ("PR curves from eval['precision']", t_pr),
                ("ground truth to an array", t_gt),
                ("confusion matrix (IoU 0.5, score 0.3)", t_cm),
                ("pr_curves.json + .png", t_pr_files),
                ("confusion_matrix.json + .png (matrix included)", t_cm_files),
                ("DetectionAnalysis.analyse, all of it", t_all),
            ):
                times.setdefault(key, []).append(value)
        print(f"matched pairs on the diagonal: {int(np.trace(matrix[:-1, :-1]))}, backend {args.backend}")
    evaluation = statistics.median(times["COCO evaluation (evaluate_coco_detailed)"])
    rows = [
        [name, f"{statistics.median(v):.3f}", f"{100 * statistics.median(v) / evaluation:.1f} %"]
        for name, v in times.items()
    ]
    print(markdown_table(["phase", "seconds (median)", "of the evaluation"], rows, align="lrr", pad=True))


if __name__ == "__main__":
    main()
