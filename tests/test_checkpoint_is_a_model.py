"""A checkpoint is a model: trained on own data with ``num_classes=null``, copied elsewhere, its run deleted,
the file alone predicts, exports (network and end to end), validates and initialises a new run, with the
user's class names and dataset category ids everywhere. The same for a MobileNetV2 classifier on an
ImageFolder. Each chain is one small real run (``train.py`` as users start it), shared by its assertions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ssd_lightning.inference.classifier import load_classifier
from ssd_lightning.inference.detector import load_detector
from ssd_lightning.io.model_record import FORMAT_VERSION, MODEL_KEY, read_model_record
from ssd_lightning.io.weights import CheckpointReadError
from tests.helpers import REPO_ROOT, load_checkpoint, run_script, run_train_py

# what the checkpoint file carries: DALI only carries the data
pytestmark = [pytest.mark.slow, pytest.mark.no_dali]

PREDICT_PY = REPO_ROOT / "predict.py"
EXPORT_PY = REPO_ROOT / "scripts" / "export_onnx.py"
# the generated shapes' categories, by name -> another id (non-contiguous) and an own name
OWN_CATEGORIES = {"rectangle": (24, "bolt"), "ellipse": (52, "nut"), "triangle": (80, "washer"),
                  "star": (143, "gear")}  # fmt: skip
OWN_CLASSES = {"rectangle": "tile", "ellipse": "coin", "triangle": "wedge", "star": "badge"}


def _no_traceback(result) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    return output


def _best_per_image(predictions: list[dict]) -> dict[str, tuple[float, int]]:
    """``file_name`` -> (score, category_id) of its most confident detection."""
    best: dict[str, tuple[float, int]] = {}
    for p in predictions:
        best[p["file_name"]] = max(best.get(p["file_name"], (-1.0, 0)), (p["score"], p["category_id"]))
    return best


def _own_detection_data(shapes_coco: Path, root: Path) -> Path:
    """``root``: ``images/`` + ``train.json`` + ``val.json``, categories renamed and renumbered."""
    (root / "images").mkdir(parents=True)
    for split, out in (("train2017", "train.json"), ("val2017", "val.json")):
        data = json.loads((shapes_coco / "annotations" / f"instances_{split}.json").read_text())
        new = {c["id"]: OWN_CATEGORIES[c["name"]] for c in data["categories"]}  # in the file's order
        data["categories"] = [{"id": new[c["id"]][0], "name": new[c["id"]][1]} for c in data["categories"]]
        for annotation in data["annotations"]:
            annotation["category_id"] = new[annotation["category_id"]][0]
        for image in data["images"]:
            shutil.copy(shapes_coco / split / image["file_name"], root / "images" / image["file_name"])
        (root / out).write_text(json.dumps(data))
    return root


def _own_data_overrides(root: Path) -> list[str]:
    """README's own-data command's data keys."""
    return [
        "data=coco",
        f"data.root={root}",
        f"data.train_images={root}/images",
        f"data.train_annotations={root}/train.json",
        f"data.val_images={root}/images",
        f"data.val_annotations={root}/val.json",
    ]


@pytest.fixture(scope="module")
def detector_file(tmp_path_factory, shapes_coco) -> dict:
    """One epoch of the demo recipe on own data (``num_classes=null``); ``last.ckpt`` copied out, the run
    deleted. Also keeps a copy in the format written before checkpoints recorded their model, inside a run
    directory of its own."""
    base = tmp_path_factory.mktemp("own_detector")
    data = _own_detection_data(shapes_coco, base / "parts")
    run = base / "run"
    result = run_train_py(
        "experiment=demo",
        *_own_data_overrides(data),
        "model.net.num_classes=null",
        "trainer.max_epochs=1",
        "data.batch_size=4",
        "data.eval_batch_size=5",
        "eval_epochs=[0]",
        f"hydra.run.dir={run}",
        timeout=900,
    )
    _no_traceback(result)
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert saved.model.net.num_classes == 5  # written back as decided, not null
    legacy_run = base / "legacy_run"
    (legacy_run / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / ".hydra", legacy_run / ".hydra")
    checkpoint = load_checkpoint(run / "checkpoints" / "last.ckpt")
    del checkpoint[MODEL_KEY]
    torch.save(checkpoint, legacy_run / "checkpoints" / "last.ckpt")
    shared = base / "shared" / "parts_detector.ckpt"
    shared.parent.mkdir()
    shutil.copy(run / "checkpoints" / "last.ckpt", shared)
    shutil.rmtree(run)
    return {"ckpt": shared, "data": data, "legacy": legacy_run / "checkpoints" / "last.ckpt", "base": base}


def test_the_checkpoint_records_the_model_as_plain_values(detector_file):
    record = read_model_record(load_checkpoint(detector_file["ckpt"]), source="test")
    assert record["format_version"] == FORMAT_VERSION and record["kind"] == "detector"
    assert record["architecture"] == {
        "builder": "ssd300",
        "args": {"backbone": "mobilenet_v2", "num_classes": 5, "width_mult": 0.5},
    }
    assert record["classes"] == {
        "names": ["background", "bolt", "nut", "washer", "gear"],
        "category_ids": [24, 52, 80, 143],
    }
    assert record["input"]["image_size"] == 300 and record["input"]["resize"] is None
    assert record["decoder"] == {"score_thresh": 0.05, "nms_iou": 0.5, "topk_per_class": 200,
                                 "max_detections": 200}  # fmt: skip
    assert record["weights"] == "net."
    assert record["training"]["lr"] == pytest.approx(2e-3) and record["training"]["global_batch_size"] == 4


def test_the_file_alone_predicts_exports_and_validates(detector_file, tmp_path):
    ckpt, data = detector_file["ckpt"], detector_file["data"]
    val = json.loads((data / "val.json").read_text())
    listed = tmp_path / "val.txt"
    listed.write_text("\n".join(str(data / "images" / image["file_name"]) for image in val["images"]))
    own_ids = {cid for cid, _ in OWN_CATEGORIES.values()}
    own_names = {name for _, name in OWN_CATEGORIES.values()}

    # predict, scored against the user's annotation file: ids and names are theirs
    out = tmp_path / "pred"
    low = "decoder.score_thresh=0.001"  # a model of six steps: keep its few confident boxes
    _no_traceback(
        run_script(
            PREDICT_PY,
            f"ckpt_path={ckpt}",
            f"input=@{listed}",
            f"output={out}",
            f"annotations={data / 'val.json'}",
            low,
        )  # fmt: skip
    )
    predictions = json.loads((out / "predictions.json").read_text())
    assert predictions, "no detections at score_thresh=0.001"
    assert {p["category_id"] for p in predictions} <= own_ids
    assert {p["category_name"] for p in predictions} <= own_names
    report = json.loads((out / "coco_eval.json").read_text())
    assert {c["name"] for c in report["per_class"]} == own_names
    assert len(list(out.rglob("*.jpg"))) == len(val["images"])

    # both exports, from the file alone; the end-to-end one predicts what the checkpoint predicts (its own
    # random-batch check is off: at score_thresh 0.001 near-equal scores of a six-step model reorder)
    output = _no_traceback(run_script(EXPORT_PY, f"ckpt_path={ckpt}", f"output={tmp_path / 'net.onnx'}"))
    assert "classes: bolt, nut, washer, gear" in output
    e2e = tmp_path / "e2e.onnx"
    _no_traceback(
        run_script(EXPORT_PY, f"ckpt_path={ckpt}", f"output={e2e}", "end_to_end=true", low, "check=false")
    )
    onnx_out = tmp_path / "pred_onnx"
    _no_traceback(
        run_script(PREDICT_PY, f"onnx={e2e}", f"input=@{listed}", f"output={onnx_out}", "draw=false")
    )
    from_onnx = json.loads((onnx_out / "predictions.json").read_text())
    assert len(from_onnx) == len(predictions)
    best, best_onnx = _best_per_image(predictions), _best_per_image(from_onnx)
    assert best.keys() == best_onnx.keys()
    for name, (score, category) in best.items():
        assert best_onnx[name][0] == pytest.approx(score, abs=1e-3) and best_onnx[name][1] == category

    # validate: the network the file records, whatever the config's defaults say (ResNet-50, 81 classes)
    output = _no_traceback(
        run_train_py(
            "task=validate",
            f"ckpt_path={ckpt}",
            *_own_data_overrides(data),
            "precision=bf16",
            "data.eval_batch_size=5",
            f"hydra.run.dir={tmp_path / 'validate'}",
            timeout=600,
        )  # fmt: skip
    )
    assert "model.net.backbone=mobilenet_v2" in output and "val/mAP" in output
    assert "val/AP/bolt" in output and "val/AP/gear" in output

    # init_from: a new run starts from the file's weights (heads included: the same classes)
    output = _no_traceback(
        run_train_py(
            "experiment=demo",
            *_own_data_overrides(data),
            "model.net.num_classes=null",
            f"model.init_from={ckpt}",
            "trainer.max_epochs=1",
            "+trainer.limit_train_batches=1",
            "+trainer.limit_val_batches=0",
            "eval_epochs=[]",
            "data.batch_size=4",
            f"hydra.run.dir={tmp_path / 'finetune'}",
            timeout=600,
        )  # fmt: skip
    )
    assert f"model.init_from={ckpt}: loaded" in output and "(100% of the weights); re-initialised 0" in output


def test_a_checkpoint_in_the_earlier_format_still_predicts_the_same(detector_file, tmp_path):
    """No model record: rebuilt from its run's .hydra/config.yaml, names from its annotation file."""
    legacy = load_detector(detector_file["legacy"])
    current = load_detector(detector_file["ckpt"])
    assert legacy.class_names == current.class_names and legacy.category_ids == current.category_ids
    images = torch.randn(2, 3, 300, 300, generator=torch.Generator().manual_seed(0))
    sizes = [(300, 300)] * 2
    for a, b in zip(legacy.detect(images, sizes), current.detect(images, sizes), strict=True):
        for name in ("boxes", "scores", "labels"):
            assert torch.equal(a[name], b[name])


