"""COCO exports as labelling tools write them train and evaluate, or fail with one line that says the fix.

What such exports do (#17): category ids from 0, ``file_name`` in a subfolder, PNGs next to JPEGs,
EXIF-rotated phone photos, annotations without ``iscrowd``/``area``/``id``, string image ids.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from ssd_lightning.data import coco_validation
from ssd_lightning.data.coco_validation import check_coco_split, check_image_headers
from ssd_lightning.errors import DataError
from ssd_lightning.evaluation import evaluate_coco
from tests.helpers import OWN_DATA_FIT, requires_dali

CATEGORIES = ["red", "green", "blue"]
COLOURS = [(230, 30, 30), (30, 200, 30), (30, 30, 230)]
HEIGHT = 120
EXIF_ROTATE_CW = 6  # viewers turn the stored pixels 90 degrees clockwise


def _boxes(k: int) -> list[tuple[int, list[int]]]:
    """(category index, [x, y, w, h]) of image ``k``, in the upright image."""
    return [((k + j) % 3, [10 + 60 * j, 20 + 5 * j, 40, 50]) for j in range(2)]


def _file_name(k: int) -> str:
    return f"batch1/img{k}.{'png' if k % 2 else 'jpg'}"


def _save(img: Image.Image, path: Path, orientation: int | None) -> None:
    if orientation is None:
        img.save(path)
        return
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.transpose(Image.Transpose.ROTATE_90).save(path, exif=exif.tobytes())  # stored sideways


def write_export(
    root: Path,
    *,
    image_ids: str = "int",
    first_category_id: int = 0,
    minimal: bool = True,
    exif_listing: str | None = None,
    n: int = 6,
) -> tuple[Path, Path]:
    """A labelling-tool style export: ``root/images/batch1/img<k>.{jpg,png}`` and ``root/export.json``.

    Image ``k`` (width ``160 + 8k``) shows the coloured rectangles of :func:`_boxes` on grey, odd ``k`` as
    PNG. ``image_ids``: ``"int"`` (1..n) or ``"str"`` (``"frame-<k>"``); ``minimal``: annotations carry
    only ``id``, ``image_id``, ``category_id`` and ``bbox``; ``exif_listing``: image 0 is stored sideways
    with EXIF orientation 6 and listed with its ``"upright"`` or its ``"stored"`` size (boxes always on
    the upright image, as labelling tools show it).

    Returns:
        (image directory, annotation file).
    """
    folder = root / "images" / "batch1"
    folder.mkdir(parents=True)
    cats = [{"id": first_category_id + i, "name": name} for i, name in enumerate(CATEGORIES)]
    images, anns = [], []
    for k in range(n):
        width = 160 + 8 * k
        img = Image.new("RGB", (width, HEIGHT), (128, 128, 128))
        draw = ImageDraw.Draw(img)
        for cat, (x, y, w, h) in _boxes(k):
            draw.rectangle([x, y, x + w - 1, y + h - 1], fill=COLOURS[cat])
        name = _file_name(k)
        rotated = exif_listing is not None and k == 0
        _save(img, root / "images" / name, EXIF_ROTATE_CW if rotated else None)
        listed = (HEIGHT, width) if rotated and exif_listing == "stored" else (width, HEIGHT)
        iid = k + 1 if image_ids == "int" else f"frame-{k}"
        images.append({"id": iid, "file_name": name, "width": listed[0], "height": listed[1]})
        for cat, bbox in _boxes(k):
            ann = {"id": len(anns) + 1, "image_id": iid, "category_id": cats[cat]["id"], "bbox": bbox}
            if not minimal:
                ann |= {"iscrowd": 0, "area": bbox[2] * bbox[3], "segmentation": []}
            anns.append(ann)
    ann_file = root / "export.json"
    ann_file.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root / "images", ann_file


def _edit(ann_file: Path, fn) -> None:
    data = json.loads(ann_file.read_text())
    fn(data)
    ann_file.write_text(json.dumps(data))


def _check(image_dir: Path, ann_file: Path, cache: Path):
    """check_coco_split and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = check_coco_split(image_dir, ann_file, cache_dir=cache)
    return info, [str(w.message) for w in caught]


