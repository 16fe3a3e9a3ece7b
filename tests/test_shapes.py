"""Tests for the synthetic shapes dataset generator (ssd_lightning.data.shapes) and its CLI."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ssd_lightning.data import shapes
from ssd_lightning.data.shapes import (
    SHAPE_CATEGORIES,
    ensure_classification_dataset,
    ensure_detection_dataset,
    make_classification_dataset,
    make_detection_dataset,
    render_detection_image,
)
from tests.helpers import REPO_ROOT, run_script

SMALL = {"num_train": 12, "num_val": 6, "seed": 5, "min_size": 64, "max_size": 160}
EXPECTED_IDS = {3: "rectangle", 7: "ellipse", 11: "triangle", 20: "star"}


@pytest.fixture(scope="module")
def det_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_detection_dataset(tmp_path_factory.mktemp("shapes") / "det", **SMALL)


def _load(root: Path, split: str) -> dict:
    return json.loads((root / "annotations" / f"instances_{split}2017.json").read_text())


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.mode == "RGB"
        return np.asarray(im).copy()


def _shoelace(poly: np.ndarray) -> float:
    x, y = poly[:, 0], poly[:, 1]
    return 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))


def _blocks(a: np.ndarray, k: int = 4) -> np.ndarray:
    h, w = a.shape[0] // k * k, a.shape[1] // k * k
    return a[:h, :w].reshape(h // k, k, w // k, k, -1).astype(np.float64).mean(axis=(1, 3))


def _erode(mask: np.ndarray, r: int) -> np.ndarray:
    out = mask.copy()
    for _ in range(r):
        inner = out.copy()
        inner[1:] &= out[:-1]
        inner[:-1] &= out[1:]
        inner[:, 1:] &= out[:, :-1]
        inner[:, :-1] &= out[:, 1:]
        inner[[0, -1]] = False
        inner[:, [0, -1]] = False
        out = inner
    return out


# ---------------------------------------------------------------------------------------------- layout
def test_coco_layout_and_keys(det_root: Path) -> None:
    for split, count in (("train", 12), ("val", 6)):
        data = _load(det_root, split)
        assert set(data) == {"info", "licenses", "images", "annotations", "categories"}
        assert len(data["images"]) == count
        files = sorted(p.name for p in (det_root / f"{split}2017").iterdir())
        assert files == sorted(im["file_name"] for im in data["images"])
        for ann in data["annotations"]:
            assert set(ann) == {"id", "image_id", "category_id", "bbox", "area", "iscrowd", "segmentation"}
            assert ann["iscrowd"] == 0
    # no temporary folder left next to the dataset
    assert [p.name for p in det_root.parent.iterdir()] == ["det"]


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools + numpy 2
def test_pycocotools_loads_and_boxes_inside_images(det_root: Path) -> None:
    from pycocotools.coco import COCO

    all_image_ids, all_ann_ids = [], []
    for split in ("train", "val"):
        coco = COCO(str(det_root / "annotations" / f"instances_{split}2017.json"))
        assert {c["id"]: c["name"] for c in coco.loadCats(coco.getCatIds())} == EXPECTED_IDS
        all_image_ids += coco.getImgIds()
        anns = coco.loadAnns(coco.getAnnIds())
        all_ann_ids += [a["id"] for a in anns]
        for ann in anns:
            img = coco.imgs[ann["image_id"]]
            x, y, w, h = ann["bbox"]
            assert w > 0 and h > 0
            assert x >= 0 and y >= 0 and x + w <= img["width"] and y + h <= img["height"]
            assert ann["category_id"] in EXPECTED_IDS
            assert 0 < ann["area"] <= w * h
            # the polygon rasterises to about the visible area when the shape is unoccluded (area ~= mask)
            assert coco.annToMask(ann).sum() >= ann["area"] * 0.9 - 10
            with Image.open(det_root / f"{split}2017" / img["file_name"]) as im:
                assert im.size == (img["width"], img["height"])
    assert min(all_image_ids) > 0 and len(set(all_image_ids)) == len(all_image_ids)
    assert min(all_ann_ids) > 0 and len(set(all_ann_ids)) == len(all_ann_ids)


def test_category_ids_are_non_contiguous() -> None:
    assert {c["id"]: c["name"] for c in SHAPE_CATEGORIES} == EXPECTED_IDS
    assert all(c["supercategory"] == "shape" for c in SHAPE_CATEGORIES)


def test_empty_images_listed(det_root: Path) -> None:
    # every 20th image (index 3, 23, ...) of each split has no objects, yet is listed in `images`
    for split in ("train", "val"):
        data = _load(det_root, split)
        with_objects = {a["image_id"] for a in data["annotations"]}
        empty = [im["id"] for im in data["images"] if im["id"] not in with_objects]
        fourth = data["images"][3]["id"]
        assert fourth in empty
        assert len(empty) < len(data["images"]) / 2  # most images do have objects


def test_varied_sizes_aspects_and_scales(det_root: Path) -> None:
    data = _load(det_root, "train")
    sizes = {(im["width"], im["height"]) for im in data["images"]}
    assert len(sizes) == len(data["images"])
    aspects = [w / h for w, h in sizes]
    assert min(aspects) < 0.9 and max(aspects) > 1.1
    assert all(64 <= s <= 160 for wh in sizes for s in wh)
    dims = {im["id"]: im for im in data["images"]}
    rel = [
        math.sqrt(a["area"] / (dims[a["image_id"]]["width"] * dims[a["image_id"]]["height"]))
        for a in data["annotations"]
    ]
    assert min(rel) < 0.12 and max(rel) > 0.3
    assert len({a["category_id"] for a in data["annotations"]}) >= 3


# ---------------------------------------------------------------------------------------- determinism
def test_deterministic_same_seed_differs_with_other_seed(det_root: Path, tmp_path: Path) -> None:
    again = make_detection_dataset(tmp_path / "again", **SMALL)
    other = make_detection_dataset(tmp_path / "other", **{**SMALL, "seed": SMALL["seed"] + 1})
    for split in ("train", "val"):
        name = f"instances_{split}2017.json"
        assert (det_root / "annotations" / name).read_bytes() == (again / "annotations" / name).read_bytes()
        assert (det_root / "annotations" / name).read_bytes() != (other / "annotations" / name).read_bytes()
        for f in sorted((det_root / f"{split}2017").iterdir()):
            assert np.array_equal(_pixels(f), _pixels(again / f"{split}2017" / f.name))
    first = sorted((det_root / "train2017").iterdir())[0].name
    a, b = _pixels(det_root / "train2017" / first), _pixels(other / "train2017" / first)
    assert a.shape != b.shape or not np.array_equal(a, b)


def test_image_depends_only_on_seed_split_index() -> None:
    a, objs_a = render_detection_image(1, "train", 7, min_size=64, max_size=96)
    b, objs_b = render_detection_image(1, "train", 7, min_size=64, max_size=96)
    c, _ = render_detection_image(1, "val", 7, min_size=64, max_size=96)
    assert np.array_equal(a, b) and [o.bbox() for o in objs_a] == [o.bbox() for o in objs_b]
    assert a.shape != c.shape or not np.array_equal(a, c)


def test_default_scale_range_is_pinned() -> None:
    """The demo's dataset must not change under its users: image 5 of val (seed 0) as generated since the
    first release (sha256 of the pixels before JPEG, and the visible boxes)."""
    image, objects = render_detection_image(0, "val", 5)
    assert image.shape == (282, 425, 3)
    digest = hashlib.sha256(image.tobytes()).hexdigest()
    assert digest == "0596489088ae501b201c11fcddebc13a508d3f8269a32c7f61ca4a4633922696"
    assert [o.bbox() for o in objects] == [
        [265.0, 30.0, 95.0, 102.0],
        [312.0, 84.0, 22.0, 23.0],
        [73.0, 87.0, 130.0, 194.0],
        [192.0, 257.0, 24.0, 24.0],
    ]


def _span(obj: shapes.ShapeObject) -> float:
    """Largest side of the full (amodal) outline's box, in pixels."""
    return float((obj.polygon.max(axis=0) - obj.polygon.min(axis=0)).max())


