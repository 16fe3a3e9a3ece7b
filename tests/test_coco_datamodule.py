"""CocoDALIDataModule and the DALI iterator on the generated shapes COCO dataset (CPU DALI)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from tests.helpers import requires_dali

pytestmark = [pytest.mark.dali, requires_dali]


def _dm(root, **kwargs):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("device", "cpu")
    dm = CocoDALIDataModule(root, **kwargs)
    dm.setup("fit")
    return dm


def _ann(root, split):
    return json.loads((root / "annotations" / f"instances_{split}2017.json").read_text())


def _non_empty_ids(root, split="train"):
    return sorted({a["image_id"] for a in _ann(root, split)["annotations"]})


def test_train_batch_shapes_and_dtypes(shapes_coco):
    dm = _dm(shapes_coco)
    n_train = len(_non_empty_ids(shapes_coco))
    loader = dm.train_dataloader()
    assert len(loader) == n_train // 4
    batch = next(iter(loader))
    assert set(batch) == {"images", "boxes", "labels"}
    assert batch["images"].shape == (4, 3, 300, 300) and batch["images"].dtype == torch.float32
    assert batch["boxes"].shape == (4, 8732, 4) and batch["boxes"].dtype == torch.float32
    assert batch["labels"].shape == (4, 8732) and batch["labels"].dtype == torch.int64
    assert batch["labels"].min() >= 0 and batch["labels"].max() < dm.num_classes
    # ImageNet-normalised: roughly zero-centred, well outside [0, 1]
    assert -3.0 < batch["images"].mean() < 3.0 and batch["images"].min() < 0


def test_val_batches_ids_and_sizes(shapes_coco):
    dm = _dm(shapes_coco, eval_batch_size=4)
    ann = _ann(shapes_coco, "val")
    sizes = {im["id"]: (im["height"], im["width"]) for im in ann["images"]}
    loader = dm.val_dataloader()
    assert len(loader) == -(-len(sizes) // 4)
    seen = []
    for batch in loader:
        assert set(batch) == {"images", "image_ids", "image_sizes"}
        assert batch["image_ids"].dtype == torch.int64 and batch["image_sizes"].dtype == torch.int64
        for iid, hw in zip(batch["image_ids"].tolist(), batch["image_sizes"].tolist(), strict=True):
            assert tuple(hw) == sizes[iid]
        seen += batch["image_ids"].tolist()
    assert sorted(seen) == sorted(sizes)  # exactly once, padding removed
    assert dm.val_annotation_file.name == "instances_val2017.json"
    assert dm.category_map.num_classes == dm.num_classes == len(ann["categories"]) + 1


@pytest.mark.parametrize(("name", "dtype"), [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_output_dtype(shapes_coco, name, dtype):
    dm = _dm(shapes_coco, output_dtype=name)
    assert next(iter(dm.train_dataloader()))["images"].dtype == dtype
    assert next(iter(dm.val_dataloader()))["images"].dtype == dtype


def test_encoded_targets_match_boxcoder(shapes_coco):
    """Without augmentation, DALI's box_encoder must agree with BoxCoder.encode (ties aside)."""
    from ssd_lightning.models.boxes import BoxCoder, dboxes300_coco

    dm = _dm(shapes_coco, augment=False, shuffle=False)
    ann = _ann(shapes_coco, "train")
    imgs = {im["id"]: im for im in ann["images"]}
    by_image: dict[int, list] = {}
    for a in ann["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    coder = BoxCoder(dboxes300_coco())
    batch = next(iter(dm.make_loader("train", with_image_ids=True)))
    total = mismatched = 0
    for k, iid in enumerate(batch["image_ids"].tolist()):
        w, h = imgs[iid]["width"], imgs[iid]["height"]
        gt = torch.tensor(
            [
                [
                    a["bbox"][0] / w,
                    a["bbox"][1] / h,
                    (a["bbox"][0] + a["bbox"][2]) / w,
                    (a["bbox"][1] + a["bbox"][3]) / h,
                ]
                for a in by_image[iid]
            ]
        )
        labels = dm.category_map.category_id_to_label(torch.tensor([a["category_id"] for a in by_image[iid]]))
        ref_boxes, ref_labels = coder.encode(gt, labels)
        same = ref_labels == batch["labels"][k]
        total += same.numel()
        mismatched += int((~same).sum())
        assert (ref_labels > 0).sum() > 0
        torch.testing.assert_close(batch["boxes"][k][same], ref_boxes[same].float(), atol=1e-4, rtol=1e-4)
    assert mismatched <= 0.001 * total  # float ties between equal-IoU candidates only


def test_len_stable_and_complete_epochs(shapes_coco):
    dm = _dm(shapes_coco)
    loader = dm.train_dataloader()
    counts = [sum(1 for _ in loader) for _ in range(3)]
    assert counts == [len(loader)] * 3
    val = dm.val_dataloader()
    assert [sum(1 for _ in val) for _ in range(3)] == [len(val)] * 3


def test_abandoned_epochs(shapes_coco):
    """Sanity-check style partial epochs must not shorten or corrupt the next full epoch."""
    dm = _dm(shapes_coco, eval_batch_size=3)
    val = dm.val_dataloader()
    it = iter(val)
    next(it)
    next(it)  # abandoned after 2 batches, like num_sanity_val_steps=2
    ids = [i for b in val for i in b["image_ids"].tolist()]
    assert sorted(ids) == sorted(im["id"] for im in _ann(shapes_coco, "val")["images"])

    # Training continues the stream after an abandoned epoch (limit_train_batches): the next epoch has
    # full length, and the reader epoch it finishes still holds each sample at most once.
    train = dm.make_loader("train", with_image_ids=True)
    first = next(iter(train))
    batches = list(train)
    assert len(batches) == len(train)
    reader_epoch = [first] + batches[: len(train) - 1]
    flat = [i for b in reader_epoch for i in b["image_ids"].tolist()]
    assert len(set(flat)) == len(flat) == len(train) * 4
    assert set(batches[-1]["image_ids"].tolist()) <= set(_non_empty_ids(shapes_coco))


def _train_loader(root, exec_dynamic: bool):
    """The datamodule's training loader; ``exec_dynamic=False``: DALI's older executor, which reuses its
    output buffers, so every output goes through the loader's buffer pool (DALI 1.34 has only that one)."""
    import functools

    from ssd_lightning.data.dali_compat import HAS_EXEC_DYNAMIC, uses_fresh_outputs

    if exec_dynamic and not HAS_EXEC_DYNAMIC:
        pytest.skip("this DALI line has no dynamic executor")
    loader = _dm(root).train_dataloader()
    if not exec_dynamic and HAS_EXEC_DYNAMIC:
        loader._factory = functools.partial(loader._factory, exec_dynamic=False)
        loader._pipe = loader._build()
    assert uses_fresh_outputs(loader._pipe) == exec_dynamic
    return loader


@pytest.mark.parametrize("exec_dynamic", [True, False])
def test_held_batches_not_overwritten(shapes_coco, exec_dynamic):
    """A batch (or a view of one) held across many later batches and epochs keeps its values."""
    loader = _train_loader(shapes_coco, exec_dynamic)
    it = iter(loader)
    first = next(it)
    snapshot = {k: v.clone() for k, v in first.items()}
    view = next(it)["boxes"][1:3]  # only a view of the second batch survives
    view_snapshot = view.clone()
    for _ in range(3 * len(loader)):  # many times the pool size, across epoch boundaries
        batch = next(it, None) or next(it := iter(loader))
    for k in first:
        assert torch.equal(first[k], snapshot[k]), k
    assert torch.equal(view, view_snapshot)
    assert not torch.equal(batch["images"], first["images"])


@pytest.mark.parametrize("exec_dynamic", [True, False])
def test_free_output_buffers_are_reused(shapes_coco, exec_dynamic):
    """Copied outputs (int32 labels -> int64; everything without the dynamic executor) go into pooled
    buffers that are refilled once nobody holds them; with the dynamic executor images are not copied."""
    loader = _train_loader(shapes_coco, exec_dynamic)
    bases: dict[str, list] = {"images": [], "labels": []}  # holding the pool's own tensors is allowed
    for _ in range(3):
        for batch in loader:
            for key, seen in bases.items():
                seen.append(batch[key]._base)
    assert len(bases["labels"]) == 3 * len(loader) > 4
    assert None not in bases["labels"] and len({id(b) for b in bases["labels"]}) <= 4  # default pool_size
    if exec_dynamic:
        assert bases["images"] == [None] * len(bases["images"])  # zero-copy, not a view of a pool buffer
    else:
        assert len({id(b) for b in bases["images"]}) <= 4


def test_two_shards_disjoint_complete_and_reshuffled(shapes_coco):
    dm = _dm(shapes_coco, batch_size=3)
    train_ids = set(_non_empty_ids(shapes_coco))
    loaders = [dm.make_loader("train", shard_id=s, num_shards=2, with_image_ids=True) for s in (0, 1)]
    assert len(loaders[0]) == len(loaders[1]) == (len(train_ids) // 2) // 3
    orders = []
    for _ in range(2):  # two epochs
        per_shard = [[i for b in ld for i in b["image_ids"].tolist()] for ld in loaders]
        assert not set(per_shard[0]) & set(per_shard[1])
        both = per_shard[0] + per_shard[1]
        assert len(both) == len(set(both)) and set(both) <= train_ids
        # drop policy: at most one partial batch per shard is left out
        assert len(train_ids) - len(both) < 2 * 3 + 2
        orders.append(both)
    assert orders[0] != orders[1]  # global reshuffle between epochs

    val_ids = [im["id"] for im in _ann(shapes_coco, "val")["images"]]
    vals = [dm.make_loader("val", shard_id=s, num_shards=2) for s in (0, 1)]
    for _ in range(2):
        got = [[i for b in ld for i in b["image_ids"].tolist()] for ld in vals]
        assert not set(got[0]) & set(got[1])
        assert Counter(got[0] + got[1]) == Counter(val_ids)


def test_same_seed_same_shuffle(shapes_coco):
    a = _dm(shapes_coco, seed=5).make_loader("train", with_image_ids=True)
    b = _dm(shapes_coco, seed=5).make_loader("train", with_image_ids=True)
    ids_a = [b_["image_ids"].tolist() for b_ in a]
    ids_b = [b_["image_ids"].tolist() for b_ in b]
    assert ids_a == ids_b


def test_constructor_defaults_and_errors(tmp_path):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    dm = CocoDALIDataModule(tmp_path, batch_size=8)
    assert dm.train_images == tmp_path / "train2017" and dm.eval_batch_size == 8
    assert dm.val_annotation_file == tmp_path / "annotations" / "instances_val2017.json"
    with pytest.raises(ValueError, match="output_dtype"):
        CocoDALIDataModule(tmp_path, output_dtype="int8")
    with pytest.raises(ValueError, match="device"):
        CocoDALIDataModule(tmp_path, device="tpu")
    with pytest.raises(ValueError, match="batch_size"):
        CocoDALIDataModule(tmp_path, batch_size=0)


def test_val_skip_empty_reproduces_nvidias_protocol(shapes_coco, tmp_path):
    """NVIDIA validates only images with annotations; the official protocol (default) validates all, so a
    detection on an empty image is a false positive only there."""
    import shutil

    import numpy as np

    from ssd_lightning.evaluation import evaluate_coco

    root = tmp_path / "data"
    shutil.copytree(shapes_coco, root)
    ann = _ann(root, "val")
    emptied = {im["id"] for im in ann["images"][:3]}
    ann["annotations"] = [a for a in ann["annotations"] if a["image_id"] not in emptied]
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps(ann))
    all_ids = {im["id"] for im in ann["images"]}
    annotated = {a["image_id"] for a in ann["annotations"]}
    empty = all_ids - annotated  # the emptied ones and any the generator left without shapes
    assert emptied <= empty

    def validated_ids(**kwargs):
        dm = _dm(root, eval_batch_size=4, **kwargs)
        return [i for batch in dm.val_dataloader() for i in batch["image_ids"].tolist()]

    official, nvidia = validated_ids(), validated_ids(val_skip_empty=True)
    assert sorted(official) == sorted(all_ids)
    assert sorted(nvidia) == sorted(annotated)  # each once, padding removed

    # perfect detections on every annotated image, one spurious box on every empty one
    # (ranked above the true ones: a false positive after every true one would not lower AP)
    rows = [[a["image_id"], *a["bbox"], 0.9, a["category_id"]] for a in ann["annotations"]]
    rows += [[i, 5.0, 5.0, 40.0, 40.0, 1.0, ann["categories"][0]["id"]] for i in empty]
    file = root / "annotations" / "instances_val2017.json"
    scores = {
        name: evaluate_coco(file, np.array([r for r in rows if r[0] in ids]), verbose=False, image_ids=ids)[
            "mAP"
        ]
        for name, ids in (("official", official), ("nvidia", nvidia))
    }
    assert scores["nvidia"] == pytest.approx(1.0)
    assert scores["official"] < 1.0
    assert np.isfinite(scores["official"])