def _perfect_detections(ann_file: Path) -> list[dict]:
    data = json.loads(ann_file.read_text())
    return [
        {"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.9}
        for a in data["annotations"]
    ]


# ------------------------------------------------------------------ the check and the normalised copy
def test_minimal_export_filled_in_once_for_reader_and_evaluator(tmp_path):
    image_dir, ann_file = write_export(tmp_path / "export", minimal=True)
    original = ann_file.read_bytes()
    info, messages = _check(image_dir, ann_file, tmp_path / "cache")
    assert len(messages) == 1, messages  # one line per split
    assert "iscrowd=0 for 12 annotation(s)" in messages[0] and "area=w*h of the box for 12" in messages[0]
    assert str(info.evaluation_annotation_file) in messages[0]
    assert info.filled == (("iscrowd", 12), ("area", 12))
    assert info.reader_annotation_file == info.evaluation_annotation_file != ann_file
    assert info.evaluation_annotation_file.parent == tmp_path / "cache"
    assert ann_file.read_bytes() == original  # the dataset is never written to

    copy = json.loads(info.evaluation_annotation_file.read_text())
    assert [(a["iscrowd"], a["area"]) for a in copy["annotations"]] == [(0, 2000.0)] * 12
    # pycocotools (the reference evaluator) reads the copy: perfect detections give AP 1
    stats = evaluate_coco(info.evaluation_annotation_file, _perfect_detections(ann_file), "pycocotools")
    assert stats["mAP"] == pytest.approx(1.0)

    again, messages = _check(image_dir, ann_file, tmp_path / "cache")  # cached result, same files
    assert again == info and len(messages) == 1


def test_complete_export_is_read_as_it_is(tmp_path):
    image_dir, ann_file = write_export(tmp_path / "export", minimal=False)
    info, messages = _check(image_dir, ann_file, tmp_path / "cache")
    assert messages == [] and info.filled == ()
    assert info.reader_annotation_file == info.evaluation_annotation_file == ann_file


def test_string_image_ids_become_consecutive_integers(tmp_path):
    image_dir, ann_file = write_export(tmp_path / "export", image_ids="str", minimal=False)
    info, messages = _check(image_dir, ann_file, tmp_path / "cache")
    assert len(messages) == 1 and "ids 1..6 for the 6 images" in messages[0] and "original_id" in messages[0]
    assert info.filled == (("image id", 6),)
    copy = json.loads(info.reader_annotation_file.read_text())
    assert [(im["id"], im["original_id"]) for im in copy["images"]] == [
        (k + 1, f"frame-{k}") for k in range(6)
    ]
    names = {im["id"]: im["file_name"] for im in copy["images"]}
    # every box stays on its own image, with its category id (0 included) unchanged
    original = json.loads(ann_file.read_text())["annotations"]
    assert [(names[a["image_id"]], a["category_id"], a["bbox"]) for a in copy["annotations"]] == [
        (_file_name(int(a["image_id"].removeprefix("frame-"))), a["category_id"], a["bbox"]) for a in original
    ]
    detections = _perfect_detections(info.evaluation_annotation_file)
    stats = evaluate_coco(info.evaluation_annotation_file, detections, "pycocotools")
    assert stats["mAP"] == pytest.approx(1.0)


def test_missing_or_repeated_annotation_ids_are_renumbered(tmp_path):
    """pycocotools keeps one box per annotation id: repeated ids would silently drop ground truth."""
    image_dir, ann_file = write_export(tmp_path / "export", minimal=False)

    def per_image_ids(data):  # some exporters number the boxes of each image from 0, or not at all
        for k, ann in enumerate(data["annotations"]):
            if k % 3:
                ann["id"] = k % 2
            else:
                del ann["id"]

    _edit(ann_file, per_image_ids)
    info, messages = _check(image_dir, ann_file, tmp_path / "cache")
    assert info.filled == (("annotation id", 12),) and "ids 1..12 for the 12 annotations" in messages[0]
    copy = json.loads(info.evaluation_annotation_file.read_text())
    assert [a["id"] for a in copy["annotations"]] == list(range(1, 13))
    stats = evaluate_coco(info.evaluation_annotation_file, _perfect_detections(ann_file), "pycocotools")
    assert stats["mAP"] == pytest.approx(1.0) and stats["mAR_100"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["images"][2].update(id=2.5),
            r"image entry .*'id': 2.5.* needs an 'id' that is an integer or a string",
        ),
        (lambda d: d["images"][2].update(id="frame-1"), r"duplicate image id 'frame-1'"),
        (
            lambda d: d["annotations"][3].update(image_id="frame-9"),
            r"annotation 4 references image id 'frame-9'",
        ),
        (
            lambda d: d["annotations"][3].update(category_id="1"),
            r"annotation 4 has category id '1', which is not",
        ),
        (
            lambda d: d["annotations"].append(["not", "an", "object"]),
            r"every entry of 'annotations' must be an object",
        ),
        (
            lambda d: d["categories"][1].update(id="green"),
            r"every category needs an integer 'id' \(0 is fine.*'green'",
        ),
    ],
    ids=[
        "float-image-id",
        "duplicate-string-id",
        "unknown-image-id",
        "string-category-id-in-annotation",
        "non-object",
        "string-category-id",
    ],
)
def test_unusable_ids_fail_with_one_line_naming_the_field(tmp_path, edit, message):
    image_dir, ann_file = write_export(tmp_path / "export", image_ids="str")
    _edit(ann_file, edit)
    with pytest.raises(DataError, match=message) as info:
        check_coco_split(image_dir, ann_file, cache_dir=tmp_path / "cache")
    assert str(ann_file) in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------- EXIF orientation