def test_scale_range_changes_sizes_only() -> None:
    """min_scale/max_scale bound every shape's extent; image size, shape count and kinds stay the same."""
    spans_default, spans_big, spans_small = [], [], []
    for index in range(12):
        base, objs = render_detection_image(3, "train", index, min_size=96, max_size=200)
        big, objs_big = render_detection_image(3, "train", index, min_size=96, max_size=200, min_scale=0.3)
        small, objs_small = render_detection_image(
            3, "train", index, min_size=96, max_size=200, min_scale=0.1, max_scale=0.2
        )
        short = min(base.shape[:2])
        assert base.shape == big.shape == small.shape
        assert [o.category_id for o in objs] == [o.category_id for o in objs_big]
        assert [o.category_id for o in objs] == [o.category_id for o in objs_small]
        spans_default += [_span(o) / short for o in objs]
        spans_big += [_span(o) / short for o in objs_big]
        spans_small += [_span(o) / short for o in objs_small]
    # A shape's outline spans between ~0.6x (thin triangle) and ~1.6x (long rectangle) of its size.
    assert min(spans_big) >= 0.5 * 0.3
    assert min(spans_default) < 0.5 * 0.3  # the default range does draw shapes that small
    assert max(spans_small) <= 1.7 * 0.2 and min(spans_small) >= 0.5 * 0.1
    assert max(spans_default) > 1.7 * 0.2


