"""scripts/export_onnx.py quantize=int8: QDQ around the network's convolutions only, the metadata kept,
predict.py runs the file and finds what the fp32 export finds; bad calibration sources fail in one line.

The checkpoint is test_predict.py's ``fake_run`` (random ResNet-18 weights): against the shapes' true boxes
its AP is 0 for every export, fp32 or not, so the reference annotation file holds what the fp32 export
itself finds (its 3 best detections per image). Measured on the 13 val images of ``shapes_coco``: AP@0.5
fp32 0.50, int8 0.47; int8 calibrated on blank images 0.09, on images without the ImageNet
normalisation 0.01. The tolerance (0.15) passes the first and fails both mistakes by a wide margin.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ssd_lightning.inference.onnx_format import END_TO_END_OUTPUTS, read_metadata
from ssd_lightning.inference.predict import preprocess
from ssd_lightning.inference.quantize import quantize_onnx
from tests.helpers import REPO_ROOT, run_script
from tests.test_predict import fake_run  # noqa: F401  (the shared fixture: a run with a checkpoint)

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

EXPORT_PY = REPO_ROOT / "scripts" / "export_onnx.py"
PREDICT_PY = REPO_ROOT / "predict.py"
AP_TOLERANCE = 0.15  # |AP@0.5 int8 - AP@0.5 fp32| (measured 0.03; blank calibration: 0.41)
DECODE_OPS = ("Softmax", "Exp", "TopK", "NonMaxSuppression", "ScatterND")


def _script_main():
    spec = importlib.util.spec_from_file_location("export_onnx_script", EXPORT_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def exports(fake_run, shapes_coco, tmp_path_factory):  # noqa: F811
    """The run's end-to-end export in fp32 and in int8 (calibrated on the shapes val images), by the CLI."""
    run, _ = fake_run
    out = tmp_path_factory.mktemp("int8")
    ckpt = f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    fp32 = run_script(EXPORT_PY, ckpt, "end_to_end=true", "check=false", f"output={out / 'fp32.onnx'}")
    assert fp32.returncode == 0, fp32.stderr
    int8 = run_script(
        EXPORT_PY, ckpt, "end_to_end=true", "quantize=int8", f"calibration={shapes_coco / 'val2017'}",
        f"output={out / 'int8.onnx'}",
    )  # fmt: skip
    assert int8.returncode == 0, int8.stderr
    return out / "fp32.onnx", out / "int8.onnx", int8.stdout


def _descendants(graph, op_types: tuple[str, ...]) -> set[str]:
    """Names of the nodes downstream of any node of ``op_types`` (those included)."""
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    stack = [n for n in graph.node if n.op_type in op_types]
    seen: set[str] = set()
    while stack:
        node = stack.pop()
        if node.name not in seen:
            seen.add(node.name)
            stack.extend(c for out in node.output for c in consumers.get(out, []))
    return seen