def test_unusable_files_are_one_error_line(detector_file, tmp_path):
    ckpt = detector_file["ckpt"]
    checkpoint = load_checkpoint(ckpt)
    newer = dict(checkpoint, **{MODEL_KEY: {**checkpoint[MODEL_KEY], "format_version": FORMAT_VERSION + 1}})
    torch.save(newer, tmp_path / "newer.ckpt")
    torch.save({"state_dict": {"backbone.weight": torch.zeros(1)}, "epoch": 3}, tmp_path / "other.ckpt")
    (tmp_path / "cut.ckpt").write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    cases = {
        "newer.ckpt": "written by a newer ssd_lightning",
        "other.ckpt": "records no model",
        "cut.ckpt": "is not a checkpoint torch.load can read",
    }
    for name, message in cases.items():
        with pytest.raises(CheckpointReadError, match=message):
            load_detector(tmp_path / name)
    result = run_script(
        PREDICT_PY,
        f"ckpt_path={tmp_path / 'cut.ckpt'}",
        f"input={detector_file['data']}",
        f"output={tmp_path}",
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.startswith("Error: ckpt_path=") and "cut.ckpt" in result.stderr
    result = run_script(EXPORT_PY, f"ckpt_path={tmp_path / 'newer.ckpt'}", f"output={tmp_path / 'x.onnx'}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "written by a newer ssd_lightning" in result.stderr
    # resume= of a run whose last.ckpt was cut short (a copy interrupted): one line naming the good ones
    run = tmp_path / "run"
    shutil.copytree(detector_file["legacy"].parent.parent, run)
    shutil.copy(ckpt, run / "checkpoints" / "epoch_0.ckpt")
    shutil.copy(tmp_path / "cut.ckpt", run / "checkpoints" / "last.ckpt")
    result = run_train_py(f"resume={run}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.startswith(
        f"Error: ckpt_path={run / 'checkpoints' / 'last.ckpt'} is not a checkpoint"
    )
    assert (
        f"Complete checkpoints beside it: epoch_0.ckpt; continue from one with ckpt_path={run}"
        in result.stderr
    )


# ------------------------------------------------------------------------------------------ classifier
@pytest.fixture(scope="module")
def classifier_file(tmp_path_factory, shapes_imagefolder) -> dict:
    """One epoch of the MobileNetV2 demo recipe on an own ImageFolder (own class folder names,
    ``num_classes=null``); ``last.ckpt`` copied out, the run deleted."""
    base = tmp_path_factory.mktemp("own_classifier")
    data = base / "tools"
    for split in ("train", "val"):
        for folder in (shapes_imagefolder / split).iterdir():
            shutil.copytree(folder, data / split / OWN_CLASSES[folder.name])
    run = base / "run"
    output = _no_traceback(
        run_train_py(
            "experiment=mobilenetv2_demo",
            "data=imagenet",
            f"data.root={data}",
            "data.image_size=64",
            "data.val_resize=72",
            "data.batch_size=8",
            "model.net.num_classes=null",
            "trainer.max_epochs=1",
            f"hydra.run.dir={run}",
            timeout=600,
        )  # fmt: skip
    )
    assert OmegaConf.load(run / ".hydra" / "config.yaml").model.net.num_classes == 4
    shared = base / "shared" / "tools.ckpt"
    shared.parent.mkdir()
    shutil.copy(run / "checkpoints" / "last.ckpt", shared)
    shutil.rmtree(run)
    acc1 = float(output.split("val/acc1 = ")[1].split()[0])
    return {"ckpt": shared, "data": data, "acc1": acc1}


def test_a_classifier_file_predicts_exports_and_validates(classifier_file, tmp_path):
    ckpt, data = classifier_file["ckpt"], classifier_file["data"]
    record = read_model_record(load_checkpoint(ckpt), source="test")
    assert record["kind"] == "classifier" and record["classes"]["names"] == sorted(OWN_CLASSES.values())
    assert record["input"] == {"image_size": 64, "resize": 72,
                               "mean": pytest.approx([123.675, 116.28, 103.53]),
                               "std": pytest.approx([58.395, 57.12, 57.375])}  # fmt: skip
    with pytest.raises(CheckpointReadError, match="is a classifier"):
        load_detector(ckpt)

    out = tmp_path / "pred"
    _no_traceback(
        run_script(
            PREDICT_PY,
            f"ckpt_path={ckpt}",
            f"input={data / 'val'}",
            f"output={out}",
            f"annotations={data / 'val'}",
            "top_k=2",
        )  # fmt: skip
    )
    predictions = json.loads((out / "predictions.json").read_text())
    assert len(predictions) == 4 * 5 and all(len(p["top_k"]) == 2 for p in predictions)
    assert {t["name"] for p in predictions for t in p["top_k"]} <= set(OWN_CLASSES.values())
    first = predictions[0]
    assert first["top_k"][0]["score"] >= first["top_k"][1]["score"] and first["file_name"].startswith(
        "badge/"
    )
    report = json.loads((out / "classification_eval.json").read_text())
    assert report["images"] == 20 and report["top5"] == 1.0  # 4 classes: the true one is always in the top 5
    hits = sum(p["top_k"][0]["name"] == p["file_name"].split("/")[0] for p in predictions)
    assert report["top1"] == pytest.approx(hits / 20)
    assert [c["images"] for c in report["per_class"]] == [5, 5, 5, 5]
    # what training's validation measured, up to the two resize implementations (DALI vs Pillow)
    assert abs(report["top1"] - classifier_file["acc1"]) <= 0.1 + 1e-9
    assert len(list(out.rglob("*.jpg"))) == 20

    onnx = tmp_path / "tools.onnx"
    output = _no_traceback(run_script(EXPORT_PY, f"ckpt_path={ckpt}", f"output={onnx}"))
    assert "classes: badge, coin, tile, wedge" in output
    onnx_out = tmp_path / "pred_onnx"
    _no_traceback(
        run_script(PREDICT_PY, f"onnx={onnx}", f"input={data / 'val'}", f"output={onnx_out}", "draw=false")
    )
    from_onnx = json.loads((onnx_out / "predictions.json").read_text())
    for a, b in zip(from_onnx, predictions, strict=True):
        assert [t["label"] for t in a["top_k"][:2]] == [t["label"] for t in b["top_k"]]
        assert a["top_k"][0]["score"] == pytest.approx(b["top_k"][0]["score"], abs=1e-4)

    classifier = load_classifier(ckpt)
    assert classifier.class_names == tuple(sorted(OWN_CLASSES.values())) and classifier.resize == 72

    output = _no_traceback(
        run_train_py(
            "experiment=mobilenetv2_demo",
            "task=validate",
            f"ckpt_path={ckpt}",
            "data=imagenet",
            f"data.root={data}",
            "data.image_size=64",
            "data.val_resize=72",
            f"hydra.run.dir={tmp_path / 'validate'}",
            timeout=600,
        )  # fmt: skip
    )
    assert f"val/acc1 = {classifier_file['acc1']:.4f}" in output
    result = run_train_py("task=validate", f"ckpt_path={ckpt}", "data=imagenet", f"data.root={data}",
                          f"hydra.run.dir={tmp_path / 'wrong_kind'}")  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is a classifier (mobilenet_v2) but model= builds" in result.stderr
