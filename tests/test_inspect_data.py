"""task=inspect_data: label statistics and the default-box fit against hand counts and DALI's box_encoder,
batches drawn from the real training pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers import requires_dali, run_train_py

# 4 hand-made default boxes (ltrb): two quarters, the whole image, the centre
ANCHORS = torch.tensor(
    [[0, 0, 0.5, 0.5], [0.5, 0, 1, 0.5], [0, 0, 1, 1], [0.25, 0.25, 0.75, 0.75]], dtype=torch.float32
)


def _coco(tmp_path, anns, images=None):
    images = images or [
        {"id": 7, "width": 200, "height": 100, "file_name": "a.jpg"},
        {"id": 8, "width": 400, "height": 400, "file_name": "b.jpg"},
        {"id": 9, "width": 50, "height": 50, "file_name": "c.jpg"},
    ]
    data = {
        "images": images,
        "annotations": anns,
        "categories": [{"id": 5, "name": "cat"}, {"id": 2, "name": "dog"}],
    }
    path = tmp_path / "ann.json"
    path.write_text(json.dumps(data))
    return path


def test_label_statistics_hand_counts(tmp_path):
    from ssd_lightning.data.inspection import label_statistics, load_coco_arrays

    anns = [
        # image 7: two cats (one crowd, with an RLE segmentation), one dog
        {"id": 1, "image_id": 7, "category_id": 5, "bbox": [0, 0, 10, 20], "area": 200, "iscrowd": 0},
        {"id": 2, "image_id": 7, "category_id": 5, "bbox": [0, 0, 40, 40], "area": 1600, "iscrowd": 1,
         "segmentation": {"counts": "a[]}0", "size": [100, 200]}},
        {"id": 3, "image_id": 7, "category_id": 2, "bbox": [5, 5, 200, 50], "area": 10000, "iscrowd": 0,
         "segmentation": [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]},
        # image 8: one dog without area/iscrowd (area = w * h = 96 * 96 = 9216: large)
        {"id": 4, "image_id": 8, "category_id": 2, "bbox": [0, 0, 96, 96]},
    ]  # fmt: skip
    stats = label_statistics(load_coco_arrays(_coco(tmp_path, anns)))
    assert (stats["images"], stats["boxes"], stats["images_without_boxes"], stats["crowd_boxes"]) == (
        3,
        4,
        1,
        1,
    )
    assert stats["boxes_per_image"]["histogram"] == [1, 1, 0, 1]
    assert stats["boxes_per_image"]["max"] == 3 and stats["boxes_per_image"]["mean"] == pytest.approx(4 / 3)
    assert stats["size_buckets"] == {"small": 1, "medium": 1, "large": 2}  # 200 | 1600 | 10000, 9216
    assert [(c["name"], c["category_id"], c["boxes"], c["images"], c["crowd"]) for c in stats["classes"]] == [
        ("cat", 5, 2, 1, 1),
        ("dog", 2, 2, 2, 0),
    ]
    ratio = stats["aspect_ratio"]
    assert sum(ratio["counts"]) == 4 and ratio["median"] == pytest.approx(1.0)  # 0.5, 1, 4, 1
    edges = np.asarray(ratio["edges"])
    assert ratio["counts"][int(np.searchsorted(edges, 4.0, side="right")) - 1] == 1


def test_unknown_image_is_one_line_error(tmp_path):
    from ssd_lightning.data.inspection import load_coco_arrays
    from ssd_lightning.errors import DataError

    path = _coco(tmp_path, [{"id": 1, "image_id": 99, "category_id": 5, "bbox": [0, 0, 1, 1]}])
    with pytest.raises(DataError, match=r"ann.json.*image_id \[99\]"):
        load_coco_arrays(path)
    with pytest.raises(DataError, match=r"cannot read .*missing.json as a COCO instances file"):
        load_coco_arrays(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(DataError, match=r"ann.json is not valid JSON"):
        load_coco_arrays(path)


def test_match_hand_computed():
    """Hand-computed IoUs with the 4 anchors (float32-exact values)."""
    from ssd_lightning.data.inspection import match_default_boxes

    # g0 = anchor 0: IoU 1 / 0 / .25 / .1429; g1 (top half): IoU .5 with anchors 0, 1, 2 (a tie: the last,
    # anchor 2, is forced) and .2 with anchor 3. Anchor 0 -> g0 (1 > .5), 1 -> g1 at .5 (not > .5: negative),
    # 2 -> g1 (forced), 3 -> g1 at .2 (negative).
    # Second image: the same box twice: both forced onto anchor 0, the later keeps it, the first gets none.
    img1 = np.array([[0, 0, 0.5, 0.5], [0, 0, 1, 0.5]], dtype=np.float32)
    img2 = np.array([[0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5]], dtype=np.float32)
    img3 = np.zeros((0, 4), dtype=np.float32)  # no boxes
    matched, best = match_default_boxes([img1, img3, img2], ANCHORS)
    assert matched.tolist() == [1, 1, 0, 1]
    assert best.tolist() == [1.0, 0.5, 1.0, 1.0]


def test_default_box_fit_groups(tmp_path):
    """Per bucket/class aggregation of the hand case, through the annotation file (pixels -> relative)."""
    from ssd_lightning.data.inspection import default_box_fit, load_coco_arrays

    anns = [  # image 8 (400 x 400): g0 = top-left quarter (cat, large), g1 = top half (dog, large)
        {"id": 1, "image_id": 8, "category_id": 5, "bbox": [0, 0, 200, 200], "area": 40000, "iscrowd": 0},
        {"id": 2, "image_id": 8, "category_id": 2, "bbox": [0, 0, 400, 200], "area": 80000, "iscrowd": 0},
        {"id": 3, "image_id": 9, "category_id": 2, "bbox": [0, 0, 25, 25], "area": 625, "iscrowd": 1},
    ]  # fmt: skip
    arrays = load_coco_arrays(_coco(tmp_path, anns))
    fit = default_box_fit(arrays, ANCHORS, include_crowd=False)
    assert fit["images"] == 1 and fit["overall"]["boxes"] == 2
    assert fit["overall"]["forced_only"] == 1 and fit["overall"]["forced_only_share"] == 0.5
    assert fit["overall"]["best_iou_mean"] == pytest.approx(0.75)
    assert fit["size_buckets"]["small"]["boxes"] == 0 and fit["size_buckets"]["large"]["matched_mean"] == 1.0
    assert [(c["name"], c["boxes"], c["forced_only"]) for c in fit["classes"]] == [
        ("cat", 1, 0),
        ("dog", 1, 1),
    ]
    assert fit["matched_histogram"] == [0, 2]
    with_crowd = default_box_fit(arrays, ANCHORS)  # crowd box = top-left quarter of image 9: like g0
    assert with_crowd["images"] == 2 and with_crowd["size_buckets"]["small"]["matched_mean"] == 1.0


def _random_images(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        m = int(rng.integers(1, 9))
        centre, size = rng.uniform(0.05, 0.95, (m, 2)), rng.uniform(0.02, 0.8, (m, 2))
        out.append(
            np.clip(np.concatenate([centre - size / 2, centre + size / 2], 1), 0, 1).astype(np.float32)
        )
    # exact ties: a default box itself, the same box twice, a box centred between grid cells
    out.append(np.array([[0.1, 0.1, 0.3, 0.3], [0.1, 0.1, 0.3, 0.3], [0.25, 0.25, 0.75, 0.75]], np.float32))
    return out


def _per_gt_counts(labels: np.ndarray, m: int) -> list[int]:
    """Label g + 1 marks ground truth g: positives per ground truth from an encoder's output labels."""
    return np.bincount(labels[labels > 0] - 1, minlength=m).tolist()


