"""evaluate_coco / to_coco_array: known answers, equivalence with pycocotools by hand, both backends."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ssd_lightning.evaluation import (
    BACKENDS,
    COCO_STAT_NAMES,
    DEFAULT_BACKEND,
    coco_array_to_results,
    detections_to_coco_array,
    evaluate_coco,
    to_coco_array,
    write_coco_results_json,
)

CATEGORIES = [{"id": 3, "name": "a"}, {"id": 7, "name": "b"}, {"id": 12, "name": "c"}]


def to_coco_results(*args, **kwargs):
    """:func:`to_coco_array` (same arguments) as the COCO results list."""
    return coco_array_to_results(to_coco_array(*args, **kwargs))


def detections_to_coco_results(detections, category_map, **kwargs):
    """:func:`detections_to_coco_array` (same arguments) as the COCO results list."""
    return coco_array_to_results(detections_to_coco_array(detections, category_map, **kwargs))


class DuckCategoryMap:
    """Stand-in for ssd_lightning.data.categories.CategoryMap: contiguous label i+1 <-> category_ids[i]."""

    def __init__(self, category_ids: list[int]):
        self.category_ids = list(category_ids)
        self._lut = torch.tensor([-1, *category_ids], dtype=torch.int64)

    def label_to_category_id(self, labels):
        if isinstance(labels, torch.Tensor):
            return self._lut[labels.long()]
        return int(self._lut[int(labels)])


def _ann(ann_id, image_id, cat, bbox, iscrowd=0):
    return {
        "id": ann_id,
        "image_id": image_id,
        "category_id": cat,
        "bbox": list(bbox),
        "area": float(bbox[2] * bbox[3]),
        "iscrowd": iscrowd,
        "segmentation": [],
    }


def _write(path: Path, images, annotations, categories=CATEGORIES) -> Path:
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return path


def _random_coco_box(
    rng: np.random.Generator, width: int = 640, height: int = 480
) -> tuple[list, float, float]:
    """A ``[x, y, w, h]`` box (2 decimals) inside the image, small, medium or large with equal odds; and its
    unrounded w, h."""
    side = float(rng.choice([rng.uniform(6, 30), rng.uniform(35, 90), rng.uniform(100, 300)]))
    w, h = side * rng.uniform(0.6, 1.4), side * rng.uniform(0.6, 1.4)
    return (
        [round(rng.uniform(0, width - w), 2), round(rng.uniform(0, height - h), 2), round(w, 2), round(h, 2)],
        w,
        h,
    )


def _images(n, w=400, h=300, start=1):
    return [{"id": i, "width": w, "height": h, "file_name": f"{i}.jpg"} for i in range(start, start + n)]


def _det(image_id, cat, bbox, score):
    return {"image_id": image_id, "category_id": cat, "bbox": list(bbox), "score": score}


@pytest.fixture
def two_objects(tmp_path) -> Path:
    """One image, category 3: object A medium (50x50), object B large (100x100)."""
    anns = [_ann(1, 1, 3, [10, 10, 50, 50]), _ann(2, 1, 3, [200, 100, 100, 100])]
    return _write(tmp_path / "two.json", _images(1), anns)


def test_stat_names_order():
    assert COCO_STAT_NAMES == (
        "mAP",
        "mAP_50",
        "mAP_75",
        "mAP_small",
        "mAP_medium",
        "mAP_large",
        "mAR_1",
        "mAR_10",
        "mAR_100",
        "mAR_small",
        "mAR_medium",
        "mAR_large",
    )


def test_default_backend_is_faster_coco_eval():
    import inspect

    assert DEFAULT_BACKEND == BACKENDS[0] == "faster_coco_eval"
    assert set(BACKENDS) == {"faster_coco_eval", "pycocotools"}
    assert inspect.signature(evaluate_coco).parameters["backend"].default == "faster_coco_eval"


@pytest.mark.parametrize("backend", BACKENDS)
def test_perfect_detections(two_objects, backend, capsys):
    dets = [_det(1, 3, [10, 10, 50, 50], 0.9), _det(1, 3, [200, 100, 100, 100], 0.8)]
    stats = evaluate_coco(two_objects, dets, backend)
    assert list(stats) == list(COCO_STAT_NAMES)
    assert stats["mAP"] == pytest.approx(1.0)
    assert stats["mAP_50"] == stats["mAP_75"] == pytest.approx(1.0)
    assert stats["mAP_small"] == -1.0  # no small ground truth: undefined
    assert stats["mAP_medium"] == pytest.approx(1.0) and stats["mAP_large"] == pytest.approx(1.0)
    assert stats["mAR_1"] == pytest.approx(0.5)  # 2 objects in the image, only 1 detection allowed
    assert stats["mAR_100"] == pytest.approx(1.0)
    out = capsys.readouterr().out
    # 12-line summary printed, loading chatter silenced
    assert out.count("Average Precision") == 6 and out.count("Average Recall") == 6
    assert "loading annotations" not in out and "index created" not in out and "DONE" not in out


def test_quiet(two_objects, capsys):
    evaluate_coco(two_objects, [_det(1, 3, [10, 10, 50, 50], 0.9)], "pycocotools", verbose=False)
    evaluate_coco(two_objects, [_det(1, 3, [10, 10, 50, 50], 0.9)], "faster_coco_eval", verbose=False)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("backend", ["pycocotools", "faster_coco_eval"])
def test_one_of_two_detected(two_objects, backend):
    stats = evaluate_coco(two_objects, [_det(1, 3, [10, 10, 50, 50], 0.9)], backend, verbose=False)
    # precision 1 up to recall 0.5, nothing beyond: 51 of the 101 recall points are 1.
    assert stats["mAP"] == pytest.approx(51 / 101)
    assert stats["mAP_50"] == pytest.approx(51 / 101)
    assert stats["mAR_100"] == pytest.approx(0.5)
    assert stats["mAP_medium"] == pytest.approx(1.0)  # the medium object is found
    assert stats["mAP_large"] == pytest.approx(0.0)  # the large one is not
    assert stats["mAR_large"] == pytest.approx(0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_iou_between_thresholds(two_objects, backend):
    """Box shifted so IoU = 0.6: a hit for IoU thresholds 0.50..0.60 (3 of 10), a miss above."""
    # 50x50 box shifted by dx: IoU = (50-dx)*50 / ((50+dx)*50) = 0.6  ->  dx = 12.5
    dets = [_det(1, 3, [22.5, 10, 50, 50], 0.9), _det(1, 3, [200, 100, 100, 100], 0.8)]
    stats = evaluate_coco(two_objects, dets, backend, verbose=False)
    # at the 3 thresholds <= 0.6: AP 1; above: the 0.9 det is a FP ranked first, then the TP at recall 0.5
    # precision is 1/2 up to recall 0.5 -> AP = 51/101 * 0.5
    expected = (3 * 1.0 + 7 * (51 / 101) * 0.5) / 10
    assert stats["mAP"] == pytest.approx(expected)
    assert stats["mAP_50"] == pytest.approx(1.0)
    assert stats["mAP_75"] == pytest.approx(51 / 101 * 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_category_scores_zero(two_objects, backend):
    # category 7 exists in the dataset but has no ground truth: its AP is undefined (-1) and excluded
    dets = [_det(1, 7, [10, 10, 50, 50], 0.9), _det(1, 7, [200, 100, 100, 100], 0.8)]
    stats = evaluate_coco(two_objects, dets, backend, verbose=False)
    assert stats["mAP"] == 0.0 and stats["mAR_100"] == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_crowd_region_is_ignored(tmp_path, backend):
    anns = [_ann(1, 1, 3, [10, 10, 50, 50]), _ann(2, 1, 3, [150, 50, 200, 200], iscrowd=1)]
    ann_file = _write(tmp_path / "crowd.json", _images(1), anns)
    tp = _det(1, 3, [10, 10, 50, 50], 0.5)
    in_crowd = [_det(1, 3, [160, 60, 40, 40], 0.9), _det(1, 3, [250, 150, 60, 60], 0.8)]
    stats = evaluate_coco(ann_file, [tp, *in_crowd], backend, verbose=False)
    assert stats["mAP"] == pytest.approx(1.0)  # would be 1/3 if the crowd hits counted as false positives
    # the same detections outside the crowd region are false positives ranked above the true positive
    outside = [_det(1, 3, [20, 200, 40, 40], 0.9), _det(1, 3, [80, 200, 60, 60], 0.8)]
    stats = evaluate_coco(ann_file, [tp, *outside], backend, verbose=False)
    assert stats["mAP"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("backend", ["pycocotools", "faster_coco_eval"])
def test_empty_detections(two_objects, backend, capsys):
    stats = evaluate_coco(two_objects, [], backend)
    for name, value in stats.items():
        # -1 only where the dataset has no ground truth (no small objects here), 0 everywhere else
        assert value == (-1.0 if name in ("mAP_small", "mAR_small") else 0.0), name
    assert capsys.readouterr().out.count("Average") == 12


def test_empty_detections_all_zero_when_every_range_has_gt(tmp_path):
    anns = [_ann(1, 1, 3, [0, 0, 10, 10]), _ann(2, 1, 3, [20, 20, 50, 50]), _ann(3, 1, 7, [100, 0, 200, 200])]
    ann_file = _write(tmp_path / "all.json", _images(1), anns)
    for backend in ("pycocotools", "faster_coco_eval"):
        assert set(evaluate_coco(ann_file, [], backend, verbose=False).values()) == {0.0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_does_not_mutate_and_accepts_json_path(two_objects, tmp_path, backend):
    dets = [_det(1, 3, [10, 10, 50, 50], 0.9)]
    before = json.dumps(dets)
    from_list = evaluate_coco(two_objects, dets, backend, verbose=False)
    assert json.dumps(dets) == before  # loadRes adds id/area/segmentation to what it gets: not to ours
    path = tmp_path / "dets.json"
    path.write_text(before)
    assert evaluate_coco(two_objects, path, backend, verbose=False) == from_list
    assert evaluate_coco(two_objects, str(path), backend, verbose=False) == from_list


def test_errors(two_objects, tmp_path):
    with pytest.raises(FileNotFoundError, match="annotation_file"):
        evaluate_coco(tmp_path / "missing.json", [])
    with pytest.raises(FileNotFoundError, match="nope.json"):
        evaluate_coco(two_objects, tmp_path / "nope.json")
    with pytest.raises(ValueError, match="backend"):
        evaluate_coco(two_objects, [], backend="torchmetrics")
    with pytest.raises(ValueError, match="image id"):
        evaluate_coco(two_objects, [_det(99, 3, [0, 0, 5, 5], 0.5)], verbose=False)
    with pytest.raises(ValueError, match="category id"):
        evaluate_coco(two_objects, [_det(1, 1, [0, 0, 5, 5], 0.5)], verbose=False)
    with pytest.raises(ValueError, match="detections\\[0\\]"):
        evaluate_coco(two_objects, [{"image_id": 1, "bbox": [0, 0, 1, 1], "score": 0.5}], verbose=False)


# ----------------------------------------------------------------------------------------------------------
# Generated data: many images, three non-contiguous categories, all area ranges, some crowd regions.


def _random_dataset(tmp_path: Path, seed: int = 0, num_images: int = 40) -> tuple[Path, dict]:
    rng = np.random.default_rng(seed)
    images, anns = _images(num_images, w=640, h=480, start=100), []
    for im in images:
        for _ in range(rng.integers(0, 7)):
            side = float(rng.choice([rng.uniform(6, 30), rng.uniform(35, 90), rng.uniform(100, 300)]))
            w, h = side * rng.uniform(0.6, 1.4), side * rng.uniform(0.6, 1.4)
            x, y = rng.uniform(0, 640 - w), rng.uniform(0, 480 - h)
            crowd = int(rng.random() < 0.05)
            box = [round(x, 2), round(y, 2), round(w, 2), round(h, 2)]
            anns.append(_ann(len(anns) + 1, im["id"], int(rng.choice([3, 7, 12])), box, crowd))
    path = _write(tmp_path / f"random_{seed}.json", images, anns)
    return path, {"images": images, "annotations": anns, "categories": CATEGORIES}


def _noisy_detections(dataset: dict, seed: int) -> list[dict]:
    """Jittered ground truth (some with the wrong class, some dropped) plus random false positives."""
    rng = np.random.default_rng(seed)
    cats = [c["id"] for c in dataset["categories"]]
    dets = []
    for a in dataset["annotations"]:
        if rng.random() < 0.15:
            continue
        x, y, w, h = a["bbox"]
        j = rng.normal(0, 0.08, 4) * [w, h, w, h]
        cat = a["category_id"] if rng.random() > 0.1 else int(rng.choice(cats))
        dets.append(_det(a["image_id"], cat, [x + j[0], y + j[1], w + j[2], h + j[3]], float(rng.random())))
    for im in dataset["images"]:
        for _ in range(rng.integers(0, 4)):
            w, h = rng.uniform(5, 0.5 * min(im["width"], im["height"]), 2)
            box = [rng.uniform(0, im["width"] - w), rng.uniform(0, im["height"] - h), w, h]
            dets.append(_det(im["id"], int(rng.choice(cats)), box, float(rng.random() * 0.6)))
    return dets


def _pycocotools_by_hand(ann_file: Path, dets: list[dict], img_ids=None) -> np.ndarray:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann_file))
        dt = gt.loadRes(json.loads(json.dumps(dets)))
        ev = COCOeval(gt, dt, "bbox")
        if img_ids is not None:
            ev.params.imgIds = img_ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return np.asarray(ev.stats)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_pycocotools_by_hand_and_faster_backend(tmp_path, seed):
    ann_file, dataset = _random_dataset(tmp_path, seed)
    dets = _noisy_detections(dataset, seed)
    reference = _pycocotools_by_hand(ann_file, dets)
    assert 0.2 < reference[0] < 0.9  # a non-trivial value, so agreement means something
    assert (reference[3:6] > 0).all()  # every area range has ground truth and hits
    ours = evaluate_coco(ann_file, dets, "pycocotools", verbose=False)
    np.testing.assert_array_equal(np.array(list(ours.values())), reference)
    faster = evaluate_coco(ann_file, dets, "faster_coco_eval", verbose=False)
    np.testing.assert_allclose(np.array(list(faster.values())), reference, rtol=0, atol=1e-12)
    assert evaluate_coco(ann_file, dets, verbose=False) == faster  # the default


def test_backends_agree_on_shapes_coco(shapes_coco):
    ann_file = shapes_coco / "annotations" / "instances_val2017.json"
    dets = _noisy_detections(json.loads(ann_file.read_text()), 3)
    a = evaluate_coco(ann_file, dets, "pycocotools", verbose=False)
    b = evaluate_coco(ann_file, dets, "faster_coco_eval", verbose=False)
    assert a["mAP"] > 0.1
    np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=0, atol=1e-12)


COCO_CATEGORY_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]


def _coco_like(tmp_path: Path, seed: int, num_images: int = 40) -> tuple[Path, np.ndarray]:
    """COCO val in miniature: the 80 COCO category ids, ~7 objects per image over all area ranges, ~1 %
    crowd; detections as SSD gives them: 2-12 jittered copies of each object (some with another class,
    ties in the 2-decimal scores) plus background false positives, 100-160 per image, so the per-category
    maxDets cut (1, 10, 100) and the score ordering both matter."""
    rng = np.random.default_rng(seed)
    images, anns, rows = _images(num_images, w=640, h=480, start=1), [], []
    for im in images:
        for _ in range(rng.poisson(7)):
            box, w, h = _random_coco_box(rng)
            cat = int(rng.choice(COCO_CATEGORY_IDS))
            anns.append(_ann(len(anns) + 1, im["id"], cat, box, int(rng.random() < 0.01)))
            for _ in range(rng.integers(2, 13)):
                x, y, bw, bh = np.asarray(box) + rng.normal(0, 0.1, 4) * [w, h, w, h]
                c = cat if rng.random() < 0.85 else int(rng.choice(COCO_CATEGORY_IDS))
                rows.append([im["id"], x, y, abs(bw), abs(bh), round(rng.random(), 2), c])
        mine = sum(1 for r in rows if r[0] == im["id"])
        for _ in range(max(0, int(rng.integers(100, 160)) - mine)):
            bw, bh = rng.uniform(4, 300, 2)
            c = int(rng.choice(COCO_CATEGORY_IDS))
            rows.append(
                [im["id"], rng.uniform(0, 640 - bw), rng.uniform(0, 480 - bh), bw, bh, rng.random(), c]
            )
    cats = [{"id": c, "name": f"c{c}"} for c in COCO_CATEGORY_IDS]
    array = np.asarray(rows, dtype=np.float64)
    array[:, 1:5] = np.round(array[:, 1:5], 3)
    array[:, 5] = np.round(array[:, 5], 5)
    return _write(tmp_path / f"coco_like_{seed}.json", images, anns, cats), array


@pytest.mark.parametrize("seed", [0, 1])
def test_backends_agree_at_coco_density(tmp_path, seed):
    """The default backend gives pycocotools' numbers exactly on COCO-like data (80 categories, 100+
    detections per image, tied scores, crowd regions)."""
    ann_file, array = _coco_like(tmp_path, seed)
    assert len(array) > 100 * 40 and len(np.unique(array[:, 5])) < 0.8 * len(array)  # ties
    results = coco_array_to_results(array)
    reference = _pycocotools_by_hand(ann_file, results)
    assert 0.1 < reference[0] < 0.9 and (reference[3:6] > 0).all() and reference[6] < reference[7]
    stats = {b: list(evaluate_coco(ann_file, array, b, verbose=False).values()) for b in BACKENDS}
    np.testing.assert_array_equal(stats["pycocotools"], reference)
    np.testing.assert_allclose(stats["faster_coco_eval"], reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_array_list_and_json_file_give_the_same_stats(tmp_path, backend):
    ann_file, array = _coco_like(tmp_path, 2, num_images=12)
    results = coco_array_to_results(array)
    json_file = tmp_path / "dets.json"
    write_coco_results_json(json_file, array)
    assert json_file.read_text() == json.dumps(results, separators=(",", ":"))  # byte for byte
    assert json.loads(json_file.read_text()) == results
    from_array = evaluate_coco(ann_file, array, backend, verbose=False)
    assert evaluate_coco(ann_file, results, backend, verbose=False) == from_array
    assert evaluate_coco(ann_file, json_file, backend, verbose=False) == from_array
    assert 0.1 < from_array["mAP"] < 0.9


def test_results_array_conversion_and_writer_edge_cases(tmp_path):
    array = np.array([[5, -0.5, 1e-3, 2.25, 1 / 3, 0.98765, 7], [6, 0, 0, 1, 1, 0.5, 12]], dtype=np.float64)
    results = coco_array_to_results(array)
    assert results[0] == {
        "image_id": 5,
        "category_id": 7,
        "bbox": [-0.5, 1e-3, 2.25, 1 / 3],
        "score": 0.98765,
    }
    assert all(type(r["image_id"]) is int and type(r["category_id"]) is int for r in results)
    assert all(type(v) is float for r in results for v in [*r["bbox"], r["score"]])
    buf = io.StringIO()
    write_coco_results_json(buf, array)
    assert buf.getvalue() == json.dumps(results, separators=(",", ":"))
    for empty in (np.zeros((0, 7)), np.zeros((0,))):
        assert coco_array_to_results(empty) == []
        buf = io.StringIO()
        write_coco_results_json(buf, empty)
        assert buf.getvalue() == "[]"
    array[1, 5] = np.nan  # not valid JSON with repr ("nan"): written as json.dumps writes it
    buf = io.StringIO()
    write_coco_results_json(buf, array)
    assert '"score":NaN' in buf.getvalue()
    assert buf.getvalue() == json.dumps(coco_array_to_results(array), separators=(",", ":"))
    with pytest.raises(ValueError, match=r"\(M, 7\)"):
        coco_array_to_results(np.zeros((3, 6)))
    ann_file = _write(tmp_path / "one.json", _images(1), [_ann(1, 1, 3, [0, 0, 5, 5])])
    with pytest.raises(ValueError, match=r"\(M, 7\)"):
        evaluate_coco(ann_file, np.zeros((2, 6)), verbose=False)


def test_image_ids_subset(tmp_path):
    ann_file, dataset = _random_dataset(tmp_path, 0)
    dets = _noisy_detections(dataset, 0)
    subset = [im["id"] for im in dataset["images"][:15]]
    with pytest.warns(UserWarning, match="15 of the 40 images"):
        ours = evaluate_coco(ann_file, dets, "pycocotools", verbose=False, image_ids=torch.tensor(subset))
    np.testing.assert_array_equal(list(ours.values()), _pycocotools_by_hand(ann_file, dets, subset))
    with pytest.warns(UserWarning):
        faster = evaluate_coco(ann_file, dets, "faster_coco_eval", verbose=False, image_ids=subset)
    np.testing.assert_allclose(list(faster.values()), list(ours.values()), atol=1e-12)
    with pytest.raises(ValueError, match="image_ids"):
        evaluate_coco(ann_file, dets, verbose=False, image_ids=[1])


# ----------------------------------------------------------------------------------------------------------
# Conversion from validation-step outputs.


def test_to_coco_results_conversion():
    cmap = DuckCategoryMap([3, 7, 12])
    boxes = [torch.tensor([[10.0, 20.0, 60.0, 50.0], [0.123456, 1.0, 2.987654, 3.5]]), torch.zeros(0, 4)]
    scores = [torch.tensor([0.987654321, 0.5]), torch.zeros(0)]
    labels = [torch.tensor([1, 3]), torch.zeros(0, dtype=torch.int64)]
    results = to_coco_results(torch.tensor([5, 6]), boxes, scores, labels, cmap)
    assert results == [
        {"image_id": 5, "category_id": 3, "bbox": [10.0, 20.0, 50.0, 30.0], "score": 0.98765},
        {"image_id": 5, "category_id": 12, "bbox": [0.123, 1.0, 2.864, 2.5], "score": 0.5},
    ]
    assert all(type(v) is float for r in results for v in [*r["bbox"], r["score"]])
    assert all(type(r["image_id"]) is int and type(r["category_id"]) is int for r in results)
    json.dumps(results)  # JSON-serialisable
    dets = [
        {"image_id": 5, "boxes": boxes[0], "scores": scores[0], "labels": labels[0]},
        {"image_id": 6, "boxes": boxes[1], "scores": scores[1], "labels": labels[1]},
    ]
    assert detections_to_coco_results(dets, cmap) == results
    assert detections_to_coco_results(dets, cmap, box_decimals=6)[1]["bbox"][2] == 2.864198
    with pytest.raises(ValueError, match="missing keys"):
        detections_to_coco_results([{"image_id": 1, "boxes": boxes[0]}], cmap)
    with pytest.raises(ValueError, match="disagree"):
        to_coco_array([1], [torch.zeros(2, 4)], [torch.zeros(3)], [torch.ones(2, dtype=torch.long)], cmap)


def test_roundtrip_through_evaluation_with_noncontiguous_ids(tmp_path):
    """Detections built from ground truth (ltrb, contiguous labels) evaluate to mAP 1 after conversion."""
    ann_file, dataset = _random_dataset(tmp_path, 2, num_images=12)
    cmap = DuckCategoryMap([3, 7, 12])
    per_image = []
    for im in dataset["images"]:
        anns = [a for a in dataset["annotations"] if a["image_id"] == im["id"] and not a["iscrowd"]]
        xywh = torch.tensor([a["bbox"] for a in anns], dtype=torch.float64).reshape(-1, 4)
        ltrb = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], dim=1).float()
        labels = torch.tensor(
            [cmap.category_ids.index(a["category_id"]) + 1 for a in anns], dtype=torch.int64
        )
        per_image.append(
            {"image_id": im["id"], "boxes": ltrb, "scores": torch.rand(len(anns)), "labels": labels}
        )
    stats = evaluate_coco(ann_file, detections_to_coco_results(per_image, cmap), verbose=False)
    assert stats["mAP"] == pytest.approx(1.0)
    assert stats["mAR_100"] == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_rounding_leaves_stats_unchanged(tmp_path, seed):
    """Default rounding (3-decimal boxes, 5-decimal scores) keeps full-precision stats; the JSON shrinks."""
    ann_file, dataset = _random_dataset(tmp_path, seed, num_images=60)
    dets = _noisy_detections(dataset, seed)
    cmap = DuckCategoryMap([3, 7, 12])
    ids = sorted({d["image_id"] for d in dets})
    boxes, scores, labels = [], [], []
    for i in ids:
        mine = [d for d in dets if d["image_id"] == i]
        xywh = np.array([d["bbox"] for d in mine], dtype=np.float64)
        boxes.append(np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1))
        scores.append(np.array([d["score"] for d in mine]))
        labels.append(np.array([cmap.category_ids.index(d["category_id"]) + 1 for d in mine]))
    full = to_coco_results(ids, boxes, scores, labels, cmap, box_decimals=12, score_decimals=12)
    rounded = to_coco_results(ids, boxes, scores, labels, cmap)
    a = np.array(list(evaluate_coco(ann_file, full, verbose=False).values()))
    b = np.array(list(evaluate_coco(ann_file, rounded, verbose=False).values()))
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert len(json.dumps(rounded)) < 0.7 * len(json.dumps(full))


def test_summary_format_matches_pycocotools(two_objects, capsys):
    from ssd_lightning.evaluation import format_summary

    stats = evaluate_coco(two_objects, [_det(1, 3, [10, 10, 50, 50], 0.9)], "pycocotools")
    printed = capsys.readouterr().out.rstrip("\n")
    assert printed == format_summary(stats)  # pycocotools' own summarize() output
    evaluate_coco(two_objects, [_det(1, 3, [10, 10, 50, 50], 0.9)], "faster_coco_eval")
    assert capsys.readouterr().out.rstrip("\n") == printed


def test_perfect_detections_on_shapes_with_real_category_map(shapes_coco):
    """GT boxes of the shapes val set -> contiguous labels -> to_coco_results (CategoryMap) -> mAP 1."""
    from ssd_lightning.data.categories import CategoryMap

    ann_file = shapes_coco / "annotations" / "instances_val2017.json"
    dataset = json.loads(ann_file.read_text())
    cmap = CategoryMap.from_coco(ann_file)
    ids, boxes, scores, labels = [], [], [], []
    for im in dataset["images"]:
        anns = [a for a in dataset["annotations"] if a["image_id"] == im["id"]]
        xywh = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        ids.append(im["id"])
        boxes.append(torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], dim=1))
        scores.append(torch.linspace(0.9, 0.5, len(anns)))
        labels.append(
            cmap.category_id_to_label(torch.tensor([a["category_id"] for a in anns], dtype=torch.int64))
        )
    results = to_coco_results(torch.tensor(ids), boxes, scores, labels, cmap)
    assert len(results) == len(dataset["annotations"])
    assert {r["category_id"] for r in results} <= set(cmap.category_ids)
    for backend in ("pycocotools", "faster_coco_eval"):
        stats = evaluate_coco(ann_file, results, backend, verbose=False)
        assert stats["mAP"] == pytest.approx(1.0) and stats["mAR_100"] == pytest.approx(1.0)