def test_qdq_around_every_conv_and_none_in_the_decoding(exports):
    fp32_file, int8_file, stdout = exports
    fp32, int8 = onnx.load(str(fp32_file)), onnx.load(str(int8_file))
    producer = {out: node for node in int8.graph.node for out in node.output}
    convs = [n for n in int8.graph.node if n.op_type == "Conv"]
    assert len(convs) == sum(n.op_type == "Conv" for n in fp32.graph.node) > 20
    for conv in convs:  # activations and weights both come through DequantizeLinear
        assert [producer[name].op_type for name in conv.input[:2]] == ["DequantizeLinear"] * 2, conv.name
    decoding = _descendants(int8.graph, DECODE_OPS)
    quantizing = [n.name for n in int8.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert len(quantizing) > 2 * len(convs)
    assert not decoding.intersection(quantizing)
    for op in DECODE_OPS:  # the decoding is left as it was
        assert sum(n.op_type == op for n in int8.graph.node) == sum(n.op_type == op for n in fp32.graph.node)
    assert fp32_file.stat().st_size > 3 * int8_file.stat().st_size
    assert "images with PyTorch's top result" in stdout  # the int8 check ran and says what it measured

    session = ort.InferenceSession(str(int8_file), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == list(END_TO_END_OUTPUTS)
    boxes, scores, labels, counts = session.run(None, {"images": np.zeros((2, 3, 300, 300), np.float32)})
    assert boxes.shape == (2, 30, 4) and scores.shape == labels.shape == (2, 30) and counts.shape == (2,)
    # onnxruntime runs the convolutions as integer kernels: QDQ pairs fused into QLinearConv
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(int8_file.with_suffix(".optimized.onnx"))
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(str(int8_file), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    assert sum(n.op_type == "QLinearConv" for n in optimized.graph.node) == len(convs)


def test_metadata_is_the_fp32_exports(exports):
    fp32_file, int8_file, _ = exports
    meta = [
        read_metadata({p.key: p.value for p in onnx.load(str(f)).metadata_props})
        for f in (fp32_file, int8_file)
    ]
    assert meta[0] == meta[1] and meta[1]["kind"] == "detector" and len(meta[1]["class_names"]) == 5
    assert set(meta[1]["decoder"]) == {"score_thresh", "nms_iou", "topk_per_class", "max_detections"}
    assert sorted(p.name for p in int8_file.parent.iterdir() if p.name.startswith(".")) == []  # no leftovers


def _ap50(onnx_file: Path, images: Path, annotations: Path, output: Path) -> float:
    result = run_script(
        PREDICT_PY, f"onnx={onnx_file}", f"input={images}", f"annotations={annotations}", f"output={output}",
        "draw=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads((output / "coco_eval.json").read_text())["stats"]["mAP_50"]


def test_predict_runs_int8_with_the_ap_of_fp32_and_blank_calibration_would_not(
    exports, shapes_coco, tmp_path
):
    fp32_file, int8_file, _ = exports
    val = shapes_coco / "val2017"
    real = json.loads((shapes_coco / "annotations" / "instances_val2017.json").read_text())
    # what the fp32 export finds on the val images (predict.py without annotations) ...
    found = run_script(PREDICT_PY, f"onnx={fp32_file}", f"input={val}", f"output={tmp_path / 'found'}",
                       "draw=false")  # fmt: skip
    assert found.returncode == 0, found.stderr
    detections = json.loads((tmp_path / "found" / "predictions.json").read_text())
    annotations = []
    for image in real["images"]:
        mine = (d for d in detections if d["file_name"] == image["file_name"])  # ids there: input order
        best = sorted(mine, key=lambda d: -d["score"])[:3]
        annotations += [
            {"id": len(annotations) + i + 1, "image_id": image["id"], "category_id": d["category_id"],
             "bbox": d["bbox"], "area": d["bbox"][2] * d["bbox"][3], "iscrowd": 0}
            for i, d in enumerate(best)
        ]  # fmt: skip
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({**real, "annotations": annotations}))
    # ... is the annotation file both are scored against
    ap_fp32 = _ap50(fp32_file, val, reference, tmp_path / "fp32")
    ap_int8 = _ap50(int8_file, val, reference, tmp_path / "int8")
    assert ap_fp32 > 0.3, ap_fp32
    assert abs(ap_int8 - ap_fp32) <= AP_TOLERANCE, (ap_fp32, ap_int8)
    # the same quantization calibrated on blank images: the tolerance tells it apart
    blank = quantize_onnx(fp32_file, tmp_path / "blank.onnx", [preprocess(Image.new("RGB", (300, 300)))] * 4)
    ap_blank = _ap50(blank, val, reference, tmp_path / "blank")
    assert ap_blank < ap_fp32 - AP_TOLERANCE, (ap_fp32, ap_blank)


def test_bad_calibration_sources_fail_in_one_line(fake_run, tmp_path, capsys):  # noqa: F811
    run, _ = fake_run
    main = _script_main()
    ckpt = f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"
    output = tmp_path / "out" / "int8.onnx"

    assert main([ckpt, "quantize=int8", f"output={output}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "quantize=int8 needs calibration=" in err, err
    assert main([ckpt, "quantize=int4", "calibration=x"]) == 2
    assert "only quantize=int8" in capsys.readouterr().err
    assert main([ckpt, "quantize=int8", "calibration=x", "calibration_images=0"]) == 2
    assert "calibration_images=0" in capsys.readouterr().err

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG")
    (broken / "b.png").write_bytes(b"")
    missing = tmp_path / "nowhere"
    for source, says in [(broken, "none of its 2 image file(s) could be read"), (missing, "no image files")]:
        with pytest.raises(SystemExit) as exit_info:
            main([ckpt, "quantize=int8", f"calibration={source}", f"output={output}"])
        assert exit_info.value.code == 1
        lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("(traceback")]
        assert len(lines) == 1 and lines[0].startswith(f"Error: calibration={source}") and says in lines[0]
        assert not output.exists() and not list(output.parent.glob("*"))  # nothing half-written left
