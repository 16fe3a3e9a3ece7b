"""CategoryMap: file order, round trips, errors, and agreement with DALI's own label remapping."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ssd_lightning.data.categories import CategoryMap
from tests.helpers import requires_dali

# Deliberately unsorted ids, an unused category, and annotations in yet another order.
CATEGORIES = [
    {"id": 7, "name": "seven"},
    {"id": 3, "name": "three"},
    {"id": 20, "name": "unused"},
    {"id": 11, "name": "eleven"},
]


def test_from_coco_uses_file_order():
    cmap = CategoryMap.from_coco({"categories": CATEGORIES})
    assert cmap.category_ids == (7, 3, 20, 11)
    assert cmap.names == ("background", "seven", "three", "unused", "eleven")
    assert cmap.num_classes == 5


def test_round_trips_int_tensor_numpy():
    cmap = CategoryMap.from_coco({"categories": CATEGORIES})
    assert cmap.label_to_category_id(4) == 11
    assert cmap.category_id_to_label(3) == 2
    labels = torch.tensor([[1, 2], [3, 4]])
    ids = cmap.label_to_category_id(labels)
    assert ids.tolist() == [[7, 3], [20, 11]] and ids.dtype == torch.int64
    assert torch.equal(cmap.category_id_to_label(ids), labels)
    arr = np.array([11, 7])
    assert cmap.category_id_to_label(arr).tolist() == [4, 1]


@pytest.mark.parametrize("bad", [0, 5, -1])
def test_bad_labels_raise(bad):
    cmap = CategoryMap.from_coco({"categories": CATEGORIES})
    with pytest.raises(ValueError, match="unknown label"):
        cmap.label_to_category_id(torch.tensor([1, bad]))


def test_unknown_category_id_raises():
    cmap = CategoryMap.from_coco({"categories": CATEGORIES})
    with pytest.raises(ValueError, match=r"unknown category id\(s\) \[4\]"):
        cmap.category_id_to_label(4)
    with pytest.raises(ValueError, match="unknown category id"):
        cmap.category_id_to_label(torch.tensor([100]))


def test_duplicate_or_missing_categories_raise():
    with pytest.raises(ValueError, match="duplicate category ids"):
        CategoryMap.from_coco({"categories": [{"id": 1}, {"id": 1}]})
    with pytest.raises(ValueError, match="non-empty list"):
        CategoryMap.from_coco({"categories": []})


def test_from_names():
    cmap = CategoryMap.from_names(["a", "b"])
    assert cmap.num_classes == 3 and cmap.label_to_category_id(2) == 2 and cmap.names[0] == "background"


@pytest.mark.dali
@requires_dali
def test_dali_reader_labels_agree_with_category_map(tmp_path):
    """DALI remaps category ids in the categories list's order (not sorted, not by first use)."""
    from nvidia.dali import fn, pipeline_def
    from PIL import Image

    (tmp_path / "img").mkdir()
    ann_order = [11, 3, 7, 3, 11]
    images, anns = [], []
    for i, cid in enumerate(ann_order, start=1):
        Image.new("RGB", (32, 24), (i * 40, 0, 0)).save(tmp_path / "img" / f"{i}.jpg")
        images.append({"id": i, "file_name": f"{i}.jpg", "width": 32, "height": 24})
        anns.append(
            {"id": i, "image_id": i, "category_id": cid, "bbox": [2, 2, 10, 8], "area": 80, "iscrowd": 0}
        )
    ann_file = tmp_path / "ann.json"
    ann_file.write_text(json.dumps({"images": images, "annotations": anns, "categories": CATEGORIES}))

    @pipeline_def(batch_size=len(ann_order), num_threads=1, device_id=None)
    def pipe():
        _, _, labels, ids = fn.readers.coco(
            file_root=str(tmp_path / "img"), annotations_file=str(ann_file), image_ids=True
        )
        return labels, ids

    p = pipe()
    p.build()
    labels, ids = p.run()
    got = {int(np.array(ids[i])[0]): int(np.array(labels[i])[0]) for i in range(len(ann_order))}
    cmap = CategoryMap.from_coco(ann_file)
    expected = {i: cmap.category_id_to_label(cid) for i, cid in enumerate(ann_order, start=1)}
    assert got == expected
    assert expected == {1: 4, 2: 2, 3: 1, 4: 2, 5: 4}  # hand-computed from the file order
