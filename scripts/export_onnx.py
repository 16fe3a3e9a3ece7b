"""Export a trained SSD300 to ONNX: the network alone, or with decoding and NMS in the graph.

    python scripts/export_onnx.py ckpt_path=outputs/demo/<run>/checkpoints/last.ckpt output=model.onnx
    python scripts/export_onnx.py nvidia_checkpoint=nvidia_ssdpyt_amp.pt output=ssd300_coco.onnx
    python scripts/export_onnx.py ckpt_path=<run>/checkpoints/last.ckpt end_to_end=true output=e2e.onnx

Arguments are ``key=value`` (OmegaConf): ``ckpt_path`` or ``nvidia_checkpoint`` (+ ``backbone``,
``num_classes``), ``trust_checkpoint`` (false: the file is read with ``torch.load(weights_only=True)``;
true unpickles it fully, which can run code from it), ``run_config`` (default
``<run>/.hydra/config.yaml``), ``output``, ``opset`` (17), ``check`` (true: run the file with onnxruntime
at batch 2 and print the largest difference to PyTorch), ``end_to_end`` (false), ``decoder.<key>``
(end-to-end only: overrides of the checkpoint's decoder settings ``score_thresh``, ``nms_iou``,
``topk_per_class``, ``max_detections``).

The ONNX graph: input ``images`` (N, 3, 300, 300) float32, preprocessed as in
``ssd_lightning.inference.predict.preprocess`` (RGB, resized to 300×300, ImageNet mean/std); outputs
``locs`` (N, 4, 8732) box offsets and ``logits`` (N, C, 8732) class logits, the reference layout. N is
dynamic. By default decoding (softmax, score threshold, per-class NMS, top-k) is not in the graph (any
runtime runs it, no NonMaxSuppression operator needed); decode the outputs with the same code as training::

    from ssd_lightning.models import BoxCoder, dboxes300_coco
    locs, logits = session.run(["locs", "logits"], {"images": batch})
    detections = BoxCoder(dboxes300_coco()).decode(torch.from_numpy(locs), torch.from_numpy(logits))
    # per image: boxes (k, 4) ltrb in [0, 1] (multiply by width, height, width, height), scores, labels

With ``end_to_end=true`` the graph is
:class:`ssd_lightning.inference.export.EndToEndSSD`: decoding, score threshold,
per-class top-k and NMS included (ONNX ``NonMaxSuppression``), the same detections as ``BoxCoder.decode``.
Outputs ``boxes`` (N, K, 4) ltrb in [0, 1] (clipped), ``scores`` (N, K), ``labels`` (N, K) int64 in 1..C-1,
``num_detections`` (N,) int64, K = ``max_detections``; rows past ``num_detections`` are zeros (label 0).
Class names, category ids and the decoder settings are stored in the file's metadata, so
``python predict.py onnx=e2e.onnx input=...`` runs it. The check compares the detections with
``BoxCoder.decode`` on the same batch.

Uses the TorchScript-based exporter (``dynamo=False``): the dynamo exporter needs ``onnxscript``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

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
}


def export_onnx(net: nn.Module, output: str | Path, *, opset: int = 17) -> Path:
    """Write ``net`` (images (N, 3, 300, 300) -> locs, logits) to ``output`` with a dynamic batch size."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    net = net.eval().float().cpu()
    example = torch.zeros(2, 3, 300, 300)
    dynamic = {"images": {0: "batch"}, "locs": {0: "batch"}, "logits": {0: "batch"}}
    with torch.no_grad(), warnings.catch_warnings():
        # "legacy TorchScript-based exporter": chosen on purpose (the dynamo exporter needs onnxscript)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net,
            (example,),
            str(output),
            input_names=["images"],
            output_names=["locs", "logits"],
            dynamic_axes=dynamic,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    import onnx

    onnx.checker.check_model(str(output))
    return output


def max_difference(net: nn.Module, onnx_file: str | Path, batch_size: int = 2, seed: int = 0) -> float:
    """Largest |PyTorch - onnxruntime (CPU)| over both outputs on a random batch."""
    import onnxruntime as ort

    images = torch.randn(batch_size, 3, 300, 300, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = net.eval()(images)
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    got = session.run(["locs", "logits"], {"images": images.numpy()})
    return max(float((torch.from_numpy(g) - e).abs().max()) for g, e in zip(got, expected, strict=True))


def main(argv: list[str] | None = None) -> int:
    if any(a in ("-h", "--help") for a in argv or []):
        print(__doc__)
        print(f"keys (key=value) and defaults: {DEFAULTS}")
        return 0
    from ssd_lightning.inference.predict import DEFAULT_DECODER, load_detector

    unknown = [a for a in (argv or []) if a.split("=", 1)[0].lstrip("+").split(".")[0] not in DEFAULTS]
    if unknown:
        print(f"unknown argument(s) {unknown}; accepted keys: {sorted(DEFAULTS)}", file=sys.stderr)
        return 2
    cfg = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv or []))
    if cfg.decoder and not cfg.end_to_end:
        print("decoder.* settings are part of end_to_end=true exports only", file=sys.stderr)
        return 2
    unknown = sorted(set(cfg.decoder) - set(DEFAULT_DECODER))
    if unknown:
        print(f"unknown decoder key(s) {unknown}; accepted: {sorted(DEFAULT_DECODER)}", file=sys.stderr)
        return 2
    detector = load_detector(
        cfg.ckpt_path,
        nvidia_checkpoint=cfg.nvidia_checkpoint,
        run_config=cfg.run_config,
        backbone=cfg.backbone,
        num_classes=cfg.num_classes,
        trust_checkpoint=cfg.trust_checkpoint,
        decoder=OmegaConf.to_container(cfg.decoder),
    )
    if cfg.end_to_end:
        return _export_end_to_end(detector, cfg)
    path = export_onnx(detector.net, cfg.output, opset=cfg.opset)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): images (N, 3, 300, 300) -> locs, logits")
    print("classes:", ", ".join(detector.class_names[1:]))
    if cfg.check:
        print(f"onnxruntime vs PyTorch, batch 2: max |diff| = {max_difference(detector.net, path):.2e}")
    return 0


def _export_end_to_end(detector, cfg) -> int:
    from ssd_lightning.inference.export import EndToEndSSD, compare_with_decoder, export_end_to_end

    model = EndToEndSSD(detector.net, detector.box_coder, **detector.decoder)
    metadata = {"class_names": list(detector.class_names), "category_ids": list(detector.category_ids)}
    path = export_end_to_end(
        model, cfg.output, image_size=detector.image_size, metadata=metadata, opset=cfg.opset
    )
    print(
        f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): images (N, 3, 300, 300) -> boxes, scores, "
        f"labels, num_detections; decoder {model.decoder_settings}"
    )
    print("classes:", ", ".join(detector.class_names[1:]))
    if cfg.check:
        diff = compare_with_decoder(model, path)
        if diff == float("inf"):
            print("onnxruntime and BoxCoder.decode found different detections on a random batch",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(f"onnxruntime vs BoxCoder.decode, batch 2: same detections, max |diff| = {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
