"""Error analysis: PR curves from COCOeval's own array; detection confusion matrix vs independent matchers."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from ssd_lightning.error_analysis import (
    detection_confusion_matrix,
    ground_truth_array,
    pr_curves_from_precision,
    top_confusions,
)
from ssd_lightning.evaluation import evaluate_coco_detailed

pytestmark = pytest.mark.no_dali

CATS = [3, 7, 11]  # 11 has no ground truth


def _crafted(path: Path, seed: int = 0) -> tuple[Path, np.ndarray]:
    """12 images, categories 3 and 7 with ground truth, 11 without; detections: jittered copies of the
    ground truth (some of the wrong class), misses, false positives (also of class 11), a crowd region."""
    rng = np.random.default_rng(seed)
    images, anns, dets = [], [], []
    for i in range(12):
        image_id = 100 + i
        images.append({"id": image_id, "width": 400, "height": 300, "file_name": f"{image_id}.jpg"})
        for j in range(int(rng.integers(1, 5))):
            w, h = rng.uniform(20, 120, 2)
            x, y = rng.uniform(0, 400 - w), rng.uniform(0, 300 - h)
            cat = CATS[(i + j) % 2]
            crowd = int(i == 3 and j == 0)
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": image_id,
                    "category_id": cat,
                    "bbox": [x, y, w, h],
                    "area": w * h,
                    "iscrowd": crowd,
                }
            )
            if rng.uniform() < 0.8:  # detected, sometimes with the wrong class
                jitter = rng.normal(0, 0.15, 4) * [w, h, w, h]
                det_cat = cat if rng.uniform() < 0.8 else CATS[(i + j + 1) % 2]
                dets.append(
                    [
                        image_id,
                        x + jitter[0],
                        y + jitter[1],
                        w + jitter[2],
                        h + jitter[3],
                        rng.uniform(0.05, 1),
                        det_cat,
                    ]
                )
        for _ in range(int(rng.integers(0, 3))):  # false positives, any category
            dets.append(
                [
                    image_id,
                    *rng.uniform(0, 250, 2),
                    *rng.uniform(10, 100, 2),
                    rng.uniform(0.05, 1),
                    CATS[int(rng.integers(0, 3))],
                ]
            )
    cats = [{"id": c, "name": f"cat{c}"} for c in CATS]
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return path, np.round(np.asarray(dets, dtype=np.float64), 3)


def _pycocotools(ann_file: Path, dets: np.ndarray, cat_ids=None):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann_file))
        ev = COCOeval(gt, gt.loadRes(dets), "bbox")
        if cat_ids is not None:
            ev.params.catIds = cat_ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


@pytest.mark.parametrize("backend", ["pycocotools", "faster_coco_eval"])
def test_pr_curve_means_are_cocoevals_ap50_and_ap75_per_class(tmp_path, backend):
    ann_file, dets = _crafted(tmp_path / "ann.json")
    result = evaluate_coco_detailed(ann_file, dets, backend, verbose=False)
    curves = pr_curves_from_precision(
        result.precision,
        result.iou_thresholds,
        result.recall_thresholds,
        area_index=result.area_index,
        max_dets_index=result.max_dets_index,
    )
    assert curves.precision.shape == (2, 3, 101) and curves.recall.shape == (101,)
    np.testing.assert_allclose(curves.recall, np.linspace(0, 1, 101))
    for k, cat in enumerate(CATS[:2]):
        alone = _pycocotools(ann_file, dets, [cat]).stats  # COCOeval on this category alone
        for i, stat in enumerate((1, 2)):  # AP50, AP75
            mean = np.mean(curves.precision[i, k])  # the 101 points, no -1 left for a class with GT
            assert mean == pytest.approx(alone[stat], abs=1e-6), (cat, i)
            assert curves.ap[i, k] == pytest.approx(alone[stat], abs=1e-6)
    assert 0.05 < curves.ap[0, 0] < 0.95 and 0.05 < curves.ap[0, 1] < 0.95  # a case with mistakes
    assert np.isnan(curves.precision[:, 2]).all() and np.isnan(curves.ap[:, 2]).all()  # no GT: no curve
    # the all-classes curve integrates to mAP_50 / mAP_75
    assert curves.all_ap == pytest.approx([result.stats["mAP_50"], result.stats["mAP_75"]], abs=1e-12)
    assert np.mean(curves.all_precision, axis=1) == pytest.approx(curves.all_ap, abs=1e-12)
    assert [c.ap50 for c in result.classes[:2]] == pytest.approx(curves.ap[0, :2].tolist(), abs=1e-12)


def test_pr_curves_by_hand_and_bad_input():
    precision = -np.ones((3, 4, 2, 1, 1))
    precision[0, :, 0, 0, 0] = [1.0, 1.0, 0.5, 0.0]
    precision[2, :, 0, 0, 0] = [1.0, 0.5, 0.5, 0.0]
    curves = pr_curves_from_precision(precision, [0.5, 0.6, 0.75], [0, 0.3, 0.6, 1.0])
    assert curves.ap[:, 0].tolist() == [0.625, 0.5]
    assert np.isnan(curves.ap[:, 1]).all()
    assert curves.all_ap.tolist() == [0.625, 0.5]
    assert curves.all_precision[1].tolist() == [1.0, 0.5, 0.5, 0.0]
    with pytest.raises(ValueError, match="IoU 0.9 is not one of"):
        pr_curves_from_precision(precision, [0.5, 0.6, 0.75], [0, 0.3, 0.6, 1.0], ious=(0.9,))
    with pytest.raises(ValueError, match="shape"):
        pr_curves_from_precision(precision[0], [0.5], [0, 1])
    with pytest.raises(ValueError, match="recall points"):
        pr_curves_from_precision(precision, [0.5, 0.6, 0.75], [0, 1])


def _gt(*rows):
    return np.asarray(rows, dtype=np.float64).reshape(-1, 7)


def test_confusion_matrix_counts_on_a_hand_made_case():
    # categories 5 (index 0) and 9 (index 1); background index 2
    gt = _gt(
        [1, 0, 0, 10, 10, 5, 0],  # g1: class 5, found by the 0.9 detection
        [1, 50, 50, 10, 10, 9, 0],  # g2: class 9, found only by a class-5 detection
        [1, 100, 100, 10, 10, 5, 0],  # g3: class 5, detected below the score threshold: missed
        [1, 200, 200, 40, 40, 5, 1],  # crowd region of class 5
        [2, 0, 0, 20, 20, 5, 0],  # image 2: a higher-scored class-9 box on it does not steal it
    )
    dets = np.asarray(
        [
            [1, 0, 0, 10, 10, 0.9, 5],  # TP class 5
            [1, 51, 51, 10, 10, 0.8, 9 - 4],  # class 5 on g2 (IoU 0.68): true 9, predicted 5
            [1, 300, 300, 10, 10, 0.7, 9],  # nothing there: FP of class 9
            [1, 210, 210, 10, 10, 0.6, 5],  # inside the crowd region of its class: not counted
            [1, 1, 1, 10, 10, 0.5, 9],  # on g1, already taken: FP of class 9
            [1, 100, 100, 10, 10, 0.2, 5],  # below the score threshold
            [2, 0, 0, 20, 20, 0.95, 9],  # same box as the class-5 detection below, higher score: FP
            [2, 1, 0, 20, 20, 0.9, 5],  # TP class 5 (IoU 0.905)
        ]
    )
    matrix = detection_confusion_matrix(dets, gt, [9, 5], iou_threshold=0.5, score_threshold=0.3)
    expected = np.array(
        [
            [2, 0, 1],  # class 5: 2 found, g3 missed
            [1, 0, 0],  # class 9: g2 predicted as 5
            [0, 3, 0],  # false positives: three of class 9
        ]
    )
    np.testing.assert_array_equal(matrix, expected)
    # a higher IoU threshold: the 0.68 pair no longer matches (g2 missed, the class-5 detection an FP)
    strict = detection_confusion_matrix(dets, gt, [5, 9], iou_threshold=0.75, score_threshold=0.3)
    np.testing.assert_array_equal(strict, [[2, 0, 1], [0, 0, 1], [1, 3, 0]])
    # a lower score threshold counts the 0.2 detection on g3
    low = detection_confusion_matrix(dets, gt, [5, 9], score_threshold=0.1)
    np.testing.assert_array_equal(low, [[3, 0, 0], [1, 0, 0], [0, 3, 0]])
    # image_ids restricts both sides; no data at all gives zeros
    only2 = detection_confusion_matrix(dets, gt, [5, 9], image_ids=[2])
    np.testing.assert_array_equal(only2, [[1, 0, 0], [0, 0, 0], [0, 1, 0]])
    np.testing.assert_array_equal(
        detection_confusion_matrix(np.zeros((0, 7)), _gt(), [5, 9]), np.zeros((3, 3))
    )
    with pytest.raises(ValueError, match=r"category id\(s\) \[4\]"):
        detection_confusion_matrix(dets, _gt([1, 0, 0, 1, 1, 4, 0]), [5, 9])


def _iou(a, b, crowd=False):
    ax0, ay0, aw, ah = a
    bx0, by0, bw, bh = b
    iw = max(0.0, min(ax0 + aw, bx0 + bw) - max(ax0, bx0))
    ih = max(0.0, min(ay0 + ah, by0 + bh) - max(ay0, by0))
    inter = iw * ih
    union = aw * ah if crowd else aw * ah + bw * bh - inter
    return inter / union if union > 0 else 0.0


def _per_class_true_positives(dets, gt, thr, score_thr) -> dict[int, int]:
    """Independent matcher: per image and class, detections by descending score, each taking the free
    non-crowd ground-truth box of highest IoU >= thr."""
    tp: dict[int, int] = {}
    for image_id in np.unique(dets[:, 0]):
        for cat in np.unique(dets[:, 6]):
            d = [r for r in dets if r[0] == image_id and r[6] == cat and r[5] >= score_thr]
            d.sort(key=lambda r: -r[5])
            g = [r for r in gt if r[0] == image_id and r[5] == cat and r[6] == 0]
            free = [True] * len(g)
            for r in d:
                best, best_iou = -1, thr
                for j, q in enumerate(g):
                    if free[j]:
                        v = _iou(r[1:5], q[1:5])
                        if v >= best_iou and (best < 0 or v > best_iou):
                            best, best_iou = j, v
                if best >= 0:
                    free[best] = False
                    tp[int(cat)] = tp.get(int(cat), 0) + 1
    return tp


def _random_case(seed: int, n_images: int = 30):
    """Clustered objects of 4 classes (some crowd); detections near them (one or two each, the right class
    60% of the time) and anywhere in the cluster."""
    rng = np.random.default_rng(seed)
    gt, dets = [], []
    for image_id in range(n_images):
        centres = rng.uniform(20, 180, (3, 2))
        for _ in range(int(rng.integers(0, 8))):
            c = centres[int(rng.integers(0, 3))] + rng.normal(0, 8, 2)
            w, h = rng.uniform(10, 40, 2)
            cat = int(rng.integers(1, 5))
            gt.append([image_id, c[0] - w / 2, c[1] - h / 2, w, h, cat, rng.uniform() < 0.1])
            for _ in range(int(rng.integers(0, 3))):
                x, y, dw, dh = np.array([c[0] - w / 2, c[1] - h / 2, w, h]) + rng.normal(0, 0.12, 4) * [
                    w,
                    h,
                    w,
                    h,
                ]
                det_cat = cat if rng.uniform() < 0.6 else int(rng.integers(1, 5))
                dets.append([image_id, x, y, dw, dh, round(rng.uniform(), 4), det_cat])
        for _ in range(int(rng.integers(0, 4))):
            c = centres[int(rng.integers(0, 3))] + rng.normal(0, 8, 2)
            w, h = rng.uniform(10, 40, 2)
            dets.append(
                [image_id, c[0] - w / 2, c[1] - h / 2, w, h, round(rng.uniform(), 4), int(rng.integers(1, 5))]
            )
    return np.asarray(dets, dtype=np.float64), np.asarray(gt, dtype=np.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_confusion_diagonal_equals_an_independent_per_class_match(seed):
    dets, gt = _random_case(seed)
    cats = [1, 2, 3, 4]
    matrix = detection_confusion_matrix(
        dets, gt, cats, iou_threshold=0.5, score_threshold=0.3, max_cells=5000
    )
    tp = _per_class_true_positives(dets, gt, 0.5, 0.3)
    assert np.diag(matrix)[:4].tolist() == [tp.get(c, 0) for c in cats]
    assert sum(tp.values()) > 10 and matrix[:4, :4].sum() > sum(tp.values())  # confusions happen too
    # every non-crowd ground-truth box once in its row; every counted detection once in its column
    non_crowd = gt[gt[:, 6] == 0]
    assert matrix[:4].sum(axis=1).tolist() == [int((non_crowd[:, 5] == c).sum()) for c in cats]
    counted = dets[dets[:, 5] >= 0.3]
    per_class = np.array([(counted[:, 6] == c).sum() for c in cats])
    assert (matrix[:, :4].sum(axis=0) <= per_class).all()  # less only by crowd-ignored detections
    assert matrix[4, 4] == 0
    # the chunking over images does not change anything
    whole = detection_confusion_matrix(dets, gt, cats, iou_threshold=0.5, score_threshold=0.3)
    np.testing.assert_array_equal(whole, matrix)


def test_confusion_diagonal_equals_cocoevals_true_positives_above_the_threshold(tmp_path):
    """COCOeval's own matches at IoU 0.5 (area all), counted for detections scoring >= 0.3."""
    ann_file, dets = _crafted(tmp_path / "ann.json", seed=4)
    data = json.loads(ann_file.read_text())
    matrix = detection_confusion_matrix(dets, ground_truth_array(data["annotations"]), CATS)
    ev = _pycocotools(ann_file, dets)
    tp = dict.fromkeys(CATS, 0)
    for e in ev.evalImgs:
        if e is None or e["aRng"] != ev.params.areaRng[0]:
            continue
        scores = np.asarray(e["dtScores"])
        hit = (np.asarray(e["dtMatches"])[0] > 0) & ~np.asarray(e["dtIgnore"])[0] & (scores >= 0.3)
        tp[e["category_id"]] += int(hit.sum())
    assert np.diag(matrix)[:3].tolist() == [tp[c] for c in CATS]
    assert sum(tp.values()) > 5


def test_ground_truth_array_and_top_confusions():
    anns = [
        {"image_id": 4, "bbox": [1, 2, 3, 4], "category_id": 7},
        {"image_id": 5, "bbox": [0, 0, 1, 1], "category_id": 8, "iscrowd": 1},
        {"image_id": 5, "segmentation": [], "category_id": 8},  # no bbox: left out
    ]
    np.testing.assert_array_equal(ground_truth_array(anns), [[4, 1, 2, 3, 4, 7, 0], [5, 0, 0, 1, 1, 8, 1]])
    assert ground_truth_array([]).shape == (0, 7)
    m = np.array([[9, 2, 5], [4, 8, 0], [2, 7, 1]])
    assert top_confusions(m, 3, include_background=True) == [(2, 1, 7), (0, 2, 5), (1, 0, 4)]
    assert top_confusions(m, 3) == [(1, 0, 4), (0, 1, 2)]  # background row/column left out; no zeros
    with pytest.raises(ValueError, match="square"):
        top_confusions(np.zeros((2, 3)))
