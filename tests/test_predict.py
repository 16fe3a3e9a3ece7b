"""predict.py: a fake run directory (config + random resnet18 weights), images of any size, a corrupt file."""

from __future__ import annotations

import json
import math
import re
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, open_dict
from PIL import Image

from ssd_lightning.data.categories import COCO_CATEGORY_IDS, COCO_CLASS_NAMES, CategoryMap
from ssd_lightning.inference.detector import load_detector
from ssd_lightning.inference.predict import collect_inputs, open_image, predict_images, preprocess
from ssd_lightning.io.weights import CheckpointReadError
from ssd_lightning.models import ssd300
from ssd_lightning.modules.ssd import SSDLitModule
from tests.helpers import REPO_ROOT, BrightBox, compose_config, run_script

PREDICT_PY = REPO_ROOT / "predict.py"

SHAPE_NAMES = {"rectangle", "ellipse", "triangle", "star"}
DECODER = {"score_thresh": 0.05, "nms_iou": 0.5, "topk_per_class": 200, "max_detections": 30}


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory, shapes_coco) -> tuple[Path, torch.nn.Module]:
    """<run>/.hydra/config.yaml as train.py saves it (unresolved) + <run>/checkpoints/last.ckpt in the format
    of checkpoints written before they recorded their model (weights and decoder only): those keep working."""
    run = tmp_path_factory.mktemp("run")
    cfg = compose_config(["experiment=demo", "model.net.backbone=resnet18", f"data.root={shapes_coco}"])
    (run / ".hydra").mkdir()
    (run / ".hydra" / "hydra.yaml").write_text(
        OmegaConf.to_yaml({"hydra": {"runtime": {"cwd": str(REPO_ROOT), "output_dir": str(run)}}})
    )
    with open_dict(cfg):
        del cfg["hydra"]
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))  # keeps ${paths...} unresolved
    torch.manual_seed(0)
    net = ssd300(backbone="resnet18", num_classes=5).eval()
    (run / "checkpoints").mkdir()
    checkpoint = {
        "state_dict": {f"net.{k}": v for k, v in net.state_dict().items()},
        "hyper_parameters": {"decoder": DECODER},
    }
    torch.save(checkpoint, run / "checkpoints" / "last.ckpt")
    return run, net


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (360, 640, 3), dtype=np.uint8)).save(folder / "wide.png")
    Image.fromarray(rng.integers(0, 255, (300, 200, 3), dtype=np.uint8)).save(folder / "tall.jpg")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    (folder / "notes.txt").write_text("not an image, ignored")
    return folder


def test_preprocess_is_resize_and_imagenet_normalisation():
    mean = (round(0.485 * 255), round(0.456 * 255), round(0.406 * 255))
    flat = preprocess(Image.new("RGB", (123, 45), mean))
    assert flat.shape == (3, 300, 300) and flat.dtype == torch.float32
    assert flat.abs().max() < 0.01  # the mean colour maps to ~0 (rounding of the mean only)
    white = preprocess(Image.new("L", (10, 700), 255))  # grey input is converted to RGB
    expected = torch.tensor([(255 - 0.485 * 255) / (0.229 * 255), (255 - 0.456 * 255) / (0.224 * 255),
                             (255 - 0.406 * 255) / (0.225 * 255)])  # fmt: skip
    torch.testing.assert_close(white[:, 150, 150], expected)


def test_load_detector_rebuilds_the_run_network(fake_run):
    run, net = fake_run
    detector = load_detector(run / "checkpoints" / "last.ckpt")
    assert detector.class_names[0] == "background" and set(detector.class_names[1:]) == SHAPE_NAMES
    for key, value in net.state_dict().items():
        assert torch.equal(detector.net.state_dict()[key], value), key
    assert dict(detector.settings) == DECODER  # from the checkpoint's hyper_parameters
    assert not detector.net.training


