"""Own data in Pascal VOC and YOLO layouts (data=voc, data=yolo): exports of the shapes set, written with the
quirks real exports have, convert back to its boxes; difficult VOC objects are neither trained on nor
counted by the evaluation; every bad input is one DataError naming file:line; the real CLI reads both."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from ssd_lightning.data.voc import VOCDALIDataModule
from ssd_lightning.data.yolo import TOLERANCE, YOLODALIDataModule
from ssd_lightning.errors import DataError, MissingDataError
from tests.helpers import OWN_DATA_FIT, requires_dali, run_train_py

SPLITS = {"train": "train2017", "val": "val2017"}
DIFFICULT_EVERY = 4  # every 4th annotation of the source is exported as a difficult VOC object


def _source(shapes: Path, split: str) -> tuple[dict, dict[int, str], dict[int, list[dict]]]:
    data = json.loads((shapes / "annotations" / f"instances_{SPLITS[split]}.json").read_text())
    names = {c["id"]: c["name"] for c in data["categories"]}
    by_image = defaultdict(list)
    for ann in data["annotations"]:
        by_image[ann["image_id"]].append(ann)
    return data, names, by_image


def _age(root: Path) -> None:
    """Files as a real export's: older than the conversion cache's 2 s "just modified" window."""
    old = time.time() - 60
    for path in root.rglob("*"):
        os.utime(path, (old, old))


def _voc_object(name: str, bbox: list[float], difficult: bool | None) -> str:
    x, y, w, h = bbox
    flag = "" if difficult is None else f"\t\t<difficult>{int(difficult)}</difficult>\n"
    return (
        f"\t<object>\n\t\t<name>{name}</name>\n\t\t<pose>Unspecified</pose>\n\t\t<truncated>0</truncated>\n{flag}"
        f"\t\t<bndbox>\n\t\t\t<xmin>{x + 1:.1f}</xmin>\n\t\t\t<ymin>{y + 1:.1f}</ymin>\n"
        f"\t\t\t<xmax>{x + w:.1f}</xmax>\n\t\t\t<ymax>{y + h:.1f}</ymax>\n\t\t</bndbox>\n\t</object>\n"
    )


def export_voc(shapes: Path, out: Path) -> dict[str, dict[str, list[tuple[str, list[float], bool]]]]:
    """The shapes set as a labelImg/CVAT-style VOC folder: ``{split: {file: [(name, bbox, difficult)]}}``.

    Quirks: float corners, ``<pose>``/``<truncated>``/``<segmented>``/``<source>``/``<path>`` tags, difficult
    objects (one without a ``<difficult>`` tag at all), the first image's ``<size>`` 0 x 0 (labelImg's bug).
    """
    (out / "JPEGImages").mkdir(parents=True)
    (out / "Annotations").mkdir()
    (out / "ImageSets" / "Main").mkdir(parents=True)
    expected, count = {}, 0
    for split, folder in SPLITS.items():
        data, names, by_image = _source(shapes, split)
        expected[split], ids = {}, []
        for k, image in enumerate(data["images"]):
            stem = Path(image["file_name"]).stem
            shutil.copy(shapes / folder / image["file_name"], out / "JPEGImages" / image["file_name"])
            width, height = (0, 0) if k == 0 else (image["width"], image["height"])
            objects, rows = [], []
            for ann in by_image[image["id"]]:
                count += 1
                difficult = count % DIFFICULT_EVERY == 0
                tag = None if count == 1 else difficult  # the first object says nothing: not difficult
                objects.append(_voc_object(names[ann["category_id"]], ann["bbox"], tag))
                rows.append((names[ann["category_id"]], ann["bbox"], difficult))
            expected[split][image["file_name"]] = rows
            xml = (
                '<?xml version="1.0" encoding="utf-8"?>\n<annotation>\n\t<folder>JPEGImages</folder>\n'
                f"\t<filename>{image['file_name']}</filename>\n\t<path>/home/me/{image['file_name']}</path>\n"
                "\t<source>\n\t\t<database>Unknown</database>\n\t</source>\n"
                f"\t<size>\n\t\t<width>{width}</width>\n\t\t<height>{height}</height>\n\t\t<depth>3</depth>\n"
                "\t</size>\n\t<segmented>0</segmented>\n" + "".join(objects) + "</annotation>\n"
            )
            (out / "Annotations" / f"{stem}.xml").write_text(xml)
            ids.append(stem)
        (out / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    _age(out)
    return expected


def export_yolo(shapes: Path, out: Path) -> dict[str, dict[str, list[tuple[str, list[float]]]]]:
    """The shapes set as an ultralytics folder; returns ``{split: {file (relative): [(name, bbox)]}}``.

    Quirks: ``names`` as a dict, an image without a label file and one with an empty file (both images
    without objects), trailing whitespace and blank lines, CRLF line ends on every other file, a ``.JPG``.
    """
    expected = {}
    classes: list[str] = []
    for split, folder in SPLITS.items():
        data, names, by_image = _source(shapes, split)
        classes = classes or list(names.values())
        (out / "images" / split).mkdir(parents=True)
        (out / "labels" / split).mkdir(parents=True)
        expected[split] = {}
        for k, image in enumerate(data["images"]):
            stem = Path(image["file_name"]).stem
            name = f"{stem}.JPG" if k == 1 else image["file_name"]
            shutil.copy(shapes / folder / image["file_name"], out / "images" / split / name)
            anns = by_image[image["id"]]
            expected[split][name] = [(names[a["category_id"]], a["bbox"]) for a in anns]
            if not anns and k % 2 == 1:
                continue  # no label file at all
            w, h = image["width"], image["height"]
            rows = [
                f"{classes.index(names[a['category_id']])} {(a['bbox'][0] + a['bbox'][2] / 2) / w:.6f} "
                f"{(a['bbox'][1] + a['bbox'][3] / 2) / h:.6f} {a['bbox'][2] / w:.6f} {a['bbox'][3] / h:.6f}  "
                for a in anns
            ]
            end = "\r\n" if k % 2 else "\n"
            text = end.join(rows) + (end + end + "   " + end if rows else "")
            (out / "labels" / split / f"{stem}.txt").write_bytes(text.encode())
    listed = "".join(f"  {i}: {name}\n" for i, name in enumerate(classes))
    (out / "data.yaml").write_text(
        f"path: .\ntrain: images/train\nval: images/val\nnc: {len(classes)}\nnames:\n{listed}"
    )
    _age(out)
    return expected


@pytest.fixture(scope="module")
def voc(shapes_coco, tmp_path_factory):
    root = tmp_path_factory.mktemp("voc") / "VOC2007"
    return root, export_voc(shapes_coco, root)


@pytest.fixture(scope="module")
def yolo(shapes_coco, tmp_path_factory):
    root = tmp_path_factory.mktemp("yolo") / "parts"
    return root, export_yolo(shapes_coco, root)


def _converted(annotation_file: Path) -> dict[str, list[tuple[str, list[float], int]]]:
    data = json.loads(Path(annotation_file).read_text())
    names = {c["id"]: c["name"] for c in data["categories"]}
    files = {image["id"]: image["file_name"] for image in data["images"]}
    out = {name: [] for name in files.values()}
    for ann in data["annotations"]:
        out[files[ann["image_id"]]].append((names[ann["category_id"]], ann["bbox"], ann["iscrowd"]))
    return out


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


# ------------------------------------------------------------------------------------------------ VOC
def test_voc_converts_to_the_source_boxes_once(voc, tmp_path):
    root, expected = voc
    before = _listing(root)
    dm = VOCDALIDataModule(root, cache_dir=tmp_path)
    assert dm.category_map.names[1:] == ("ellipse", "rectangle", "star", "triangle")  # sorted names found
    for split, annotation_file in (("train", dm.train_annotations), ("val", dm.val_annotations)):
        assert annotation_file.is_relative_to(tmp_path / "converted")  # the cache, never the dataset
        got = _converted(annotation_file)
        want = {f: [(n, b, int(d)) for n, b, d in rows] for f, rows in expected[split].items()}
        assert got == want  # exact: integer corners in, [xmin - 1, ymin - 1, w, h] out
        counts = Counter(n for rows in got.values() for n, _, _ in rows)
        assert counts == Counter(n for rows in expected[split].values() for n, _, _ in rows)
    data = json.loads(dm.train_annotations.read_text())
    first = data["images"][0]  # <size> 0 x 0 in its xml: read from the image header
    assert (first["width"], first["height"]) != (0, 0)
    assert _listing(root) == before  # nothing written into the dataset

    stamp = dm.train_annotations.stat().st_mtime_ns
    again = VOCDALIDataModule(root, cache_dir=tmp_path)  # converted once: the same files, not rewritten
    assert again.train_annotations == dm.train_annotations
    assert again.train_annotations.stat().st_mtime_ns == stamp
    fixed = VOCDALIDataModule(root, cache_dir=tmp_path, classes=["star", "triangle", "rectangle", "ellipse"])
    assert list(fixed.category_map.names[1:]) == ["star", "triangle", "rectangle", "ellipse"]
    assert fixed.train_annotations != dm.train_annotations  # another key: other options


def _rename_first_object(copy: Path, _: dict) -> None:
    xml = sorted((copy / "Annotations").glob("*.xml"))[1]
    xml.write_text(xml.read_text().replace("<name>", "<name>big_", 1))


def _widen_first_image(copy: Path, image: dict) -> None:
    from PIL import Image  # <size> 0 x 0 in the first xml: the conversion read this image's size

    Image.new("RGB", (image["width"] + 7, image["height"])).save(copy / "JPEGImages" / image["file_name"])


@pytest.mark.parametrize(
    ("change", "seen"),
    [
        (_rename_first_object, lambda data, _: "big_" in json.dumps(data["categories"])),
        (_widen_first_image, lambda data, image: data["images"][0]["width"] == image["width"] + 7),
    ],
    ids=["annotation-file", "image-whose-size-was-read"],
)
def test_a_changed_source_file_converts_again(voc, tmp_path, change, seen):
    copy = tmp_path / "voc"
    shutil.copytree(voc[0], copy)
    _age(copy)
    first = VOCDALIDataModule(copy, cache_dir=tmp_path / "cache").train_annotations
    image = json.loads(first.read_text())["images"][0]
    change(copy, image)
    _age(copy)
    second = VOCDALIDataModule(copy, cache_dir=tmp_path / "cache").train_annotations
    assert second != first and seen(json.loads(second.read_text()), image)


def test_difficult_objects_are_ignored_by_the_evaluation(voc, tmp_path):
    from ssd_lightning.evaluation import evaluate_coco

    root, expected = voc
    dm = VOCDALIDataModule(root, cache_dir=tmp_path, check_files=False)
    data = json.loads(Path(dm.val_annotation_file).read_text())
    assert any(a["iscrowd"] for a in data["annotations"])  # the export has difficult ones in val

    def detections(with_difficult: bool) -> list[dict]:
        return [
            {"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.9}
            for a in data["annotations"]
            if with_difficult or not a["iscrowd"]
        ]

    # a difficult object nobody found is no miss, and a detection on one is no false positive
    for with_difficult in (False, True):
        stats = evaluate_coco(dm.val_annotation_file, detections(with_difficult), verbose=False)
        assert stats["mAP"] == pytest.approx(1.0), with_difficult


@requires_dali
@pytest.mark.dali
def test_difficult_objects_are_no_training_targets(voc, tmp_path):
    """The real training pipeline (no augmentation): an image's labels hold its ordinary objects' classes and
    none that only a difficult object of it has."""
    import torch

    root, expected = voc
    dm = VOCDALIDataModule(root, cache_dir=tmp_path, batch_size=2, augment=False, shuffle=False, device="cpu")
    data = json.loads(dm.train_annotations.read_text())
    label = {c["name"]: k for k, c in enumerate(data["categories"], 1)}
    files = {image["id"]: image["file_name"] for image in data["images"]}
    checked = 0
    for batch in dm.make_loader("train", with_image_ids=True):
        for image_id, labels in zip(batch["image_ids"].tolist(), batch["labels"], strict=True):
            rows = expected["train"][files[image_id]]
            ordinary = {label[n] for n, _, d in rows if not d}
            only_difficult = {label[n] for n, _, d in rows if d} - ordinary
            assert set(torch.unique(labels).tolist()) - {0} == ordinary, files[image_id]
            checked += len(only_difficult)
    assert checked >= 2  # the export has images whose difficult object is the only one of its class


# ----------------------------------------------------------------------------------------------- YOLO
def test_yolo_converts_to_the_source_boxes(yolo, tmp_path):
    root, expected = yolo
    dm = YOLODALIDataModule(root, cache_dir=tmp_path)
    assert dm.category_map.names[1:] == ("rectangle", "ellipse", "triangle", "star")  # data.yaml's order
    assert dm.category_map.category_ids == (0, 1, 2, 3)  # the YOLO class indices
    for split, annotation_file in (("train", dm.train_annotations), ("val", dm.val_annotations)):
        assert dm.train_images == root / "images" / "train"  # file names relative to the images' folder
        got = _converted(annotation_file)
        assert sorted(got) == sorted(expected[split])
        for name, rows in expected[split].items():
            assert [n for n, _, _ in got[name]] == [n for n, _ in rows], name
            for (_, box, crowd), (_, want) in zip(got[name], rows, strict=True):
                assert box == pytest.approx(want, abs=1e-3) and crowd == 0  # 6 decimals of the export
    assert any(name.endswith(".JPG") for name in _converted(dm.train_annotations))
    data = json.loads(dm.train_annotations.read_text())
    empty = [
        i["id"] for i in data["images"] if not any(a["image_id"] == i["id"] for a in data["annotations"])
    ]
    assert len(empty) == 2  # one without a label file, one with an empty one


# --------------------------------------------------------------------------------------------- errors
def _broken_voc(voc, tmp_path, change) -> Path:
    root = tmp_path / "voc"
    shutil.copytree(voc[0], root)
    change(root)
    return root


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _first_xml(root: Path) -> Path:
    return sorted((root / "Annotations").glob("*.xml"))[0]


def _bad_voc(name: str, change, message: str, error: type[Exception] = DataError, **kwargs):
    """A broken VOC export: `change(root)` breaks it; the datamodule built with `kwargs` raises `error`."""
    return pytest.param(change, kwargs, error, message, id=name)


@pytest.mark.parametrize(
    ("change", "kwargs", "error", "message"),
    [
        _bad_voc(
            "class-not-in-classes",
            lambda r: None,
            r"Annotations/\d+\.xml:\d+: class 'ellipse' is not in data\.classes",
            classes=["star", "triangle", "rectangle"],
        ),
        _bad_voc(
            "listed-without-xml",
            lambda r: _edit(r / "ImageSets" / "Main" / "val.txt", "\n", "\nno_such_image\n"),
            r"ImageSets/Main/val\.txt:2: image 'no_such_image' is listed, but .*no_such_image\.xml does not",
        ),
        _bad_voc(
            "listed-without-image",
            lambda r: (r / "JPEGImages" / "000000000002.jpg").unlink(),
            r"ImageSets/Main/train\.txt:2: image '000000000002' is listed, but .*JPEGImages has no",
        ),
        _bad_voc(
            "not-a-number",
            lambda r: _edit(_first_xml(r), "<xmax>", "<xmax>x"),
            r"000000000001\.xml:\d+: <xmax> of object '\w+' must be a number, got 'x",
        ),
        _bad_voc(
            "bad-xml",
            lambda r: _edit(_first_xml(r), "</bndbox>", "</bnd>"),
            r"000000000001\.xml:\d+: not valid XML \(mismatched tag\)",
        ),
        _bad_voc(
            "listed-twice",
            lambda r: _edit(r / "ImageSets" / "Main" / "train.txt", "\n", "\n000000000001\n"),
            r"ImageSets/Main/train\.txt:2: image '000000000001' is listed again \(first at line 1\)",
        ),
        _bad_voc(
            "no-annotations-folder",
            lambda r: shutil.rmtree(r / "Annotations"),
            r"voc/Annotations is missing: data=voc reads Annotations/ under data\.root",
            error=MissingDataError,
        ),
    ],
)
def test_bad_voc_input_is_one_error_naming_the_file(voc, tmp_path, change, kwargs, error, message):
    root = _broken_voc(voc, tmp_path, change)
    with pytest.raises(error, match=message) as caught:
        VOCDALIDataModule(root, cache_dir=tmp_path / "cache", **kwargs)
    assert "\n" not in str(caught.value)


def _broken_yolo_label(yolo, tmp_path, row: str, line: int = 1) -> tuple[Path, Path]:
    root = tmp_path / "yolo"
    shutil.copytree(yolo[0], root)
    label = sorted((root / "labels" / "train").glob("*.txt"))[0]
    rows = label.read_text().splitlines()
    rows.insert(line - 1, row)
    label.write_text("\n".join(rows) + "\n")
    return root, label


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("4 0.5 0.5 0.1 0.1", r"class index 4 is not in data\.yaml's names \(0\.\.3: rectangle, ellipse"),
        ("0 0.5 0.5 0.1", r"expected 'class cx cy w h' \(5 numbers\) or a polygon"),
        ("0 0.5 0.5 zero 0.1", r"expected 'class cx cy w h'"),
        ("1.5 0.5 0.5 0.1 0.1", r"class index 1\.5 is not in data\.yaml's names"),
        ("0 0.98 0.5 0.1 0.1", r"box 0\.98 0\.5 0\.1 0\.1 reaches outside the image \(x 0\.93\.\.1\.03"),
        ("0 0.5 0.5 -0.1 0.1", r"box 0\.5 0\.5 -0\.1 0\.1 has a negative width or height"),
    ],
)
def test_bad_yolo_row_is_one_error_naming_file_and_line(yolo, tmp_path, row, message):
    root, label = _broken_yolo_label(yolo, tmp_path, row, line=2)
    with pytest.raises(DataError, match=f"{label.name}:2: {message}"):
        YOLODALIDataModule(root, cache_dir=tmp_path / "cache")


def test_yolo_rounding_outside_the_image_is_clipped(yolo, tmp_path):
    root, label = _broken_yolo_label(yolo, tmp_path, f"3 {0.95 + TOLERANCE / 2} 0.5 0.1 0.2")
    dm = YOLODALIDataModule(root, cache_dir=tmp_path / "cache")
    data = json.loads(dm.train_annotations.read_text())
    image = next(i for i in data["images"] if Path(i["file_name"]).stem == label.stem)
    box = next(
        a["bbox"] for a in data["annotations"] if a["image_id"] == image["id"] and a["category_id"] == 3
    )
    assert box[0] + box[2] == pytest.approx(image["width"])  # clipped at the right edge


def test_missing_yolo_dataset_file_is_one_error(tmp_path):
    (tmp_path / "yolo").mkdir()
    with pytest.raises(
        MissingDataError, match=r"no YOLO dataset at .*yolo \(data\.root\): no data\.yaml in it"
    ):
        YOLODALIDataModule(tmp_path / "yolo", cache_dir=tmp_path / "cache")
    (tmp_path / "yolo" / "data.yaml").write_text("names: [a]\ntrain: images/train\nval: images/val\n")
    with pytest.raises(
        MissingDataError, match=r"data\.yaml: train: images/train is .*, which does not exist"
    ):
        YOLODALIDataModule(tmp_path / "yolo", cache_dir=tmp_path / "cache")


def test_yolo_path_of_another_machine_and_a_relative_root(yolo, tmp_path, monkeypatch, caplog):
    """ultralytics' ``path: ../datasets/x`` (its datasets folder) falls back to data.root, said in the log;
    a relative data.root finds the labels (their path replaces the image path's ``/images/``)."""
    root = tmp_path / "parts"
    shutil.copytree(yolo[0], root)
    _edit(root / "data.yaml", "path: .", "path: ../datasets/parts")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="ssd_lightning.data.yolo"):
        dm = YOLODALIDataModule("parts", cache_dir="cache")
    assert "path: ../datasets/parts is" in caplog.text and "relative to data.root" in caplog.text
    assert _converted(dm.val_annotations) == _converted(
        YOLODALIDataModule(yolo[0], cache_dir="c2").val_annotations
    )
    shutil.rmtree(root / "labels" / "val")
    with pytest.raises(
        DataError, match=r"data\.yaml: val: none of its \d+ images has a label file; the first"
    ):
        YOLODALIDataModule("parts", cache_dir="cache")


