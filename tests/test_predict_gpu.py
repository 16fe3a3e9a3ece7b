"""predict.py's GPU reading (ssd_lightning.inference.gpu_decode): its pieces against the host's reading on any
machine (torchvision decodes on the CPU the same way), the whole run with a real detector on CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.inference import gpu_decode, predict
from ssd_lightning.inference.predict import collect_inputs, predict_images, preprocess
from tests.helpers import BrightBox

SHOWN_BOX = (300, 500, 900, 1100)  # ltrb of the white rectangle in the upright photo (1200 x 1600)
CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


def test_orient_turns_the_image_as_pil_exif_transpose_does():
    array = np.random.default_rng(0).integers(0, 255, (5, 7, 3), dtype=np.uint8)
    for orientation in range(1, 9):
        image, exif = Image.fromarray(array), Image.Exif()
        exif[0x0112] = orientation
        image.info["exif"] = exif.tobytes()
        want = np.asarray(ImageOps.exif_transpose(image))
        got = gpu_decode.orient(torch.from_numpy(array).permute(2, 0, 1), orientation).permute(1, 2, 0)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"orientation {orientation}")


def test_network_input_is_the_host_preprocessing_within_a_grey_level():
    rng = np.random.default_rng(0)
    for array in (
        rng.integers(0, 255, (1200, 1600, 3), dtype=np.uint8),
        rng.integers(0, 255, (200, 90, 3), dtype=np.uint8),
    ):
        image = Image.fromarray(array)
        got = gpu_decode.network_input(torch.from_numpy(array).permute(2, 0, 1))
        difference = (got - preprocess(image)).abs() * 0.225 * 255  # in grey levels
        assert (
            got.shape == (3, 300, 300) and difference.mean() < 0.5 and difference.max() < 2
        )  # measured: 0.27, 1.0


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """photo.jpg: 1600x1200 stored, EXIF orientation 6 (shown 1200x1600), a white rectangle at SHOWN_BOX on
    grey noise; flat.png: the upright photo as a PNG (read on the host); cut.jpg: a JPEG cut in half;
    notes.jpg: text."""
    folder = tmp_path_factory.mktemp("photos")
    shown = np.random.default_rng(1).integers(40, 90, (1600, 1200, 3), dtype=np.uint8)
    left, top, right, bottom = SHOWN_BOX
    shown[top:bottom, left:right] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(shown).transpose(Image.Transpose.ROTATE_90).save(
        folder / "photo.jpg", quality=95, exif=exif
    )
    Image.fromarray(shown).save(folder / "flat.png")
    data = (folder / "photo.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(data[: len(data) // 2])
    (folder / "notes.jpg").write_text("not an image")
    return folder


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_gpu_reading_orients_maps_back_falls_back_and_names_bad_files(photos, tmp_path, monkeypatch, device):
    """The GPU path (on the CPU: the same code with torchvision's CPU decoder) against the host's: boxes in
    the upright photo's pixels, a PNG read on the host, the broken files failures with the host's reason."""
    monkeypatch.setattr(predict, "_cuda_device_of", lambda detector: detector.device)
    decoded = []
    monkeypatch.setattr(gpu_decode, "decode_jpegs_on", _counting(gpu_decode.decode_jpegs_on, decoded))
    runs = {}
    for on_gpu in (True, False):
        detector = BrightBox(device)
        out = tmp_path / str(on_gpu)
        results, failures = predict_images(
            detector, collect_inputs(photos), out, picture_size=500, gpu_decode=on_gpu
        )
        assert {seen.type for seen in detector.seen} == {device if on_gpu else "cpu"}
        assert sorted((path.name, reason.split(":")[0]) for path, reason in failures) == [
            ("cut.jpg", "OSError"),
            ("notes.jpg", "UnidentifiedImageError"),
        ]
        lines = {
            r["file_name"]: r for r in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())
        }
        assert (lines["photo.jpg"]["height"], lines["photo.jpg"]["width"]) == (1600, 1200)
        for name in ("photo", "flat"):
            assert Image.open(out / f"{name}.jpg").size == (375, 500)  # longer side picture_size, upright
        runs[on_gpu] = {e["file_name"]: np.array(e["bbox"]) for e in results}
    assert decoded == [["cut.jpg", "photo.jpg"]]  # one batch; flat.png and notes.jpg read on the host
    for name in ("photo.jpg", "flat.png"):
        x, y, w, h = runs[True][name]
        np.testing.assert_allclose([x, y, x + w, y + h], SHOWN_BOX, atol=8)  # a network pixel is 4 x 5.3 here
        np.testing.assert_allclose(runs[True][name], runs[False][name], atol=6)


def _counting(function, calls: list):
    def counted(paths, *args, **kwargs):
        calls.append([Path(path).name for path in paths])
        return function(paths, *args, **kwargs)

    return counted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_predict_on_cuda_decodes_on_the_gpu_in_fp16_and_finds_what_the_host_path_finds(tmp_path):
    """A real SSD300 (MobileNetV2, random weights) on CUDA at predict.py's default precision: JPEGs decoded
    by nvJPEG give the detections the host's decoding gives (random weights: compared box by box)."""
    from ssd_lightning.data.shapes import make_detection_dataset
    from ssd_lightning.inference.detector import Detector, resolve_dtype
    from ssd_lightning.models import ssd300

    source = make_detection_dataset(tmp_path / "shapes", num_train=0, num_val=16, seed=0)
    big = tmp_path / "big"
    big.mkdir()
    for path in sorted((source / "val2017").glob("*.jpg")):
        photo = Image.open(path).convert("RGB")
        photo.resize((8 * photo.width, 8 * photo.height), Image.BILINEAR).save(big / path.name, quality=90)
    torch.manual_seed(0)
    net = ssd300(backbone="mobilenet_v2", num_classes=5, width_mult=0.5).eval().cuda()
    dtype = resolve_dtype("auto", "cuda")[0]
    assert dtype == "fp16"
    names = ["rectangle", "ellipse", "triangle", "star"]
    detector = Detector(categories=CategoryMap.from_names(names), net=net, source="random", dtype=dtype)
    found = {}
    for on_gpu in (True, False):
        out = tmp_path / f"out_{on_gpu}"
        results, failures = predict_images(detector, collect_inputs(big), out, gpu_decode=on_gpu)
        assert not failures and len(list(out.glob("*.jpg"))) == 16
        found[on_gpu] = results
    assert _matched(found[True], found[False]) >= 0.9


def _matched(got: list[dict], want: list[dict], iou: float = 0.9) -> float:
    """The share of ``got``'s detections with one of ``want`` (same image and class) at IoU >= ``iou``."""
    from torchvision.ops import box_convert, box_iou

    hits = 0
    for entry in got:
        key = (entry["image_id"], entry["category_id"])
        others = [e["bbox"] for e in want if (e["image_id"], e["category_id"]) == key]
        if others:
            boxes = box_convert(torch.tensor([entry["bbox"], *others]), "xywh", "xyxy")
            hits += bool(box_iou(boxes[:1], boxes[1:]).max() >= iou)
    return hits / max(len(got), 1)