@pytest.mark.dali
@requires_dali
def test_fit_agrees_with_dali_box_encoder():
    """Positives per ground truth equal DALI's own box_encoder's (the training targets), ties included."""
    from nvidia.dali import fn, pipeline_def

    from ssd_lightning.data.inspection import match_default_boxes
    from ssd_lightning.models import dboxes300_coco

    images = _random_images(0, 15)
    anchors = dboxes300_coco().ltrb

    @pipeline_def(batch_size=len(images), num_threads=1, device_id=None)
    def encode():
        boxes = fn.external_source(source=lambda: images, batch=True)
        labels = fn.external_source(
            source=lambda: [np.arange(1, len(b) + 1, dtype=np.int32) for b in images], batch=True
        )
        encoded_boxes, encoded_labels = fn.box_encoder(
            boxes, labels, criteria=0.5, anchors=anchors.flatten().tolist()
        )
        return encoded_boxes, encoded_labels

    pipe = encode()
    pipe.build()
    _, labels = pipe.run()
    expected = [c for k, b in enumerate(images) for c in _per_gt_counts(np.asarray(labels[k]), len(b))]
    matched, _ = match_default_boxes(images, anchors)
    assert matched.tolist() == expected


def test_fit_agrees_with_boxcoder_without_ties():
    """The project's reference encoder gives the same positives per ground truth (no exact ties here)."""
    from ssd_lightning.data.inspection import match_default_boxes
    from ssd_lightning.models import BoxCoder, dboxes300_coco

    images = _random_images(1, 10)[:-1]
    coder = BoxCoder(dboxes300_coco())
    expected = []
    for b in images:
        _, labels = coder.encode(torch.from_numpy(b), torch.arange(1, len(b) + 1))
        expected += _per_gt_counts(labels.numpy(), len(b))
    matched, _ = match_default_boxes(images, dboxes300_coco().ltrb)
    assert matched.tolist() == expected


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lt, rb = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter)