def test_jpeg_headers_with_exif_are_the_only_jpegs_opened(tmp_path):
    plain, tagged, jfif_then_exif = tmp_path / "plain.jpg", tmp_path / "tagged.jpg", tmp_path / "both.jpg"
    img = Image.new("RGB", (40, 30), (1, 2, 3))
    img.save(plain)
    _save(img, tagged, EXIF_ROTATE_CW)
    exif = Image.Exif()
    exif[0x0112] = 3
    img.save(jfif_then_exif, exif=exif.tobytes(), jfif_version=(1, 1), dpi=(72, 72))
    png = tmp_path / "a.png"
    img.save(png)
    assert check_image_headers([plain, tagged, jfif_then_exif, png]) == [tagged, jfif_then_exif]
    assert coco_validation.exif_orientation(tagged) == (6, (30, 40))
    assert coco_validation.exif_orientation(plain) == (1, (40, 30))


@pytest.mark.parametrize("applies", [True, False])
def test_exif_rotated_images_listed_upright(tmp_path, monkeypatch, applies):
    """Recorded by the (cached) check; whether they can be read is decided per DALI line, at every call."""
    image_dir, ann_file = write_export(tmp_path / "export", exif_listing="upright", minimal=False)
    monkeypatch.setattr(coco_validation, "decoder_applies_exif_orientation", lambda: True)
    info, _ = _check(image_dir, ann_file, tmp_path / "cache")  # checked and cached under a 2.x-like line
    assert info.exif_listed_upright == ("batch1/img0.jpg",) and info.exif_listed_unrotated == ()
    monkeypatch.setattr(coco_validation, "decoder_applies_exif_orientation", lambda: applies)
    if applies:
        assert _check(image_dir, ann_file, tmp_path / "cache")[0] == info
        return
    with pytest.raises(
        DataError, match=r"1 image\(s\) carry an EXIF orientation tag, which the decoders of DALI"
    ) as err:
        check_coco_split(image_dir, ann_file, cache_dir=tmp_path / "cache")
    assert "batch1/img0.jpg" in str(err.value) and "exiftran -ai" in str(err.value)
    assert "data.exif_check=warn trains anyway" in str(err.value)


