"""Export a trained model to ONNX: an SSD300's network alone or with decoding and NMS in the graph, or a
classifier (its class names and input transform in the metadata).

    python scripts/export_onnx.py ckpt_path=outputs/demo/<run>/checkpoints/last.ckpt output=model.onnx
    python scripts/export_onnx.py nvidia_checkpoint=nvidia_ssdpyt_amp.pt output=ssd300_coco.onnx
    python scripts/export_onnx.py ckpt_path=<run>/checkpoints/last.ckpt end_to_end=true output=e2e.onnx
    python scripts/export_onnx.py ckpt_path=<MobileNetV2 run>/checkpoints/last.ckpt output=classifier.onnx

Arguments are ``key=value``: ``ckpt_path`` or ``nvidia_checkpoint`` (+ ``backbone``, ``num_classes``),
``trust_checkpoint`` (false: read with ``torch.load(weights_only=True)``; true unpickles fully, which can run
code from the file), ``run_config`` (only for checkpoints written before they recorded their model: default
``<run>/.hydra/config.yaml``), ``output``, ``opset`` (17),
``check`` (true: run the file with onnxruntime at batch 2 and print the largest difference to PyTorch),
``quantize`` (null | int8), ``calibration`` and ``calibration_images`` (100; see INT8 below),
``end_to_end`` (false), ``decoder.<key>`` (end-to-end only: ``score_thresh``, ``nms_iou``,
``topk_per_class``, ``max_detections`` overriding the checkpoint's).

Network only: input ``images`` (N, 3, 300, 300) float32 (``ssd_lightning.inference.predict.preprocess``),
outputs ``locs`` (N, 4, 8732) and ``logits`` (N, C, 8732); decode them with
``BoxCoder(dboxes300_coco()).decode(locs, logits)``. End to end: outputs ``boxes`` (N, K, 4) ltrb in [0, 1],
``scores`` (N, K), ``labels`` (N, K), ``num_detections`` (N,), K = ``max_detections``, class names and
decoder settings in the metadata; ``python predict.py onnx=e2e.onnx input=...`` runs it.
A classifier checkpoint (the file says which it is): input ``images`` (N, 3, S, S), output ``logits`` (N, K);
``python predict.py onnx=classifier.onnx input=...`` runs it. Code: :mod:`ssd_lightning.inference.export`.

INT8 for CPUs: ``quantize=int8`` with ``calibration=`` (a folder of images, a glob in quotes or @list.txt, as
predict.py's ``input=``; the first ``calibration_images`` (100) readable ones, read and preprocessed as
predict.py does) writes a statically quantized file instead (onnxruntime QDQ: the network's convolutions
int8 with per-channel weights, decoding and NMS fp32; same inputs, outputs and metadata), e.g.

    python scripts/export_onnx.py ckpt_path=<run>/checkpoints/last.ckpt end_to_end=true quantize=int8 \
        calibration=data/shapes/val2017 output=model_int8.onnx

Its check compares the top result of each of the first 8 calibration images with PyTorch's (int8 is not
expected to match to fp32 tolerances). Code: :mod:`ssd_lightning.inference.quantize`.
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

DEFAULTS = {
    "ckpt_path": None,
    "nvidia_checkpoint": None,
    "backbone": "resnet50",
    "num_classes": 81,
    "trust_checkpoint": False,
    "run_config": None,
    "output": "model.onnx",
    "opset": 17,
    "check": True,
    "end_to_end": False,
    "decoder": {},
    "quantize": None,
    "calibration": None,
    "calibration_images": 100,
}
CHECKED_INT8_IMAGES = 8  # calibration images the int8 check compares with PyTorch


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(f"keys (key=value) and defaults: {DEFAULTS}")
        return 0
    unknown = [a for a in argv if a.split("=", 1)[0].lstrip("+").split(".")[0] not in DEFAULTS]
    if unknown:
        print(f"unknown argument(s) {unknown}; accepted keys: {sorted(DEFAULTS)}", file=sys.stderr)
        return 2
    cfg = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv))
    if cfg.decoder and not cfg.end_to_end:
        print("decoder.* settings are part of end_to_end=true exports only", file=sys.stderr)
        return 2
    from ssd_lightning.errors import user_errors_as_messages
    from ssd_lightning.models import DecoderSettings

    unknown = sorted(set(cfg.decoder) - set(DecoderSettings()))
    if unknown:
        print(f"unknown decoder key(s) {unknown}; accepted: {sorted(DecoderSettings())}", file=sys.stderr)
        return 2
    problem = _quantize_problem(cfg)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    with user_errors_as_messages():
        return _export(cfg)


def _quantize_problem(cfg) -> str | None:
    """What is wrong with the ``quantize``/``calibration`` keys (one line), or None."""
    if cfg.quantize not in (None, "int8"):
        return f"quantize={cfg.quantize}: only quantize=int8 (or leave it out for fp32) is supported"
    if cfg.quantize is None:
        if cfg.calibration is not None:
            return "calibration= is used with quantize=int8 only; add quantize=int8 or leave calibration out"
        return None
    if cfg.calibration is None:
        return (
            "quantize=int8 needs calibration=<images>: a folder of images like those the model will see "
            "(e.g. calibration=data/shapes/val2017), a glob in quotes or @list.txt"
        )
    if not isinstance(cfg.calibration_images, int) or cfg.calibration_images < 1:
        return f"calibration_images={cfg.calibration_images}: give how many images to calibrate on (>= 1)"
    return None


def _export(cfg) -> int:
    if cfg.quantize == "int8":
        return _export_int8(cfg)
    from ssd_lightning.inference.classifier import Classifier
    from ssd_lightning.inference.export import (
        compare_with_decoder,
        export_classifier,
        export_detector,
        network_difference,
    )
    from ssd_lightning.inference.loading import load_model_from_settings

    model = load_model_from_settings(OmegaConf.to_container(cfg, resolve=True))
    if isinstance(model, Classifier):
        path = export_classifier(model, cfg.output, opset=cfg.opset)
        side = model.image_size
        print(
            f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): images (N, 3, {side}, {side}) -> logits"
        )
        print("classes:", ", ".join(model.class_names))
        if cfg.check:
            diff = network_difference(model.net, path, image_size=side)
            print(f"onnxruntime vs PyTorch, batch 2: max |diff| = {diff:.2e}")
        return 0
    path, exported = export_detector(model, cfg.output, end_to_end=cfg.end_to_end, opset=cfg.opset)
    size = f"{path.stat().st_size / 2**20:.1f} MiB"
    if not cfg.end_to_end:
        print(f"wrote {path} ({size}): images (N, 3, 300, 300) -> locs, logits")
    else:
        print(
            f"wrote {path} ({size}): images (N, 3, 300, 300) -> boxes, scores, labels, num_detections; "
            f"decoder {dict(exported.decoder_settings)}"
        )
    print("classes:", ", ".join(model.class_names[1:]))
    if not cfg.check:
        return 0
    if not cfg.end_to_end:
        print(f"onnxruntime vs PyTorch, batch 2: max |diff| = {network_difference(exported, path):.2e}")
        return 0
    diff = compare_with_decoder(exported, path)
    if diff == float("inf"):
        print("onnxruntime and BoxCoder.decode found different detections on a random batch", file=sys.stderr)
        return 1
    print(f"onnxruntime vs BoxCoder.decode, batch 2: same detections, max |diff| = {diff:.2e}")
    return 0


def _export_int8(cfg) -> int:
    """Calibration images read first (a bad source fails before the export), the fp32 export written to a
    temporary folder beside ``output``, quantized into ``output``."""
    import tempfile
    from pathlib import Path

    from ssd_lightning.inference.classifier import Classifier
    from ssd_lightning.inference.export import export_classifier, export_detector
    from ssd_lightning.inference.loading import load_model_from_settings
    from ssd_lightning.inference.quantize import (
        calibration_tensors,
        compare_int8,
        image_transform,
        quantize_onnx,
    )

    model = load_model_from_settings(OmegaConf.to_container(cfg, resolve=True))
    transform, min_side = image_transform(model)
    images, used = calibration_tensors(
        str(cfg.calibration), cfg.calibration_images, transform, min_side=min_side
    )
    output = Path(cfg.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export.", dir=output.parent) as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        if isinstance(model, Classifier):
            export_classifier(model, fp32, opset=cfg.opset)
            net, what = model.net, f"images (N, 3, {model.image_size}, {model.image_size}) -> logits"
        else:
            _, net = export_detector(model, fp32, end_to_end=cfg.end_to_end, opset=cfg.opset)
            net = getattr(net, "net", net)  # the network inside an EndToEndSSD
            what = "images (N, 3, 300, 300) -> " + (
                "boxes, scores, labels, num_detections" if cfg.end_to_end else "locs, logits"
            )
        fp32_size = fp32.stat().st_size
        path = quantize_onnx(fp32, output, images)
    print(
        f"wrote {path} (int8, {path.stat().st_size / 2**20:.1f} MiB, fp32 {fp32_size / 2**20:.1f} MiB): "
        f"{what}; calibrated on {len(used)} image(s) of {cfg.calibration}"
    )
    names = model.class_names if isinstance(model, Classifier) else model.class_names[1:]
    print("classes:", ", ".join(names))
    if cfg.check:
        checked = images[:CHECKED_INT8_IMAGES]
        measured = compare_int8(model, net, path, checked)
        print(f"int8 onnxruntime vs PyTorch fp32, {len(checked)} calibration image(s): {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
