"""predict at scale: recursive folders, globs and list files with their output names; detections keyed by a
COCO annotation file's image ids and scored with the project's COCO evaluation (an oracle detector that
returns the ground truth, so the numbers are known)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.data.shapes import make_detection_dataset
from ssd_lightning.errors import DataError, MissingDataError
from ssd_lightning.evaluation import COCO_STAT_NAMES, evaluate_coco
from ssd_lightning.inference.predict import categories_for_annotations, evaluate_predictions, predict_images
from ssd_lightning.inference.sources import InputImage, collect_inputs, match_annotation_ids, read_list_file


def _image(path: Path, size: tuple[int, int] = (40, 30), value: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 2 * value % 256, 3 * value % 256)).save(path)
    return path


class _Oracle:
    """Duck-typed Detector: returns, per call and image, the next entry of ``answers`` (ltrb, labels)."""

    image_size = 32

    def __init__(self, categories: CategoryMap, answers: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.categories = categories
        self.answers = list(answers)

    def detect(self, images: torch.Tensor, sizes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        assert images.shape[1:] == (3, 32, 32) and len(sizes) == len(images)
        out = []
        for _ in sizes:
            boxes, labels = self.answers.pop(0)
            scores = np.linspace(0.9, 0.5, len(labels), dtype=np.float32)
            out.append(
                {
                    "boxes": torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                    "scores": torch.from_numpy(scores),
                    "labels": torch.as_tensor(labels, dtype=torch.int64),
                }
            )
        return out


def _nothing(categories: CategoryMap, n: int) -> _Oracle:
    return _Oracle(categories, [(np.zeros((0, 4)), np.zeros(0, dtype=np.int64))] * n)


# ------------------------------------------------------------------------------------------ inputs
@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "photos"
    for name in (
        "a/x.png",
        "a/x.jpg",
        "b/x.png",
        "b/deep/y.jpeg",
        "z.jpg",
        ".cache/hidden.jpg",
        "out/old.jpg",
    ):
        _image(root / name)
    (root / "a" / "notes.txt").write_text("not an image")
    return root


def test_folders_are_searched_recursively_and_named_by_relative_path(tree, tmp_path):
    names = [i.name for i in collect_inputs(tree, exclude=[tree / "out"])]
    assert names == ["a/x.jpg", "a/x.png", "b/deep/y.jpeg", "b/x.png", "z.jpg"]  # no hidden, no output
    assert [i.name for i in collect_inputs(tree, recursive=False)] == ["z.jpg"]
    assert "out/old.jpg" in [i.name for i in collect_inputs(tree)]
    globbed = collect_inputs(f"{tree}/**/x.png")
    assert [i.name for i in globbed] == ["a/x.png", "b/x.png"] and globbed[0].path == tree / "a" / "x.png"

    inputs = collect_inputs(tree, exclude=[tree / "out"])
    out = tmp_path / "predictions"
    results, failures = predict_images(_nothing(CategoryMap.from_names(["s"]), 5), inputs, out, workers=2)
    assert failures == [] and results == []
    pictures = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.jpg"))
    # same stem in two folders: both kept; two files of one stem in one folder: the second gets _1
    assert pictures == ["a/x.jpg", "a/x_1.jpg", "b/deep/y.jpg", "b/x.jpg", "z.jpg"]


def test_list_file_resolves_relative_paths_and_skips_comments(tree, tmp_path):
    elsewhere = _image(tmp_path / "elsewhere" / "w.png")
    (tree / "list.txt").write_text(f"# a comment\n\n  a/x.png  \nb/x.png\n{elsewhere}\na/x.png\n")
    expected = ["a/x.png", "b/x.png", "w.png"]  # outside the list's folder: the file name; repeats once
    assert [i.name for i in read_list_file(tree / "list.txt")] == expected
    assert [i.name for i in collect_inputs(f"@{tree / 'list.txt'}")] == expected
    assert [i.name for i in collect_inputs(tree / "list.txt")] == expected  # an existing .txt is a list
    assert collect_inputs(tree / "list.txt")[2].path == elsewhere

    (tree / "broken.txt").write_text("a/x.png\n# fine\nb/missing.png\nz.jpg\nalso/missing.jpg\n")
    with pytest.raises(
        MissingDataError, match=r"2 listed file\(s\) do not exist.*broken\.txt:3 'b/missing.png'"
    ):
        collect_inputs(f"@{tree / 'broken.txt'}")
    with pytest.raises(MissingDataError, match="list file does not exist"):
        collect_inputs(f"@{tree / 'nope.txt'}")
    (tree / "folders.txt").write_text("a\n")
    with pytest.raises(DataError, match=r"folders\.txt:1: 'a' is a folder"):
        collect_inputs(f"@{tree / 'folders.txt'}")


# ------------------------------------------------------------------------------------------ annotations
@pytest.fixture(scope="module")
def subfolder_coco(tmp_path_factory) -> tuple[Path, Path, dict[str, int]]:
    """6 shapes images as part_a/img_<k>.jpg and part_b/img_<k>.jpg (the same names in two folders), with
    an annotation file whose file_names carry the folder and whose image ids are not 1..6."""
    tmp = tmp_path_factory.mktemp("subfolder_coco")
    source = make_detection_dataset(tmp / "shapes", num_train=0, num_val=6, seed=3, min_size=64, max_size=96)
    dataset = json.loads((source / "annotations" / "instances_val2017.json").read_text())
    root = tmp / "images"
    new_id = {}
    for k, image in enumerate(dataset["images"]):
        name = f"part_{'ab'[k // 3]}/img_{k % 3}.jpg"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "val2017" / image["file_name"], root / name)
        new_id[image["id"]] = 1000 - 7 * k
        image.update(file_name=name, id=new_id[image["id"]])
    for ann in dataset["annotations"]:
        ann["image_id"] = new_id[ann["image_id"]]
    annotations = tmp / "instances.json"
    annotations.write_text(json.dumps(dataset))
    return root, annotations, {im["file_name"]: im["id"] for im in dataset["images"]}


def _ground_truth(annotations: Path, image_id: int, categories: CategoryMap) -> tuple[np.ndarray, np.ndarray]:
    anns = [a for a in json.loads(annotations.read_text())["annotations"] if a["image_id"] == image_id]
    boxes = np.array([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)]).reshape(-1, 4)
    return boxes, categories.category_id_to_label(np.array([a["category_id"] for a in anns], dtype=np.int64))


def test_annotations_key_detections_by_file_path_and_score_them(subfolder_coco, tmp_path, caplog):
    root, annotations, id_of = subfolder_coco
    dataset = json.loads(annotations.read_text())
    inputs = collect_inputs(root)
    assert [i.name for i in inputs] == sorted(id_of)
    image_ids = match_annotation_ids(inputs, dataset)
    assert image_ids == [id_of[i.name] for i in inputs]  # basenames repeat: matched by relative path

    categories = categories_for_annotations(CategoryMap.from_coco(dataset), dataset)
    answers = [_ground_truth(annotations, id_of[i.name], categories) for i in inputs]
    answers[0] = (np.zeros((0, 4)), np.zeros(0, dtype=np.int64))  # the first image: every box missed
    detector = _Oracle(categories, answers)
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="ssd_lightning.inference.predict"):
        results, _ = predict_images(
            detector, inputs, out, batch_size=4, image_ids=image_ids, categories=categories
        )
        report = evaluate_predictions(annotations, results, image_ids, out, annotated_images=6)
    assert "6 images in" in caplog.text and "images/s" in caplog.text
    assert "| category" in caplog.text and "Average Precision" in caplog.text

    saved = json.loads((out / "predictions.json").read_text())
    detected = {
        (i.name, id_of[i.name]) for i, (_, labels) in zip(inputs, answers, strict=True) if len(labels)
    }
    assert len(detected) >= 4 and {(e["file_name"], e["image_id"]) for e in saved} == detected
    written = json.loads((out / "coco_eval.json").read_text())
    assert written == json.loads(json.dumps(report)) and written["images"] == 6
    independent = evaluate_coco(annotations, out / "predictions.json", verbose=False, per_class=True)
    assert written["stats"] == {k: independent[k] for k in COCO_STAT_NAMES}
    per_class = {f"AP/{r['metric_key']}": r["AP"] for r in written["per_class"] if r["AP"] is not None}
    assert per_class == {k: v for k, v in independent.items() if k.startswith("AP/")}
    # every box of five images found exactly (IoU ~1 at every threshold), none of the first: per class,
    # recall = found / ground truth, precision 1 up to it; AP = the share of the 101 recall points reached
    found = {cid: 0 for cid in categories.category_ids}
    for labels in (a[1] for a in answers):
        for cid in categories.label_to_category_id(labels).tolist():
            found[cid] += 1
    gt = {cid: sum(a["category_id"] == cid for a in dataset["annotations"]) for cid in found}
    recall = {cid: found[cid] / gt[cid] for cid in found if gt[cid]}
    assert 0 < sum(found.values()) < sum(gt.values())
    ap = {cid: (np.linspace(0, 1, 101) <= r).sum() / 101 for cid, r in recall.items()}
    for key in ("mAP", "mAP_50", "mAP_75"):
        assert written["stats"][key] == pytest.approx(np.mean(list(ap.values())), abs=1e-12), key
    assert written["stats"]["mAR_100"] == pytest.approx(np.mean(list(recall.values())), abs=1e-12)


def test_unmatched_images_and_other_categories_are_one_line_errors(subfolder_coco, tmp_path):
    root, annotations, _ = subfolder_coco
    dataset = json.loads(annotations.read_text())
    extra = _image(tmp_path / "extra" / "not_annotated.jpg")
    inputs = [*collect_inputs(root), *collect_inputs(extra)]
    with pytest.raises(DataError, match=r"instances.json: 1 of the 7 input image\(s\).*not_annotated\.jpg"):
        match_annotation_ids(inputs, dataset, where=str(annotations))
    flat = collect_inputs([root / "part_a" / "img_0.jpg", root / "part_b" / "img_0.jpg"])  # single files
    assert [i.name for i in flat] == ["img_0.jpg", "img_0.jpg"]  # two annotated images have that name
    with pytest.raises(DataError, match=r"2 of the 2 .*img_0\.jpg \(file name not unique there\)"):
        match_annotation_ids(flat, dataset)
    one = {"images": [{"id": 5, "file_name": "q.jpg"}]}
    twice = [InputImage(Path("a/q.jpg"), "a/q.jpg"), InputImage(Path("b/q.jpg"), "b/q.jpg")]
    with pytest.raises(DataError, match="several input images match the same image entry.*a/q.jpg, b/q.jpg"):
        match_annotation_ids(twice, one)
    assert match_annotation_ids(twice[:1], one) == [5]

    ours = CategoryMap.from_coco(dataset)
    assert categories_for_annotations(ours, dataset) is ours
    # the same names under other ids: each label gets the file's id of its name
    renumbered = CategoryMap.from_names(ours.names[:0:-1])  # reversed order, ids 1..4
    mapped = categories_for_annotations(renumbered, dataset)
    assert mapped.names == renumbered.names
    assert mapped.category_ids == ours.category_ids[::-1] == (20, 11, 7, 3)
    other = CategoryMap.from_names(["cat", "dog"])
    with pytest.raises(DataError) as error:
        categories_for_annotations(other, dataset, where="annotations=x.json")
    message = str(error.value)
    assert "\n" not in message and message.startswith("annotations=x.json: its categories {3: 'rectangle'")
    assert "the detector's {1: 'cat', 2: 'dog'}" in message


# ------------------------------------------------------------------------------------------ memory
def test_a_run_stopped_midway_keeps_its_lines_and_reads_only_a_few_batches_ahead(tmp_path, monkeypatch):
    """predictions.jsonl holds every image done before the stop (an unreadable one as an error line);
    predictions.json is only replaced at the end; reads in flight stay within the read-ahead window."""
    from ssd_lightning.inference import predict

    folder = tmp_path / "photos"
    for k in range(30):
        _image(folder / f"img_{k:02d}.png", value=k)
    (folder / "img_02b.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG")
    out = tmp_path / "out"
    out.mkdir()
    (out / "predictions.json").write_text('"from an earlier run"')

    calls, started, detected, most_ahead = [], [], [], []
    real_read = predict._read

    def counting_read(*args, **kwargs):
        started.append(1)
        most_ahead.append(len(started) - len(detected))
        return real_read(*args, **kwargs)

    class Stopped(_Oracle):
        def detect(self, images, sizes):
            calls.append(len(sizes))
            if len(calls) == 3:
                raise KeyboardInterrupt
            detected.extend(sizes)
            return super().detect(images, sizes)

    monkeypatch.setattr(predict, "_read", counting_read)
    categories = CategoryMap.from_names(["s"])
    box = (np.array([[1.0, 2.0, 11.0, 12.0]]), np.array([1]))
    with pytest.raises(KeyboardInterrupt):
        predict_images(Stopped(categories, [box] * 31), collect_inputs(folder), out, batch_size=2, workers=2)
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [(line["file_name"], "error" in line) for line in lines] == [
        ("img_00.png", False),
        ("img_01.png", False),
        ("img_02b.jpg", True),  # written when it was read, before the batch it fell into
        ("img_02.png", False),
        ("img_03.png", False),
    ]
    assert lines[0] == {
        "image_id": 0,
        "file_name": "img_00.png",
        "height": 30,
        "width": 40,
        "detections": [
            {"category_id": 1, "bbox": [1.0, 2.0, 10.0, 10.0], "score": 0.9, "category_name": "s"}
        ],
    }
    assert (out / "predictions.json").read_text() == '"from an earlier run"'
    window = max(2 * 2, 4 * 2)  # predict's read-ahead for batch_size=2, workers=2
    # + the batch being filled + the unreadable file (read, never detected)
    assert max(most_ahead) <= window + 2 + 1, max(most_ahead)
