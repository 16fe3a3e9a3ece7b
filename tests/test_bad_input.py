"""Every kind of bad COCO input fails early with an error that names the file and the problem."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import requires_dali


def write_coco(root: Path, n: int = 6, kinds: dict[int, str] | None = None, boxes=None) -> Path:
    """Tiny COCO layout: root/{train2017,val2017}, root/annotations/instances_*.json (same content)."""
    kinds = kinds or {}
    rng = np.random.default_rng(0)
    for split in ("train2017", "val2017"):
        (root / split).mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    images, anns = [], []
    for i in range(1, n + 1):
        arr = rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
        kind = kinds.get(i, "rgb")
        name = f"{i}.png" if kind == "png" else f"{i}.jpg"
        for split in ("train2017", "val2017"):
            path = root / split / name
            if kind == "gray":
                Image.fromarray(arr[..., 0]).save(path)
            elif kind == "cmyk":
                Image.fromarray(arr).convert("CMYK").save(path)
            else:
                Image.fromarray(arr).save(path)
        images.append({"id": i, "file_name": name, "width": 64, "height": 48})
        anns.append(
            {"id": i, "image_id": i, "category_id": 5, "bbox": [4, 4, 30, 20], "area": 600, "iscrowd": 0}
        )
    for k, bbox in enumerate(boxes or [], start=100):
        anns.append({"id": k, "image_id": 1, "category_id": 5, "bbox": bbox, "area": 1, "iscrowd": 0})
    data = {"images": images, "annotations": anns, "categories": [{"id": 5, "name": "thing"}]}
    for split in ("train", "val"):
        (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(data))
    return root


def _setup(root, **kwargs):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    dm = CocoDALIDataModule(root, batch_size=2, device="cpu", **kwargs)
    dm.setup("fit")
    return dm


def _edit(root: Path, fn) -> None:
    for split in ("train", "val"):
        path = root / "annotations" / f"instances_{split}2017.json"
        data = json.loads(path.read_text())
        fn(data)
        path.write_text(json.dumps(data))


def test_missing_root_and_annotation(tmp_path):
    with pytest.raises(FileNotFoundError, match="train2017 does not exist"):
        _setup(tmp_path / "nothing")
    root = write_coco(tmp_path / "d")
    (root / "annotations" / "instances_val2017.json").unlink()
    with pytest.raises(FileNotFoundError, match="instances_val2017.json does not exist"):
        _setup(root)


def test_bad_json_and_missing_keys(tmp_path):
    root = write_coco(tmp_path)
    ann = root / "annotations" / "instances_train2017.json"
    ann.write_text('{"images": [')
    with pytest.raises(ValueError, match=r"instances_train2017.json is not valid JSON"):
        _setup(root)
    ann.write_text(json.dumps({"images": [], "annotations": []}))
    with pytest.raises(ValueError, match=r"lacks the COCO list\(s\) \['categories'\]"):
        _setup(root)


def test_no_images(tmp_path):
    root = write_coco(tmp_path)
    _edit(root, lambda d: (d["images"].clear(), d["annotations"].clear()))
    with pytest.raises(ValueError, match="lists no images"):
        _setup(root)


def test_listed_image_missing(tmp_path):
    root = write_coco(tmp_path)
    (root / "train2017" / "3.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"do not exist: .*train2017/3.jpg"):
        _setup(root)


def test_unknown_image_and_category(tmp_path):
    root = write_coco(tmp_path)
    _edit(root, lambda d: d["annotations"][0].update(image_id=999))
    with pytest.raises(ValueError, match="annotation 1 references image id 999"):
        _setup(root)
    root = write_coco(tmp_path / "b")
    _edit(root, lambda d: d["annotations"][1].update(category_id=42))
    with pytest.raises(ValueError, match="annotation 2 has category id 42"):
        _setup(root)


def test_far_outside_box_raises(tmp_path):
    root = write_coco(tmp_path, boxes=[[40, 30, 64, 48]])  # x, y, x2, y2 by mistake
    with pytest.raises(ValueError, match=r"annotation 100 box .* outside image .*1.jpg"):
        _setup(root)


def test_not_an_image(tmp_path):
    root = write_coco(tmp_path)
    (root / "train2017" / "2.jpg").write_text("<html>404</html>")
    with pytest.raises(ValueError, match=r"not images DALI can decode.*train2017/2.jpg"):
        _setup(root)


@pytest.mark.dali
@requires_dali
def test_degenerate_and_slightly_outside_boxes(tmp_path):
    root = write_coco(tmp_path, boxes=[[10, 10, 0, 5], [10, 10, 5, -3], [50, 30, 15, 18.5]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = _setup(root)
    msgs = [str(w.message) for w in caught if "instances_train2017" in str(w.message)]
    assert any("2 box(es) narrower or lower than 0.1 px" in m for m in msgs)
    assert any("1 box(es) extending slightly outside" in m for m in msgs)
    info = dm._split("train")
    assert info.reader_annotation_file != info.annotation_file
    clipped = json.loads(info.reader_annotation_file.read_text())["annotations"][-1]["bbox"]
    assert clipped == [50.0, 30.0, 14.0, 18.0]
    loader = dm.make_loader("train", with_image_ids=True)
    for _ in range(3):  # random_bbox_crop would abort on out-of-image boxes
        for batch in loader:
            assert batch["boxes"].shape == (2, 8732, 4)


@pytest.mark.dali
@requires_dali
def test_grayscale_cmyk_png_decode_to_rgb(tmp_path):
    root = write_coco(tmp_path, kinds={1: "gray", 2: "cmyk", 3: "png"})
    dm = _setup(root)
    ids = []
    for batch in dm.val_dataloader():
        assert batch["images"].shape[1:] == (3, 300, 300)
        assert torch.equal(batch["image_sizes"], torch.tensor([[48, 64]] * len(batch["image_ids"])))
        ids += batch["image_ids"].tolist()
    assert sorted(ids) == [1, 2, 3, 4, 5, 6]
    assert sum(1 for _ in dm.train_dataloader()) == 3


@pytest.mark.dali
@requires_dali
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_jpeg_named(tmp_path, damage):
    """Cut short, or noise after a valid start: the start-up check names the file, on every DALI line (1.34's
    decoder would turn a truncated JPEG grey; tests/test_data_quirks.py has the damage only DALI sees)."""
    root = write_coco(tmp_path)
    path = root / "val2017" / "4.jpg"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # a valid JPEG start, then noise
        noise = np.random.default_rng(1).integers(0, 255, len(data) - 20, dtype=np.uint8).tobytes()
        path.write_bytes(data[:20] + noise)
    with pytest.raises(ValueError, match=r"corrupt or truncated: .*val2017/4.jpg"):
        _setup(root)