def test_exif_check_can_warn_or_be_off(tmp_path, monkeypatch, caplog):
    """data.exif_check=warn: the same message as a warning and the split is usable; off: silent."""
    image_dir, ann_file = write_export(tmp_path / "export", exif_listing="upright", minimal=False)
    monkeypatch.setattr(coco_validation, "decoder_applies_exif_orientation", lambda: False)
    with caplog.at_level("WARNING"):
        info = check_coco_split(image_dir, ann_file, cache_dir=tmp_path / "cache", exif_check="warn")
    assert info.exif_listed_upright == ("batch1/img0.jpg",)
    assert sum("EXIF orientation tag" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level("WARNING"):
        check_coco_split(image_dir, ann_file, cache_dir=tmp_path / "cache", exif_check="off")
    assert not any("EXIF" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="exif_check must be one of"):
        check_coco_split(image_dir, ann_file, cache_dir=tmp_path / "cache", exif_check="ignore")


def test_exif_rotated_image_listed_with_its_stored_size_is_named(tmp_path, monkeypatch):
    image_dir, ann_file = write_export(tmp_path / "export", exif_listing="stored", minimal=False)
    monkeypatch.setattr(coco_validation, "decoder_applies_exif_orientation", lambda: True)
    with pytest.raises(
        DataError,
        match=r"listed with their stored width and height.*batch1/img0.jpg.*swap 'width' and 'height'",
    ):
        check_coco_split(image_dir, ann_file, cache_dir=tmp_path / "cache")


def test_exif_rotated_image_listed_with_another_size_is_named(tmp_path):
    image_dir, ann_file = write_export(tmp_path / "export", exif_listing="upright", minimal=False)
    _edit(ann_file, lambda d: d["images"][0].update(width=150))
    with pytest.raises(
        DataError,
        match=r"neither their upright nor their stored size: batch1/img0.jpg \(listed 150x120, upright 16",
    ):
        check_coco_split(image_dir, ann_file, cache_dir=tmp_path / "cache")


# ------------------------------------------------------------------- through DALI and the datamodule
def _datamodule(image_dir: Path, ann_file: Path, cache: Path, **kwargs):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    dm = CocoDALIDataModule(
        image_dir.parent,
        train_images=image_dir,
        val_images=image_dir,
        train_annotations=ann_file,
        val_annotations=ann_file,
        batch_size=2,
        eval_batch_size=4,
        device="cpu",
        num_threads=1,
        cache_dir=cache,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup("fit")
    return dm


def _upright_rgb(batch_images: torch.Tensor) -> np.ndarray:
    """(N, 3, S, S) ImageNet-normalised -> (N, S, S, 3) 0..255."""
    from ssd_lightning.data.dali_pipelines import IMAGENET_MEAN, IMAGENET_STD

    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (batch_images.float() * std + mean).permute(0, 2, 3, 1).numpy()


def _assert_boxes_on_their_colours(
    batch, listed_sizes: dict[int, tuple[int, int]], file_index: dict[int, int]
):
    """The centre of every box, scaled into the 300x300 network input, shows the box's colour."""
    pictures = _upright_rgb(batch["images"])
    for picture, iid, hw in zip(
        pictures, batch["image_ids"].tolist(), batch["image_sizes"].tolist(), strict=True
    ):
        width, height = listed_sizes[iid]
        assert tuple(hw) == (height, width)
        for cat, (x, y, w, h) in _boxes(file_index[iid]):
            cx, cy = int((x + w / 2) * 300 / width), int((y + h / 2) * 300 / height)
            patch = picture[cy - 3 : cy + 4, cx - 3 : cx + 4].reshape(-1, 3).mean(0)
            assert np.abs(patch - COLOURS[cat]).max() < 30, (iid, cat, patch)


@pytest.mark.dali
@requires_dali
def test_datamodule_reads_a_minimal_export_with_string_ids_and_category_zero(tmp_path):
    image_dir, ann_file = write_export(tmp_path / "export", image_ids="str", minimal=True)
    dm = _datamodule(image_dir, ann_file, tmp_path / "cache", augment=False, shuffle=False)
    assert dm.category_map.category_ids == (0, 1, 2) and dm.num_classes == 4
    truth = json.loads(dm.val_annotation_file.read_text())  # the normalised copy the evaluation reads
    assert dm.val_annotation_file != ann_file and "iscrowd" in truth["annotations"][0]
    sizes = {im["id"]: (im["width"], im["height"]) for im in truth["images"]}
    file_index = {im["id"]: int(Path(im["file_name"]).stem[3:]) for im in truth["images"]}

    seen = []
    for batch in dm.val_dataloader():  # JPEGs and PNGs from a subfolder, ids of the evaluated file
        _assert_boxes_on_their_colours(batch, sizes, file_index)
        seen += batch["image_ids"].tolist()
    assert sorted(seen) == [1, 2, 3, 4, 5, 6]

    # category id 0 is label 1, never background: each image's matched default boxes carry its labels
    for batch in dm.make_loader("train", with_image_ids=True):
        for labels, iid in zip(batch["labels"], batch["image_ids"].tolist(), strict=True):
            cats = [truth["categories"][cat]["id"] for cat, _ in _boxes(file_index[iid])]
            expected = set(dm.category_map.category_id_to_label(torch.tensor(cats)).tolist())
            assert set(labels.unique().tolist()) - {0} == expected
    assert dm.category_map.label_to_category_id(1) == 0


@pytest.mark.dali
@requires_dali
def test_exif_rotated_jpeg_decodes_upright_or_is_named(tmp_path):
    """On a DALI line whose decoder applies the EXIF orientation the boxes land on their colours; on one
    that does not (1.34), setup names the file instead of training on misplaced boxes."""
    image_dir, ann_file = write_export(tmp_path / "export", exif_listing="upright", minimal=False)
    if not coco_validation.decoder_applies_exif_orientation():
        with pytest.raises(DataError, match=r"EXIF orientation tag.*batch1/img0.jpg"):
            _datamodule(image_dir, ann_file, tmp_path / "cache")
        return
    dm = _datamodule(image_dir, ann_file, tmp_path / "cache", augment=False)
    truth = json.loads(ann_file.read_text())
    sizes = {im["id"]: (im["width"], im["height"]) for im in truth["images"]}
    batch = next(iter(dm.val_dataloader()))
    assert batch["image_ids"][0] == 1  # the rotated one
    _assert_boxes_on_their_colours(batch, sizes, {iid: iid - 1 for iid in sizes})


@pytest.mark.dali
@pytest.mark.slow
@requires_dali
def test_train_fits_and_evaluates_a_labelling_tool_export(make_cfg, tmp_path):
    """train(cfg) end to end: string ids, no iscrowd/area, category id 0, PNGs in a subfolder, and an
    EXIF-rotated JPEG where this DALI line decodes it upright; pycocotools evaluates the normalised copy."""
    from ssd_lightning.cli.train import train

    exif = "upright" if coco_validation.decoder_applies_exif_orientation() else None
    image_dir, ann_file = write_export(tmp_path / "export", image_ids="str", exif_listing=exif, n=8)
    cfg = make_cfg(
        [
            "experiment=demo",
            "data=coco",
            f"data.root={tmp_path / 'export'}",
            f"data.train_images={image_dir}",
            f"data.val_images={image_dir}",
            f"data.train_annotations={ann_file}",
            f"data.val_annotations={ann_file}",
            "data.batch_size=2",
            "data.eval_batch_size=3",
            *OWN_DATA_FIT,
            "logger=csv",
            "callbacks.coco_map.backend=pycocotools",
        ]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics = train(cfg)
    assert 0.0 <= metrics["val/mAP"] <= 1.0 and metrics["train/loss_epoch"] > 0
    assert cfg.model.net.num_classes == 4

    info, _ = _check(image_dir, ann_file, None)  # the (cached) check the run used
    detections = json.loads((tmp_path / "detections_epoch_0.json").read_text())
    assert detections and {d["image_id"] for d in detections} <= set(range(1, 9))
    assert {d["category_id"] for d in detections} <= {0, 1, 2}
    by_hand = evaluate_coco(info.evaluation_annotation_file, detections, "pycocotools", verbose=False)
    assert by_hand["mAP"] == pytest.approx(metrics["val/mAP"], abs=1e-6)
