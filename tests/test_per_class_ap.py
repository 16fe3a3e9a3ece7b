"""Per-class AP of evaluate_coco: hand-computed answers, and equality with COCOeval restricted to one category
(params.catIds = [c]) for both backends."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from ssd_lightning.evaluation import (
    BACKENDS,
    COCO_STAT_NAMES,
    ClassAP,
    class_ap_from_precision,
    evaluate_coco,
    evaluate_coco_detailed,
    format_per_class_table,
    per_class_metrics,
)
from tests.test_evaluation import _ann, _det, _random_coco_box, _write

HIT_HALF = 51 / 101  # precision 1 up to recall 0.5, nothing beyond: 51 of the 101 recall points


def _per_class(*args, **kwargs):
    evaluated = evaluate_coco_detailed(*args, **kwargs)
    return evaluated.stats, evaluated.classes


def _images(ids, w=640, h=480):
    return [{"id": i, "width": w, "height": h, "file_name": f"{i}.jpg"} for i in ids]


# ---------------------------------------------------------------------------------------- hand-computed
HAND_CATEGORIES = [
    {"id": 1, "name": "person"},  # both boxes found, a crowd region with a detection in it: AP 1
    {"id": 2, "name": "traffic light"},  # one of two boxes found exactly: AP = AP50 = 51/101
    {"id": 5, "name": "a/b"},  # no ground truth, one detection: undefined
    {"id": 9, "name": "dog"},  # one of two boxes found at IoU 0.62: a hit at 3 of the 10 thresholds
    {"id": 11, "name": "cat"},  # ground truth, no detection: AP 0
]
DOG_SHIFT = 11.7  # a 50x50 box shifted by dx: IoU = (50 - dx) / (50 + dx) = 0.6207


@pytest.fixture
def hand_case(tmp_path) -> tuple[Path, list[dict]]:
    anns = [
        _ann(1, 1, 1, [10, 10, 50, 50]),
        _ann(2, 1, 1, [200, 100, 100, 100]),
        _ann(3, 1, 1, [400, 300, 200, 150], iscrowd=1),
        _ann(4, 2, 2, [300, 20, 20, 40]),
        _ann(5, 2, 2, [340, 20, 20, 40]),
        _ann(6, 2, 9, [100, 200, 50, 50]),
        _ann(7, 2, 9, [300, 300, 80, 80]),
        _ann(8, 1, 11, [500, 400, 60, 40]),
    ]
    dets = [
        _det(1, 1, [10, 10, 50, 50], 0.9),
        _det(1, 1, [200, 100, 100, 100], 0.8),
        _det(1, 1, [420, 320, 50, 50], 0.95),  # inside the crowd region: ignored, not a false positive
        _det(2, 2, [300, 20, 20, 40], 0.7),
        _det(2, 5, [0, 0, 30, 30], 0.5),
        _det(2, 9, [100 + DOG_SHIFT, 200, 50, 50], 0.6),
    ]
    return _write(tmp_path / "hand.json", _images([1, 2]), anns, HAND_CATEGORIES), dets


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_per_class(hand_case, backend):
    ann_file, dets = hand_case
    stats, classes = _per_class(ann_file, dets, backend, verbose=False)
    by_id = {row.category_id: row for row in classes}
    assert list(by_id) == [1, 2, 5, 9, 11]  # every category of the file, in id order

    expected = {1: (1.0, 1.0), 2: (HIT_HALF, HIT_HALF), 9: (0.3 * HIT_HALF, HIT_HALF), 11: (0.0, 0.0)}
    for cat, (ap, ap50) in expected.items():
        assert by_id[cat].ap == pytest.approx(ap, abs=1e-12), cat
        assert by_id[cat].ap50 == pytest.approx(ap50, abs=1e-12), cat
    assert math.isnan(by_id[5].ap) and math.isnan(by_id[5].ap50)
    assert {c: r.num_gt for c, r in by_id.items()} == {1: 2, 2: 2, 5: 0, 9: 2, 11: 1}  # crowd not counted
    assert [r.name for r in classes] == [c["name"] for c in HAND_CATEGORIES]
    assert [r.key for r in classes] == ["person", "traffic light", "a_b", "dog", "cat"]
    # COCOeval's mAP averages the same precision entries: the mean over the categories that have an AP
    assert stats["mAP"] == pytest.approx(np.mean([ap for ap, _ in expected.values()]), abs=1e-12)
    assert stats["mAP_50"] == pytest.approx(np.mean([ap50 for _, ap50 in expected.values()]), abs=1e-12)

    flat = evaluate_coco(ann_file, dets, backend, verbose=False, per_class=True)
    assert list(flat)[:12] == list(COCO_STAT_NAMES) and {k: flat[k] for k in COCO_STAT_NAMES} == stats
    assert list(flat)[12:] == [
        "AP/person",
        "AP50/person",
        "AP/traffic light",
        "AP50/traffic light",
        "AP/dog",
        "AP50/dog",
        "AP/cat",
        "AP50/cat",
    ]  # "a/b" has no ground truth: no AP, left out
    assert flat["AP/dog"] == by_id[9].ap and flat["AP50/traffic light"] == by_id[2].ap50
    assert evaluate_coco(ann_file, dets, backend, verbose=False) == stats  # per_class is off by default


def test_per_class_metrics_and_table_order():
    rows = [
        ClassAP(3, "bus", "bus", 0.5, 0.9, 10),
        ClassAP(7, "no gt", "no gt", math.nan, math.nan, 0),
        ClassAP(1, "a/b", "a_b", 0.2, 0.4, 3),
        ClassAP(4, "tie high", "tie high", 0.5, 0.95, 2),
        ClassAP(2, "tie low", "tie low", 0.5, 0.8, 5),
    ]
    assert per_class_metrics(rows) == {
        "AP/bus": 0.5,
        "AP50/bus": 0.9,
        "AP/a_b": 0.2,
        "AP50/a_b": 0.4,
        "AP/tie high": 0.5,
        "AP50/tie high": 0.95,
        "AP/tie low": 0.5,
        "AP50/tie low": 0.8,
    }
    lines = format_per_class_table(rows).splitlines()
    assert lines[0].split() == ["AP", "AP50", "GT", "id", "category"]
    # worst AP first, ties by AP50, undefined (no ground truth) last
    assert [line.split(None, 4)[4] for line in lines[1:]] == ["a/b", "tie low", "bus", "tie high", "no gt"]
    assert lines[1].split()[:4] == ["0.200", "0.400", "3", "1"]
    assert lines[-1].split()[:4] == ["-", "-", "0", "7"]


def test_class_ap_from_precision_by_hand():
    """(T, R, K, A, M) array built by hand: the mean over T and R of the defined entries, NaN if none."""
    thresholds = np.linspace(0.5, 0.95, 10)
    precision = np.full((10, 101, 3, 4, 3), -1.0)
    precision[:, :, 0, 0, 2] = 0.25  # category 0: 0.25 everywhere
    precision[0, :, 0, 0, 2] = 1.0  # ... but 1.0 at IoU 0.5
    precision[:, :50, 1, 0, 2] = 0.8  # category 1: defined on the first 50 recall points only
    precision[:, :, 2, 1, 2] = 0.5  # category 2: defined in another area range only
    precision[:, :, 0, 0, 0] = 0.0  # another maxDets setting: not read
    ap, ap50 = class_ap_from_precision(precision, thresholds)
    np.testing.assert_allclose(ap[:2], [(1.0 + 9 * 0.25) / 10, 0.8], rtol=0, atol=1e-15)
    np.testing.assert_allclose(ap50[:2], [1.0, 0.8], rtol=0, atol=1e-15)
    assert np.isnan(ap[2]) and np.isnan(ap50[2])
    ap, _ = class_ap_from_precision(precision, thresholds, area_index=1)
    assert np.isnan(ap[:2]).all() and ap[2] == 0.5


def test_class_ap_from_precision_bad_input():
    with pytest.raises(ValueError, match=r"shape \(T, R, K, A, M\)"):
        class_ap_from_precision(np.zeros((10, 101, 3)), np.linspace(0.5, 0.95, 10))
    with pytest.raises(ValueError, match="2 IoU thresholds"):
        class_ap_from_precision(np.zeros((10, 101, 3, 4, 3)), [0.5, 0.75])
    with pytest.raises(ValueError, match="must contain 0.5"):
        class_ap_from_precision(np.zeros((2, 101, 3, 4, 3)), [0.55, 0.75])


@pytest.mark.parametrize("backend", BACKENDS)
def test_metric_keys_are_safe_and_unique(tmp_path, backend):
    categories = [
        {"id": 1, "name": "a/b"},
        {"id": 2, "name": "a_b"},  # collides with "a/b" once the slash is replaced: both get their id
        {"id": 3, "name": "  "},  # empty once stripped
        {"id": 4, "name": " traffic light "},
    ]
    anns = [_ann(i, 1, i, [10 + 60 * i, 10, 40, 40]) for i in range(1, 5)]
    dets = [_det(1, i, [10 + 60 * i, 10, 40, 40], 0.9) for i in range(1, 5)]
    ann_file = _write(tmp_path / "names.json", _images([1]), anns, categories)
    _, classes = _per_class(ann_file, dets, backend, verbose=False)
    assert [r.key for r in classes] == ["a_b_1", "a_b_2", "category_3", "traffic light"]
    assert [r.name for r in classes] == ["a/b", "a_b", "  ", " traffic light "]
    flat = evaluate_coco(ann_file, dets, backend, verbose=False, per_class=True)
    assert {k for k in flat if k.startswith("AP/")} == {
        "AP/a_b_1",
        "AP/a_b_2",
        "AP/category_3",
        "AP/traffic light",
    }
    assert [flat[f"AP/{r.key}"] for r in classes] == pytest.approx([1.0] * 4)


# ---------------------------------------------------------------------------- generated: vs COCOeval
GEN_CATEGORIES = [
    {"id": 2, "name": "cat 2"},
    {"id": 4, "name": "cat 4"},
    {"id": 6, "name": "cat 6"},
    {"id": 8, "name": "only detections"},  # detections, no ground truth
    {"id": 10, "name": "only ground truth"},  # ground truth, no detection
]


def _generated(tmp_path: Path, seed: int, num_images: int = 30) -> tuple[Path, list[dict]]:
    """All area ranges, ~3 % crowd; detections: jittered ground truth (10 % with another class, 15 %
    dropped) plus false positives, many per image for category 2 so that the 100-per-image cut matters."""
    rng = np.random.default_rng(seed)
    images, anns, dets = _images(range(1, num_images + 1)), [], []
    with_gt, with_dets = [2, 4, 6, 10], [2, 4, 6, 8]
    for im in images:
        for _ in range(rng.integers(1, 8)):
            box, w, h = _random_coco_box(rng)
            cat = int(rng.choice(with_gt))
            anns.append(_ann(len(anns) + 1, im["id"], cat, box, int(rng.random() < 0.03)))
            if cat == 10 or rng.random() < 0.15:
                continue
            jitter = rng.normal(0, 0.1, 4) * [w, h, w, h]
            det_cat = cat if rng.random() > 0.1 else int(rng.choice(with_dets))
            dets.append(_det(im["id"], det_cat, list(np.asarray(box) + jitter), float(rng.random())))
        for _ in range(rng.integers(0, 6) + (110 if im["id"] % 5 == 0 else 0)):
            bw, bh = rng.uniform(5, 200, 2)
            box = [rng.uniform(0, 640 - bw), rng.uniform(0, 480 - bh), bw, bh]
            cat = 2 if rng.random() < 0.8 else int(rng.choice(with_dets))
            dets.append(_det(im["id"], cat, box, float(rng.random() * 0.7)))
    return _write(tmp_path / f"generated_{seed}.json", images, anns, GEN_CATEGORIES), dets


def _restricted_cocoeval(backend: str, ann_file: Path, dets: list[dict], cat: int, img_ids=None) -> tuple:
    """(AP, AP50) of COCOeval run on category ``cat`` alone (``params.catIds = [cat]``); -1 if undefined."""
    if backend == "pycocotools":
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        with contextlib.redirect_stdout(io.StringIO()):
            gt = COCO(str(ann_file))
            ev = COCOeval(gt, gt.loadRes(json.loads(json.dumps(dets))), "bbox")
    else:
        from faster_coco_eval import COCO, COCOeval_faster

        gt = COCO(str(ann_file), print_function=lambda *a, **k: None)
        dt = gt.loadRes(json.loads(json.dumps(dets)))
        ev = COCOeval_faster(gt, dt, iouType="bbox", print_function=lambda *a, **k: None)
    ev.params.catIds = [cat]
    if img_ids is not None:
        ev.params.imgIds = list(img_ids)
    with contextlib.redirect_stdout(io.StringIO()):
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats[0], ev.stats[1]


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_cocoeval_restricted_to_each_category(tmp_path, seed):
    ann_file, dets = _generated(tmp_path, seed)
    for backend in BACKENDS:
        _, classes = _per_class(ann_file, dets, backend, verbose=False)
        assert [r.category_id for r in classes] == [2, 4, 6, 8, 10]
        for row in classes:
            for reference_backend in {"pycocotools", backend}:
                ap, ap50 = _restricted_cocoeval(reference_backend, ann_file, dets, row.category_id)
                if row.category_id == 8:
                    assert ap == ap50 == -1.0  # no ground truth: COCOeval's "undefined" ...
                    assert math.isnan(row.ap) and math.isnan(row.ap50)  # ... is NaN here
                    continue
                assert row.ap == pytest.approx(ap, rel=0, abs=1e-12), (backend, row)
                assert row.ap50 == pytest.approx(ap50, rel=0, abs=1e-12), (backend, row)
        by_id = {r.category_id: r for r in classes}
        assert by_id[10].ap == by_id[10].ap50 == 0.0 and by_id[10].num_gt > 0  # never detected
        assert 0.02 < by_id[2].ap < by_id[2].ap50 < 0.95 and 0.1 < by_id[4].ap < 0.95  # non-trivial values


def test_image_subset_matches_restricted_cocoeval_and_counts_gt_in_the_subset(tmp_path):
    ann_file, dets = _generated(tmp_path, 2)
    subset = list(range(1, 31, 3))
    dataset = json.loads(ann_file.read_text())
    for backend in BACKENDS:
        with pytest.warns(UserWarning, match="evaluating on 10 of the 30 images"):
            _, classes = _per_class(ann_file, dets, backend, verbose=False, image_ids=subset)
        for row in classes:
            expected_gt = sum(
                1
                for a in dataset["annotations"]
                if a["category_id"] == row.category_id and a["image_id"] in subset and not a["iscrowd"]
            )
            assert row.num_gt == expected_gt
            ap, ap50 = _restricted_cocoeval("pycocotools", ann_file, dets, row.category_id, subset)
            if ap == -1.0:
                assert math.isnan(row.ap) and row.num_gt == 0
            else:
                assert (row.ap, row.ap50) == pytest.approx((ap, ap50), rel=0, abs=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_detections_at_all(tmp_path, backend):
    ann_file, _ = _generated(tmp_path, 3)
    flat = evaluate_coco(ann_file, [], backend, verbose=False, per_class=True)
    per_class = {k: v for k, v in flat.items() if k not in COCO_STAT_NAMES}
    assert per_class == {
        f"{m}/{n}": 0.0 for n in ["cat 2", "cat 4", "cat 6", "only ground truth"] for m in ("AP", "AP50")
    }