@pytest.mark.parametrize(
    "bad", [{"min_scale": 0.0}, {"min_scale": 0.5, "max_scale": 0.4}, {"max_scale": 1.5}]
)
def test_scale_range_validated(bad: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_scale"):
        render_detection_image(0, "train", 0, **bad)
    with pytest.raises(ValueError, match="min_scale"):
        make_detection_dataset(tmp_path / "d", num_train=1, num_val=1, **bad)
    assert not (tmp_path / "d").exists()


def test_scale_range_recorded_only_when_not_default(
    det_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    meta = json.loads((det_root / shapes.METADATA_FILE).read_text())
    assert "min_scale" not in meta and "max_scale" not in meta  # same file as before the option existed
    with caplog.at_level(logging.WARNING, logger="ssd_lightning.data.shapes"):
        ensure_detection_dataset(det_root, **SMALL, min_scale=0.07, max_scale=0.75)
    assert not caplog.records  # asking for the defaults explicitly matches a default dataset
    with caplog.at_level(logging.WARNING, logger="ssd_lightning.data.shapes"):
        ensure_detection_dataset(det_root, **SMALL, min_scale=0.15)
    assert len(caplog.records) == 1 and "min_scale" in caplog.records[0].getMessage()
    caplog.clear()
    root = make_detection_dataset(
        tmp_path / "big", num_train=2, num_val=1, min_size=48, max_size=64, min_scale=0.2
    )
    assert json.loads((root / shapes.METADATA_FILE).read_text())["min_scale"] == 0.2
    with caplog.at_level(logging.WARNING, logger="ssd_lightning.data.shapes"):
        ensure_detection_dataset(root, num_train=2, num_val=1, min_scale=0.2)
        assert not caplog.records
        ensure_detection_dataset(root, num_train=2, num_val=1, min_scale=0.07)  # 0.2 on disk
    assert len(caplog.records) == 1 and "min_scale" in caplog.records[0].getMessage()


# ----------------------------------------------------------------------------------- drawn content
def test_annotations_match_drawn_shapes(det_root: Path) -> None:
    """Re-render each image: the JPEG matches it, kept objects are those >= 25 % visible, their boxes
    are the visible pixel extents, and the pixels there really have the shape's colour."""
    seen_occluded = checked = dropped = 0
    for split in ("train", "val"):
        data = _load(det_root, split)
        for i, im in enumerate(data["images"]):
            array, objects = render_detection_image(
                SMALL["seed"], split, i, min_size=SMALL["min_size"], max_size=SMALL["max_size"]
            )
            jpeg = _pixels(det_root / f"{split}2017" / im["file_name"]).astype(np.int16)
            assert jpeg.shape == array.shape == (im["height"], im["width"], 3)
            # only JPEG loss between them: it removes fine noise, so compare 4x4 block means
            assert np.abs(_blocks(jpeg) - _blocks(array)).mean() < 5
            anns = [a for a in data["annotations"] if a["image_id"] == im["id"]]
            kept = [o for o in objects if o.visible_fraction >= 0.25]
            seen_occluded += sum(0 < o.visible_fraction < 1 for o in objects)
            dropped += len(objects) - len(kept)
            assert [a["category_id"] for a in anns] == [o.category_id for o in kept]
            for ann, obj in zip(anns, kept, strict=True):
                assert ann["bbox"] == obj.bbox()
                assert ann["area"] == obj.visible.sum()
                x, y, w, h = (int(v) for v in ann["bbox"])
                # the visible mask touches all four sides of its box
                box = obj.visible[y : y + h, x : x + w]
                assert box[0].any() and box[-1].any() and box[:, 0].any() and box[:, -1].any()
                assert not obj.visible[:y].any() and not obj.visible[y + h :].any()
                # the shape's pixels have its fill colour (up to noise), in the JPEG too away from edges
                # (noise sigma <= 8: the median of n pixels is within ~4 standard errors, 40 / sqrt(n))
                tol = 2 + 40 / math.sqrt(obj.visible.sum())
                assert np.abs(np.median(array[obj.visible], axis=0) - obj.colour).max() <= tol
                inner = _erode(obj.visible, 3)
                if inner.sum() >= 20:
                    checked += 1
                    median = np.median(jpeg[inner], axis=0)
                    assert np.abs(median - obj.colour).max() <= 12, (median, obj.colour)
    assert seen_occluded > 0  # occlusion really happens
    assert checked >= 10
    assert dropped >= 1  # with SMALL's seed, one shape ends up < 25 % visible and is left out


def test_rasterise_known_areas() -> None:
    # axis-aligned 10x10 square with corners on pixel boundaries -> exactly 100 pixel centres inside
    square = np.array([[10.0, 10.0], [20.0, 10.0], [20.0, 20.0], [10.0, 20.0]])
    mask = shapes._rasterise(square, None, 0, 0, 32, 32, np.array([15.0, 15.0]))
    assert mask.sum() == 100 and mask[10:20, 10:20].all()
    rng = np.random.default_rng(0)
    for kind in ("rectangle", "ellipse", "triangle", "star"):
        outline, ellipse = shapes._shape_outline(rng, kind, 60.0)
        centre = np.array([50.0, 50.0])
        mask = shapes._rasterise(outline + centre, ellipse, 0, 0, 100, 100, centre)
        expected = math.pi * ellipse[0] * ellipse[1] if ellipse else _shoelace(outline)
        assert abs(mask.sum() - expected) / expected < 0.05, kind


def test_fully_hidden_object_is_dropped() -> None:
    img = np.full((120, 120, 3), 128, dtype=np.uint8)
    centre = np.array([60.0, 60.0])
    rng = np.random.default_rng(3)
    # ellipse minor radius >= 0.45 * 100 / 2 = 22.5 > 15 = radius bound of the small star
    objs = shapes._draw_shapes(rng, img, ["star", "ellipse"], [30.0, 100.0], centres=[centre, centre])
    assert objs[0].full_area > 0 and objs[0].visible_fraction == 0.0
    assert objs[1].visible_fraction == 1.0
    assert (img[objs[1].visible] == objs[1].colour).all()


# ------------------------------------------------------------------------------------ classification
def test_classification_layout(tmp_path: Path) -> None:
    root = make_classification_dataset(
        tmp_path / "cls", num_train_per_class=3, num_val_per_class=2, seed=1, image_size=48
    )
    for split, count in (("train", 3), ("val", 2)):
        assert sorted(p.name for p in (root / split).iterdir()) == sorted(EXPECTED_IDS.values())
        for name in EXPECTED_IDS.values():
            files = sorted((root / split / name).glob("*.jpg"))
            assert len(files) == count
            assert _pixels(files[0]).shape == (48, 48, 3)
    # deterministic: same seed, same pixels
    a = _pixels(root / "train" / "star" / "star_00000.jpg")
    again = make_classification_dataset(
        tmp_path / "cls2", num_train_per_class=3, num_val_per_class=2, seed=1, image_size=48
    )
    assert np.array_equal(a, _pixels(again / "train" / "star" / "star_00000.jpg"))


def test_classification_shape_is_drawn() -> None:
    img = shapes.render_classification_image(0, "train", 1, 0, image_size=64)
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    rng = shapes._rng(0, shapes.CLS_SPLITS["train"], 1, 0)
    bg = shapes._background(rng, 64, 64)
    # more than 5 % of the pixels changed by far more than the noise level -> a shape is there
    assert (np.abs(img.astype(int) - bg).sum(axis=2) > 60).mean() > 0.05


# -------------------------------------------------------------------------------------------- ensure
def test_ensure_reuses_existing_dataset(det_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ann = det_root / "annotations" / "instances_train2017.json"
    before = (ann.stat().st_mtime_ns, (det_root / "train2017").stat().st_mtime_ns)

    def boom(*args, **kwargs):
        raise AssertionError("must not regenerate")

    monkeypatch.setattr(shapes, "make_detection_dataset", boom)
    assert ensure_detection_dataset(det_root, **SMALL) == det_root
    assert (ann.stat().st_mtime_ns, (det_root / "train2017").stat().st_mtime_ns) == before


def test_ensure_generates_and_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ssd_lightning.data.shapes"):
        root = ensure_detection_dataset(tmp_path / "new", num_train=2, num_val=1, min_size=48, max_size=64)
    assert _load(root, "val")["images"][0]["file_name"] in os.listdir(root / "val2017")
    lines = [r.getMessage() for r in caplog.records if "Generated" in r.getMessage()]
    assert len(lines) == 1 and str(root) in lines[0]
    root_c = ensure_classification_dataset(
        tmp_path / "c", num_train_per_class=1, num_val_per_class=1, image_size=32
    )
    mtime = (root_c / "train" / "ellipse").stat().st_mtime_ns
    assert ensure_classification_dataset(root_c) == root_c
    assert (root_c / "train" / "ellipse").stat().st_mtime_ns == mtime


def test_ensure_raises_on_incomplete(tmp_path: Path) -> None:
    root = make_detection_dataset(tmp_path / "det", num_train=2, num_val=1, min_size=48, max_size=64)
    (root / "annotations" / "instances_val2017.json").unlink()
    with pytest.raises(FileExistsError, match=r"instances_val2017\.json.*delete"):
        ensure_detection_dataset(root)
    with pytest.raises(FileExistsError, match="already exists"):
        make_detection_dataset(root)
    (tmp_path / "cls" / "train").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="missing class folder"):
        ensure_classification_dataset(tmp_path / "cls")


def test_interrupted_generation_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = shapes.render_detection_image
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(shapes, "render_detection_image", flaky)
    with pytest.raises(KeyboardInterrupt):
        ensure_detection_dataset(tmp_path / "det", num_train=5, num_val=1, min_size=48, max_size=64)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("kind", ["detection", "classification"])
def test_cli(tmp_path: Path, kind: str) -> None:
    out = tmp_path / kind
    script = REPO_ROOT / "scripts" / "make_shapes_dataset.py"
    args = [
        "--out",
        str(out),
        "--kind",
        kind,
        "--train",
        "3",
        "--val",
        "2",
        "--seed",
        "1",
        "--min-size",
        "48",
        "--max-size",
        "64",
    ]
    res = run_script(script, *args, timeout=120)
    assert res.returncode == 0, res.stderr
    assert str(out) in res.stdout
    if kind == "detection":
        assert "3 train + 2 val images" in res.stdout
        assert len(_load(out, "train")["images"]) == 3 and len(_load(out, "val")["images"]) == 2
    else:
        assert "12 train + 8 val images" in res.stdout
        assert len(list((out / "val").glob("*/*.jpg"))) == 8
    again = run_script(script, *args, timeout=120)
    assert again.returncode != 0 and "already exists" in again.stderr


def test_concurrent_generation_keeps_first_complete_dataset(tmp_path: Path) -> None:
    """Two processes (e.g. DDP ranks) generating the same root: the loser discards its copy."""
    root = tmp_path / "det"
    small = {"num_train": 2, "num_val": 1, "min_size": 48, "max_size": 64}

    def fill(tmp: Path) -> None:
        make_detection_dataset(root, **small)  # the "other process" finishes first
        (tmp / "marker").write_text("loser")

    assert shapes._atomic_generate(root, fill, shapes._detection_problem) == root
    assert not (root / "marker").exists() and shapes._detection_problem(root) is None
    assert [p.name for p in tmp_path.iterdir()] == ["det"]


def test_datamodule_generates_with_its_scale_range(tmp_path: Path) -> None:
    from ssd_lightning.data.shapes_datamodule import ShapesDataModule

    ShapesDataModule(
        tmp_path / "dm", num_train=2, num_val=1, min_scale=0.3, max_scale=0.5, max_objects_train=9
    ).prepare_data()
    meta = json.loads((tmp_path / "dm" / shapes.METADATA_FILE).read_text())
    assert (meta["min_scale"], meta["max_scale"], meta["max_objects_train"]) == (0.3, 0.5, 9)


# --------------------------------------------------------------------------- denser training images
def test_max_objects_train_changes_the_train_split_only(det_root: Path, tmp_path: Path) -> None:
    """max_objects_train=9: the val split is byte-identical to the default dataset's; training images keep
    their size and background, hold up to 9 shapes (more than 6 in some), and the setting is recorded."""
    dense = make_detection_dataset(tmp_path / "dense", **SMALL, max_objects_train=9)
    assert _load(dense, "val") == _load(det_root, "val")
    for im in _load(det_root, "val")["images"]:
        name = im["file_name"]
        assert (dense / "val2017" / name).read_bytes() == (det_root / "val2017" / name).read_bytes()
    train_default, train_dense = _load(det_root, "train"), _load(dense, "train")
    assert [(i["width"], i["height"]) for i in train_dense["images"]] == [
        (i["width"], i["height"]) for i in train_default["images"]
    ]
    counts = [len(render_detection_image(5, "train", i, max_objects=9)[1]) for i in range(40)]
    default_counts = [len(render_detection_image(5, "train", i)[1]) for i in range(40)]
    assert max(counts) > 6 >= max(default_counts) and max(counts) <= 9
    assert sum(counts) > 1.2 * sum(default_counts)  # uniform 1..9 (mean 5) vs 1..6 (mean 3.5)
    assert [c == 0 for c in counts] == [c == 0 for c in default_counts]  # the same empty images
    meta = json.loads((dense / shapes.METADATA_FILE).read_text())
    assert meta["max_objects_train"] == 9
    assert "max_objects_train" not in json.loads((det_root / shapes.METADATA_FILE).read_text())


@pytest.mark.parametrize("bad", [0, 10])
def test_max_objects_train_validated(bad: int, tmp_path: Path) -> None:
    from ssd_lightning.data.shapes_datamodule import ShapesDataModule

    with pytest.raises(ValueError, match=r"max_objects must be in \[1, 9\]"):
        make_detection_dataset(tmp_path / "d", num_train=1, num_val=1, max_objects_train=bad)
    with pytest.raises(ValueError, match=r"max_objects must be in \[1, 9\]"):
        ShapesDataModule(tmp_path / "dm", max_objects_train=bad)
    assert not (tmp_path / "d").exists() and not (tmp_path / "dm").exists()


def test_datamodule_warns_when_reusing_a_dataset_of_other_density(
    det_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ssd_lightning.data.shapes"):
        ensure_detection_dataset(det_root, **SMALL, max_objects_train=6)
        assert not caplog.records
        ensure_detection_dataset(det_root, **SMALL, max_objects_train=9)
    assert len(caplog.records) == 1 and "max_objects_train" in caplog.records[0].getMessage()