def test_layout_paths_are_not_accepted(voc, tmp_path):
    from ssd_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.train_images=/x is not used by data=voc"):
        VOCDALIDataModule(voc[0], cache_dir=tmp_path, train_images="/x")


# ------------------------------------------------------------------------------------------ real CLI
@requires_dali
@pytest.mark.dali
@pytest.mark.slow
def test_inspect_data_through_train_py(yolo, tmp_path):
    """`python train.py task=inspect_data data=yolo data.root=...`, as a user types it."""
    proc = run_train_py(
        "task=inspect_data",
        "data=yolo",
        f"data.root={yolo[0]}",
        "data.batch_size=4",
        "inspect.num_batches=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    assert (stats["train"]["images"], stats["val"]["images"]) == (24, 13)
    assert [c["name"] for c in stats["train"]["classes"]] == ["rectangle", "ellipse", "triangle", "star"]


@requires_dali
@pytest.mark.dali
@pytest.mark.slow
def test_fit_and_validate_voc_through_train(voc, make_cfg):
    """train(cfg) on the VOC export: the class count from the files, difficult objects out of training,
    the COCO evaluation per class by name."""
    from ssd_lightning.cli.train import train

    cfg = make_cfg(
        [
            "experiment=demo",
            "data=voc",
            f"data.root={voc[0]}",
            "data.batch_size=4",
            "data.eval_batch_size=5",
            *OWN_DATA_FIT,
            "+trainer.limit_train_batches=2",
            "eval_epochs=[]",
            "logger=csv",
        ]
    )
    metrics = train(cfg)
    assert cfg.model.net.num_classes == 5
    assert 0.0 <= metrics["val/mAP"] <= 1.0
    assert {f"val/AP/{name}" for name in ("ellipse", "rectangle", "star", "triangle")} <= set(metrics)