def test_predict_folder_skips_corrupt_file_and_matches_the_lightning_module(fake_run, images, tmp_path):
    run, net = fake_run
    detector = load_detector(run / "checkpoints" / "last.ckpt")
    inputs = collect_inputs(images)
    assert [p.name for p in inputs] == ["broken.jpg", "tall.jpg", "wide.png"]  # sorted, no .txt
    results, failures = predict_images(detector, inputs, tmp_path, batch_size=2)
    assert [p.name for p, _ in failures] == ["broken.jpg"]
    assert sorted(p.name for p in tmp_path.glob("*.jpg")) == ["tall.jpg", "wide.jpg"]
    saved = json.loads((tmp_path / "predictions.json").read_text())
    assert saved == json.loads(json.dumps(results))
    sizes = {"tall.jpg": (200, 300), "wide.png": (640, 360)}
    per_file: dict[str, list] = {}
    for entry in saved:
        per_file.setdefault(Path(entry["file_name"]).name, []).append(entry)
    assert set(per_file) == set(sizes)
    for name, entries in per_file.items():
        w, h = sizes[name]
        assert len(entries) <= DECODER["max_detections"]
        assert {e["image_id"] for e in entries} == {[p.name for p in inputs].index(name)}
        for e in entries:
            x, y, bw, bh = e["bbox"]
            assert 0 <= x <= x + bw <= w + 0.01 and 0 <= y <= y + bh <= h + 0.01, (name, e["bbox"])
            assert e["category_name"] in SHAPE_NAMES and e["score"] > DECODER["score_thresh"]
    # the picture keeps the original size
    assert Image.open(tmp_path / "wide.jpg").size == (640, 360)

    # equality: SSDLitModule's validation decode on the same preprocessed tensor
    module = SSDLitModule(net, optimizer=partial(torch.optim.SGD, lr=0.1), decoder=DECODER).eval()
    image, _ = open_image(images / "wide.png")
    x = preprocess(image)[None]
    batch = {"images": x, "image_ids": torch.tensor([7]), "image_sizes": torch.tensor([[360, 640]])}
    with torch.no_grad():
        expected = module._detect(batch)[0]
    got = detector.detect(x, [(360, 640)])[0]
    for key in ("boxes", "scores", "labels"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    assert len(expected["scores"]) > 0
    clipped = expected["boxes"].clone()
    clipped[:, 0::2] = clipped[:, 0::2].clamp(0, 640)
    clipped[:, 1::2] = clipped[:, 1::2].clamp(0, 360)
    json_boxes = torch.tensor([e["bbox"] for e in per_file["wide.png"]], dtype=torch.float32)
    torch.testing.assert_close(json_boxes[:, :2], clipped[:, :2], atol=0.006, rtol=0)
    torch.testing.assert_close(json_boxes[:, 2:], clipped[:, 2:] - clipped[:, :2], atol=0.012, rtol=0)


# ------------------------------------------------------------------------------ reduced-scale decoding
ROTATED_BOX = (200, 900, 700, 1300)  # ltrb of the white rectangle, as the photo is shown (1200 x 1600)


@pytest.fixture(scope="module")
def rotated_photo(tmp_path_factory) -> Path:
    """A 1600x1200 JPEG whose EXIF orientation (6) shows it as 1200x1600, a white rectangle on grey noise at
    ``ROTATED_BOX`` in the shown image's pixels."""
    shown = np.random.default_rng(1).integers(40, 90, (1600, 1200, 3), dtype=np.uint8)
    left, top, right, bottom = ROTATED_BOX
    shown[top:bottom, left:right] = 255
    stored = Image.fromarray(shown).transpose(Image.Transpose.ROTATE_90)  # exif_transpose undoes it
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path_factory.mktemp("photo") / "photo.jpg"
    stored.save(path, quality=95, exif=exif)
    return path


def test_predictions_json_is_written_as_the_records_come(rotated_photo, tmp_path):
    """predict.py keeps no results in memory (keep_results=False): predictions.json, written beside
    predictions.jsonl, is the text json.dump writes for the results list, failures leaving no entries."""
    bad = tmp_path / "bad.jpg"
    bad.write_text("not an image")
    inputs = [rotated_photo, bad, rotated_photo.parent / "photo.jpg"]
    kept, failures = predict_images(BrightBox(), inputs, tmp_path / "kept", draw=False, image_ids=[7, 8, 9])
    assert len(kept) == 2 and [p.name for p, _ in failures] == ["bad.jpg"]
    assert (tmp_path / "kept" / "predictions.json").read_text() == json.dumps(kept)
    assert [(e["image_id"], list(e)) for e in kept] == [
        (i, ["image_id", "category_id", "bbox", "score", "file_name", "category_name"]) for i in (7, 9)
    ]
    streamed, _ = predict_images(
        BrightBox(), inputs, tmp_path / "streamed", draw=False, image_ids=[7, 8, 9], keep_results=False
    )
    assert streamed == []
    assert (tmp_path / "streamed" / "predictions.json").read_text() == json.dumps(kept)


class _OddNames(BrightBox):
    """Category names JSON must escape, and a second detection whose score is not a number (first image)
    or becomes infinite when rounded (second image)."""

    categories = CategoryMap((3, 7), ("background", 'say "box"', "boîte\\"))

    def detect(self, images: torch.Tensor, sizes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        out = super().detect(images, sizes)
        for k, found in enumerate(out):
            found["boxes"] = torch.cat([found["boxes"], found["boxes"] / 2])
            found["scores"] = torch.tensor([0.9, float("nan") if k == 0 else 1e306], dtype=torch.float64)
            found["labels"] = torch.tensor([1, 2])
        return out


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # rounding 1e306 to 5 decimals
def test_both_prediction_files_are_the_text_json_dumps_writes(rotated_photo, tmp_path):
    """Each detection is formatted once for both files: the text must stay json.dumps's own, for escaped
    names (category, file) and for non-finite scores (json's NaN, Infinity)."""
    odd = tmp_path / 'ph\u00f6to "1".jpg'
    odd.write_bytes(rotated_photo.read_bytes())
    kept, _ = predict_images(
        _OddNames(), [odd, rotated_photo], tmp_path / "out", draw=False, image_ids=[5, 6]
    )
    lines = (tmp_path / "out" / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.dumps(json.loads(line)) for line in lines] == lines
    assert (tmp_path / "out" / "predictions.json").read_text(encoding="utf-8") == json.dumps(kept)
    assert [(e["image_id"], e["category_id"], e["category_name"]) for e in kept] == [
        (5, 3, 'say "box"'),
        (5, 7, "boîte\\"),
        (6, 3, 'say "box"'),
        (6, 7, "boîte\\"),
    ]
    assert kept[0]["file_name"] == odd.name and math.isnan(kept[1]["score"]) and '"score": NaN' in lines[0]
    assert math.isinf(kept[3]["score"]) and '"score": Infinity' in lines[1]
    assert {type(v) for e in kept for v in (*e["bbox"], e["score"])} == {float}  # 20.0, not 20
    assert {type(e[k]) for e in kept for k in ("image_id", "category_id")} == {int}


def test_fast_decode_reads_a_reduced_jpeg_and_maps_boxes_to_the_full_rotated_photo(rotated_photo, tmp_path):
    full, size = open_image(rotated_photo)
    assert full.size == (1200, 1600) and size == (1600, 1200)  # EXIF orientation applied
    reduced, size = open_image(rotated_photo, min_side=600)
    assert reduced.size == (600, 800) and size == (1600, 1200)  # libjpeg's 1/2 scale; the full photo's size
    boxes = {}
    for fast in (True, False):
        out = tmp_path / str(fast)
        results, _ = predict_images(BrightBox(), [rotated_photo], out, fast_decode=fast, picture_size=500)
        (entry,) = results
        x, y, w, h = entry["bbox"]
        boxes[fast] = np.array([x, y, x + w, y + h])
        # one network pixel is 4 x 5.3 photo pixels: the edges land within about one of them
        np.testing.assert_allclose(boxes[fast], ROTATED_BOX, atol=8)
        (line,) = [json.loads(text) for text in (out / "predictions.jsonl").read_text().splitlines()]
        assert line["height"] == 1600 and line["width"] == 1200 and line["file_name"] == "photo.jpg"
        assert line["detections"] == [{k: v for k, v in entry.items() if k not in ("image_id", "file_name")}]
        assert json.loads((out / "predictions.json").read_text()) == results
        assert Image.open(out / "photo.jpg").size == (375, 500)  # longer side picture_size, shown upright
    np.testing.assert_allclose(boxes[True], boxes[False], atol=6)


def _matched(got: list[dict], want: list[dict], iou: float) -> float:
    """The share of ``got``'s detections with one of ``want`` (same image and class) at IoU >= ``iou``."""
    from torchvision.ops import box_convert, box_iou

    hits = 0
    for entry in got:
        others = [
            e["bbox"]
            for e in want
            if (e["image_id"], e["category_id"]) == (entry["image_id"], entry["category_id"])
        ]
        if others:
            boxes = box_convert(torch.tensor([entry["bbox"], *others]), "xywh", "xyxy")
            hits += bool(box_iou(boxes[:1], boxes[1:]).max() >= iou)
    return hits / max(len(got), 1)


def test_fast_decode_keeps_small_images_and_the_detections_of_large_ones(
    fake_run, images, shapes_coco, tmp_path
):
    """Off: the full decode, bit for bit; on: the same for images too small to reduce; on photos large
    enough to reduce, the network's input within a fraction of a grey level and the same detections, in the
    full photo's pixels."""
    run, _ = fake_run
    detector = load_detector(run / "checkpoints" / "last.ckpt")
    inputs = collect_inputs(images)
    exact, _ = predict_images(detector, inputs, tmp_path / "exact", fast_decode=False, draw=False)
    fast, _ = predict_images(detector, inputs, tmp_path / "fast", draw=False)
    assert exact == fast and len(exact) == 2 * DECODER["max_detections"]
    image, _ = open_image(images / "wide.png")
    want = detector.detect(preprocess(image)[None], [(360, 640)])[0]
    got = sorted((e["score"], e["bbox"]) for e in exact if e["file_name"] == "wide.png")
    assert [s for s, _ in got] == sorted(round(float(s), 5) for s in want["scores"])

    # 8 validation images enlarged 8x (JPEG)
    big = tmp_path / "big"
    big.mkdir()
    for path in sorted((shapes_coco / "val2017").glob("*.jpg"))[:8]:
        photo = Image.open(path).convert("RGB")
        photo.resize((8 * photo.width, 8 * photo.height), Image.BILINEAR).save(big / path.name)
    inputs = collect_inputs(big)
    reduced = 0
    for item in inputs:
        (full, _), (small, size) = open_image(item.path), open_image(item.path, min_side=600)
        reduced += small.size != full.size
        assert size == (full.height, full.width)
        difference = (preprocess(full) - preprocess(small)).abs().mean() * 0.225 * 255  # in grey levels
        assert difference < 0.5, (item.name, float(difference))  # measured: 0.05-0.12
    assert reduced >= 4, "too few images large enough for a reduced decode"
    found = {}
    for fast in (False, True):
        out = tmp_path / f"big_{fast}"
        predict_images(detector, inputs, out, fast_decode=fast, draw=False)
        found[fast] = json.loads((out / "predictions.json").read_text())
    # random weights score ~0 mAP either way, so the detections themselves are compared
    same = _matched(found[True], found[False], iou=0.9)
    assert same >= 0.95, same  # measured: 0.99


def test_dtype_auto_is_the_training_rule_and_bf16_runs_in_nhwc_under_autocast(fake_run, monkeypatch):
    from ssd_lightning.inference import detector as detector_module
    from ssd_lightning.inference.detector import resolve_dtype
    from ssd_lightning.models.cpu_bf16 import cpu_has_native_bf16

    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(detector_module, "cpu_has_native_bf16", lambda native=native: native)
        assert resolve_dtype("auto", "cpu")[0] == expected
    assert "no native bf16 kernels" in resolve_dtype("auto", "cpu")[1]
    assert resolve_dtype("auto", "cuda:0")[0] == "fp16"
    assert resolve_dtype(32, "cpu") == resolve_dtype("32", "cuda") == ("fp32", "asked for")
    private = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # torch's own test, private
    if private is not None:
        monkeypatch.undo()
        assert cpu_has_native_bf16() == bool(private()), torch.backends.cpu.get_cpu_capability()
    with pytest.raises(ValueError, match="dtype=fp64: expected auto, 32"):
        resolve_dtype("fp64", "cpu")

    run, _ = fake_run
    ckpt = run / "checkpoints" / "last.ckpt"
    fp32, bf16 = load_detector(ckpt), load_detector(ckpt, dtype="bf16")
    assert fp32.dtype == "fp32" and bf16.dtype == "bf16"
    conv = next(m for m in bf16.net.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 300, 300, generator=torch.Generator().manual_seed(0))
    want, got = fp32.detect(x, [(300, 400)] * 2), bf16.detect(x, [(300, 400)] * 2)
    for a, b in zip(want, got, strict=True):
        assert b["boxes"].dtype == b["scores"].dtype == torch.float32
        torch.testing.assert_close(b["scores"][:20], a["scores"][:20], atol=0.01, rtol=0)


def test_loading_errors_say_what_to_do(fake_run, tmp_path):
    run, _ = fake_run
    with pytest.raises(ValueError, match="exactly one"):
        load_detector()
    with pytest.raises(FileNotFoundError, match="not found: no such file"):
        load_detector(tmp_path / "missing.ckpt")
    # a checkpoint written before checkpoints recorded their model, moved out of its run directory
    lone = tmp_path / "last.ckpt"
    lone.write_bytes((run / "checkpoints" / "last.ckpt").read_bytes())
    with pytest.raises(CheckpointReadError, match="records no model .* pass run_config=<run>"):
        load_detector(lone)
    detector = load_detector(lone, run_config=run / ".hydra" / "config.yaml")
    assert detector.net.num_classes == 5
    with pytest.raises(FileNotFoundError, match="no image files"):
        collect_inputs(tmp_path / "nothing_*.jpg")


def test_coco_names_and_ids_line_up():
    assert len(COCO_CLASS_NAMES) == 81 and len(COCO_CATEGORY_IDS) == 80
    assert COCO_CLASS_NAMES[1] == "person" and COCO_CLASS_NAMES[80] == "toothbrush"
    assert COCO_CATEGORY_IDS[-1] == 90 and len(set(COCO_CATEGORY_IDS)) == 80
    named = dict(zip(COCO_CATEGORY_IDS, COCO_CLASS_NAMES[1:], strict=True))
    assert named[13] == "stop sign" and named[44] == "bottle" and named[67] == "dining table"
    assert named[70] == "toilet" and named[84] == "book"


def test_cli_reports_corrupt_files_and_fails_only_when_nothing_worked(fake_run, images, tmp_path):
    run, _ = fake_run
    ckpt = f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    out = f"output={tmp_path / 'out'}"
    result = run_script(PREDICT_PY, ckpt, f"input={images}", out, "batch_size=1", "dtype=32")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "broken.jpg" in result.stdout + result.stderr
    assert "dtype fp32 (asked for)" in result.stdout + result.stderr
    assert (tmp_path / "out" / "predictions.json").is_file() and (tmp_path / "out" / "wide.jpg").is_file()
    assert not (tmp_path / "out" / ".hydra").exists()
    result = run_script(PREDICT_PY, ckpt, f"input={images / 'broken.jpg'}", f"output={tmp_path / 'bad'}")
    assert result.returncode != 0
    assert "broken.jpg" in result.stdout + result.stderr


def test_cli_scores_a_folder_against_its_annotation_file(fake_run, shapes_coco, tmp_path):
    """annotations=: image ids from the file; coco_eval.json = evaluate_coco run on predictions.json."""
    from ssd_lightning.evaluation import COCO_STAT_NAMES, evaluate_coco

    run, _ = fake_run
    annotations = shapes_coco / "annotations" / "instances_val2017.json"
    dataset = json.loads(annotations.read_text())
    out = tmp_path / "out"
    result = run_script(
        PREDICT_PY,
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        f"input={shapes_coco / 'val2017'}",
        f"annotations={annotations}",
        f"output={out}",
        "draw=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert re.search(r"13 images in [\d.]+ s, [\d.]+ images/s", log), log[-3000:]
    assert re.search(r"dtype (fp32|bf16) \(auto: this CPU has (no )?native bf16", log), log[-3000:]
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert sorted(line["file_name"] for line in lines) == sorted(e["file_name"] for e in dataset["images"])
    assert "Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]" in log
    assert "| category " in log and "| rectangle " in log
    saved = json.loads((out / "predictions.json").read_text())
    id_of = {im["file_name"]: im["id"] for im in dataset["images"]}
    assert saved and all(id_of[e["file_name"]] == e["image_id"] for e in saved)
    written = json.loads((out / "coco_eval.json").read_text())
    independent = evaluate_coco(annotations, out / "predictions.json", verbose=False)
    assert written["stats"] == {k: independent[k] for k in COCO_STAT_NAMES}
    assert written["images"] == written["annotated_images"] == len(dataset["images"])
    assert [r["name"] for r in written["per_class"]] == [c["name"] for c in dataset["categories"]]

    other = tmp_path / "other.json"
    other.write_text(json.dumps({**dataset, "categories": [{"id": 1, "name": "cat"}]}))
    result = run_script(
        PREDICT_PY,
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        f"input={shapes_coco / 'val2017'}",
        f"annotations={other}",
        f"output={tmp_path / 'bad'}",
    )
    assert result.returncode == 1
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert "{1: 'cat'}" in error and "the detector's {3: 'rectangle'" in error, result.stderr[-3000:]


# ------------------------------------------------------------------------------ end-to-end ONNX export
def _export_script():
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("export_onnx", REPO_ROOT / "scripts" / "export_onnx.py")
    script = module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def onnx_export(fake_run, tmp_path_factory) -> Path:
    """The fake run's checkpoint through ``scripts/export_onnx.py end_to_end=true`` (in-process)."""
    pytest.importorskip("onnxruntime")
    run, _ = fake_run
    output = tmp_path_factory.mktemp("onnx") / "e2e.onnx"
    argv = [
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        "end_to_end=true",
        f"output={output}",
        "check=false",
    ]
    assert _export_script().main(argv) == 0
    return output


def _json_difference(got: list[dict], expected: list[dict], image_id: int) -> float:
    """detection_difference of one image's predictions.json entries; scores x 1000, so that one tolerance
    reads as 0.02 px for boxes and 2e-5 for scores."""
    from ssd_lightning.inference.export import detection_difference

    def arrays(results):
        entries = [e for e in results if e["image_id"] == image_id]
        boxes = np.array([e["bbox"] for e in entries]).reshape(-1, 4)
        return boxes, 1000 * np.array([e["score"] for e in entries]), [e["category_id"] for e in entries]

    return detection_difference(*arrays(got), *arrays(expected))


def test_onnx_export_predicts_what_the_checkpoint_predicts(fake_run, images, onnx_export, tmp_path):
    from ssd_lightning.inference.export import detection_difference

    run, _ = fake_run
    from_ckpt = load_detector(run / "checkpoints" / "last.ckpt")
    from_onnx = load_detector(onnx=onnx_export)
    assert from_onnx.session is not None and from_onnx.net is None
    assert from_onnx.class_names == from_ckpt.class_names and from_onnx.category_ids == from_ckpt.category_ids
    assert dict(from_onnx.settings) == DECODER  # the checkpoint's decoder, stored in the file
    inputs = collect_inputs(images)
    expected, _ = predict_images(from_ckpt, inputs, tmp_path / "ckpt", batch_size=2)
    got, failures = predict_images(from_onnx, inputs, tmp_path / "onnx", batch_size=2)
    assert [p.name for p, _ in failures] == ["broken.jpg"]
    assert len(got) == len(expected) == 2 * DECODER["max_detections"]
    key = ("image_id", "file_name", "category_id", "category_name")
    assert sorted(tuple(e[k] for k in key) for e in got) == sorted(tuple(e[k] for k in key) for e in expected)
    for image_id in (1, 2):  # 0 is broken.jpg
        assert _json_difference(got, expected, image_id) <= 0.02  # bbox rounded to 0.001 px, score to 1e-5
    assert sorted(p.name for p in (tmp_path / "onnx").glob("*.jpg")) == ["tall.jpg", "wide.jpg"]

    # detect(): the checkpoint's boxes clipped to the image, same scores and labels
    image, _ = open_image(images / "wide.png")
    x = preprocess(image)[None]
    want, have = from_ckpt.detect(x, [(360, 640)])[0], from_onnx.detect(x, [(360, 640)])[0]
    clipped = want["boxes"].clone()
    clipped[:, 0::2] = clipped[:, 0::2].clamp(0, 640)
    clipped[:, 1::2] = clipped[:, 1::2].clamp(0, 360)
    assert len(have["scores"]) == DECODER["max_detections"]
    difference = detection_difference(
        have["boxes"] / 640, have["scores"], have["labels"], clipped / 640, want["scores"], want["labels"]
    )
    assert difference <= 1e-4


def test_onnx_loading_errors_say_what_to_do(onnx_export, tmp_path):
    from ssd_lightning.inference.export import export_network

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_detector(onnx=tmp_path / "missing.onnx")
    with pytest.raises(ValueError, match=r"part of its graph.*decoder.max_detections=10"):
        load_detector(onnx=onnx_export, decoder={"max_detections": 10})
    same = load_detector(onnx=onnx_export, decoder={"max_detections": 30})  # the same setting: fine
    assert dict(same.settings) == DECODER
    network_only = export_network(ssd300(backbone="resnet18", num_classes=5), tmp_path / "net.onnx")
    with pytest.raises(ValueError, match="outputs locs, logits.*end_to_end=true"):
        load_detector(onnx=network_only)


def test_cli_runs_an_onnx_export(onnx_export, images, tmp_path):
    result = run_script(
        PREDICT_PY,
        f"onnx={onnx_export}",
        f"input={images / 'wide.png'}",
        f"output={tmp_path / 'out'}",
        "device=cpu",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "out" / "predictions.json").read_text())
    assert len(saved) == DECODER["max_detections"] and {e["image_id"] for e in saved} == {0}
    assert f"weights from {onnx_export}" in result.stdout + result.stderr
    both = run_script(
        PREDICT_PY,
        f"onnx={onnx_export}",
        "ckpt_path=x.ckpt",
        f"input={images}",
        f"output={tmp_path / 'bad'}",
    )
    assert both.returncode != 0 and "exactly one of" in both.stdout + both.stderr