@pytest.mark.slow
@pytest.mark.dali
@requires_dali
def test_inspect_data_end_to_end(shapes_coco, tmp_path):
    """`train.py experiment=demo task=inspect_data`: files written, decoded batch boxes = ground truth."""
    result = run_train_py(
        "experiment=demo",
        "task=inspect_data",
        f"data.root={shapes_coco}",
        "data.batch_size=4",
        f"paths.log_dir={tmp_path}",
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = (tmp_path / "demo").iterdir()
    for name in ("data_stats.json", "data_stats.png", "default_box_fit.json", "default_box_fit.png"):
        assert (run / name).stat().st_size > 0, name
    assert "default-box fit" in result.stdout + result.stderr
    ann = json.loads((shapes_coco / "annotations" / "instances_train2017.json").read_text())
    stats = json.loads((run / "data_stats.json").read_text())
    assert stats["train"]["boxes"] == len(ann["annotations"]) and stats["train"]["images"] == len(
        ann["images"]
    )
    cat_label = {c["id"]: k + 1 for k, c in enumerate(ann["categories"])}
    sizes = {im["id"]: (im["width"], im["height"]) for im in ann["images"]}
    for i in range(2):
        assert (run / "batches" / f"batch_{i}.jpg").stat().st_size > 0
        batch = json.loads((run / "batches" / f"batch_{i}.json").read_text())
        assert len(batch["images"]) == 4
        for record in batch["images"]:
            w, h = sizes[record["image_id"]]
            gts = [a for a in ann["annotations"] if a["image_id"] == record["image_id"]]
            gt = np.array(
                [[x / w, y / h, (x + bw) / w, (y + bh) / h] for x, y, bw, bh in (a["bbox"] for a in gts)]
            )
            gt_labels = np.array([cat_label[a["category_id"]] for a in gts])
            decoded = np.array(record["boxes"]).reshape(-1, 4) / batch["image_size"]
            assert len(decoded) == len(gt)  # every box back, none invented (augment=false)
            iou = _iou(decoded, gt)
            best = iou.argmax(1)
            assert (iou.max(1) > 0.9).all()
            assert (gt_labels[best] == np.array(record["labels"])).all()
            assert sorted(best.tolist()) == list(range(len(gt)))
