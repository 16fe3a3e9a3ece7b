"""Images/s of the end-to-end ONNX export in onnxruntime vs the same model in PyTorch, CPU, side by side.

    python benchmarks/benchmark_onnx.py --backbone resnet50 --batch-sizes 1 8 --threads 2

Three ways to get detections from the same weights and the same input batch:

* ``PyTorch``: ``net(images)`` + ``BoxCoder.decode`` (fp32, ``torch.inference_mode``);
* ``onnxruntime, network only``: the network-only export (``scripts/export_onnx.py``) + ``BoxCoder.decode``;
* ``onnxruntime, end-to-end``: the ``end_to_end=true`` graph (decoding and NMS inside);
* ``onnxruntime int8, end-to-end``: that graph quantized (``quantize=int8``:
  :func:`ssd_lightning.inference.quantize.quantize_onnx`), calibrated on ``--calibration`` (the first
  ``--calibration-images`` images, read as predict.py reads them) or, without it, on N(0, 1) images like the
  timed ones. Its ``vs ort fp32`` column is its speed over the fp32 end-to-end graph, same run.

With ``--annotations`` (a COCO file of the images in ``--images``) and a checkpoint, both end-to-end files
are exported with the checkpoint's metadata and scored by ``predict.py ... annotations=``: AP@0.5 of fp32
and int8 is printed under the table.

Weights are random (``ssd300(backbone=..., num_classes=...)``, seed 0, BatchNorm statistics measured on
8 random images) unless ``--ckpt-path`` or ``--nvidia-checkpoint`` names a checkpoint; inputs are N(0, 1)
images (the detections per image are printed:
the decoder's work depends on them). Every repeat runs each way once, in rotated order; the table gives
the median time per batch as images/s, the ratio to PyTorch, and in how many images the detections equal
PyTorch's (same labels, boxes and scores within 1e-4). onnxruntime's convolutions round differently from
PyTorch's (logits differ by ~1e-5), which can swap detections whose scores are that close at a cut
(score threshold, top-k, ``max_detections``); the network-only row shows how often that happens without
the graph's decoding. Both runtimes use ``--threads`` threads; onnxruntime's threads do not spin-wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ssd_lightning.inference.export import (
    EndToEndSSD,
    detection_difference,
    export_detector,
    export_end_to_end,
    export_network,
)
from ssd_lightning.inference.predict import preprocess
from ssd_lightning.inference.quantize import calibration_tensors, quantize_onnx
from ssd_lightning.models import BoxCoder, dboxes300_coco, ssd300
from ssd_lightning.tables import markdown_row, markdown_rule

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_net(args: argparse.Namespace) -> tuple[torch.nn.Module, dict, object]:
    """The network, its decoder settings and the Detector it came from (None: random weights)."""
    if args.ckpt_path or args.nvidia_checkpoint:
        from ssd_lightning.inference.detector import load_detector

        detector = load_detector(
            args.ckpt_path,
            nvidia_checkpoint=args.nvidia_checkpoint,
            backbone=args.backbone,
            num_classes=args.num_classes,
        )
        return detector.net, dict(detector.settings), detector
    torch.manual_seed(0)
    net = ssd300(backbone=args.backbone, num_classes=args.num_classes, weights_backbone=None)
    _set_batchnorm_statistics(net, torch.randn(8, 3, 300, 300))
    return net.eval(), {}, None


def _ap50(onnx_file: Path, images: str, annotations: str, output: Path) -> float:
    """AP@0.5 of ``onnx_file`` on ``images`` as ``predict.py ... annotations=`` scores it."""
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "predict.py"), f"onnx={onnx_file}", f"input={images}",
         f"annotations={annotations}", f"output={output}", "draw=false", "device=cpu"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads((output / "coco_eval.json").read_text())["stats"]["mAP_50"]


@torch.no_grad()
def _set_batchnorm_statistics(net: torch.nn.Module, images: torch.Tensor) -> None:
    """BatchNorm running statistics = those of ``images``: an untrained net keeps mean 0 / var 1, its
    activations grow layer after layer and every softmax score rounds to exactly 1.0 (thousands of ties,
    nothing like a trained net). With measured statistics the logits stay in a trained net's range."""
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None  # cumulative average over the batches seen
    net.train()
    net(images)
    net.eval()


def _session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # no busy-waiting after a run: the spinning threads would steal the 2 cores from the next way timed
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _as_arrays(detections: list[dict]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [(d["boxes"].clamp(0, 1).numpy(), d["scores"].numpy(), d["labels"].numpy()) for d in detections]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--num-classes", type=int, default=81, help="including background")
    parser.add_argument("--ckpt-path", default=None, help="a Lightning checkpoint inside its run directory")
    parser.add_argument("--nvidia-checkpoint", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each way (median kept)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="print every timing (ms)")
    parser.add_argument("--calibration", default=None, help="int8 calibration images (as predict's input=)")
    parser.add_argument("--calibration-images", type=int, default=100)
    parser.add_argument("--annotations", default=None, help="COCO file of --images: AP@0.5 of fp32 and int8")
    parser.add_argument("--images", default=None, help="the annotated images (default: --calibration)")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--batch-sizes, --repeats and --threads must be >= 1")
    args.images = args.images or args.calibration
    if args.annotations and not (args.images and (args.ckpt_path or args.nvidia_checkpoint)):
        parser.error("--annotations needs --images (or --calibration) and a checkpoint")
    torch.set_num_threads(args.threads)

    net, decoder, detector = _load_net(args)
    coder = BoxCoder(dboxes300_coco())
    model = EndToEndSSD(net, coder, **decoder)
    settings = model.decoder_settings
    if args.calibration:
        calibration, _ = calibration_tensors(
            args.calibration, args.calibration_images, preprocess, min_side=600
        )
    else:
        generator = torch.Generator().manual_seed(0)
        calibration = list(torch.randn(min(args.calibration_images, 16), 3, 300, 300, generator=generator))
    aps: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tmp = Path(tmp)
        network_only = _session(export_network(net, tmp / "net.onnx"), args.threads)
        if detector is not None:  # with the checkpoint's class names: predict.py runs it
            e2e_file, _ = export_detector(detector, tmp / "e2e.onnx", end_to_end=True)
        else:
            e2e_file = export_end_to_end(model, tmp / "e2e.onnx")
        end_to_end = _session(e2e_file, args.threads)
        int8_file = quantize_onnx(e2e_file, tmp / "e2e_int8.onnx", calibration)
        end_to_end_int8 = _session(int8_file, args.threads)
        if args.annotations:
            for name, path in (("fp32", e2e_file), ("int8", int8_file)):
                aps[name] = _ap50(path, args.images, args.annotations, tmp / f"predict_{name}")

    def pytorch(images: torch.Tensor):
        with torch.inference_mode():
            return _as_arrays(coder.decode(*net(images), **settings))

    def ort_network_only(images: torch.Tensor):
        locs, logits = network_only.run(["locs", "logits"], {"images": images.numpy()})
        return _as_arrays(coder.decode(torch.from_numpy(locs), torch.from_numpy(logits), **settings))

    def ort_end_to_end(images: torch.Tensor, session=end_to_end):
        boxes, scores, labels, counts = session.run(None, {"images": images.numpy()})
        return [(boxes[i, :n], scores[i, :n], labels[i, :n]) for i, n in enumerate(counts)]

    ways: dict[str, Callable] = {
        "PyTorch (net + BoxCoder.decode)": pytorch,
        "onnxruntime, network only + BoxCoder.decode": ort_network_only,
        "onnxruntime, end-to-end graph": ort_end_to_end,
        "onnxruntime int8, end-to-end graph": lambda images: ort_end_to_end(images, end_to_end_int8),
    }
    int8_way, fp32_way = "onnxruntime int8, end-to-end graph", "onnxruntime, end-to-end graph"
    print(
        f"SSD300-{args.backbone}, {args.num_classes} classes, CPU fp32, {args.threads} threads, "
        f"decoder {settings}, {'checkpoint' if decoder else 'random'} weights, N(0, 1) images; "
        f"median of {args.repeats} runs; int8 calibrated on {len(calibration)} "
        f"{'images of ' + args.calibration if args.calibration else 'N(0, 1) images'}"
    )
    columns = ["batch", "way", "detections / image", "ms / batch", "images/s", "vs PyTorch"]
    columns += ["vs ort fp32", "images as PyTorch"]
    print(markdown_row(columns) + "\n" + markdown_rule("rlrrrrrl"), flush=True)  # rows follow as measured
    for batch_size in args.batch_sizes:
        images = torch.randn(batch_size, 3, 300, 300, generator=torch.Generator().manual_seed(batch_size))
        reference = pytorch(images)
        names = list(ways)
        times: dict[str, list[float]] = {name: [] for name in names}
        outputs = {}
        for repeat in range(args.warmup + args.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:  # rotated order: no way always runs first
                start = time.perf_counter()
                outputs[name] = ways[name](images)
                if repeat >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        if args.verbose:
            print({name: [round(t * 1e3) for t in ts] for name, ts in times.items()})
        base = statistics.median(times[names[0]])
        for name in names:
            median = statistics.median(times[name])
            same = sum(
                detection_difference(*a, *b) <= 1e-4 for a, b in zip(outputs[name], reference, strict=True)
            )
            dets = sum(len(d[1]) for d in outputs[name]) / batch_size
            cells = [batch_size, name, f"{dets:.0f}", f"{median * 1e3:.0f}", f"{batch_size / median:.2f}"]
            versus = f"{statistics.median(times[fp32_way]) / median:.2f}x" if name == int8_way else ""
            row = [*cells, f"{base / median:.2f}x", versus, f"{same}/{batch_size}"]
            print(markdown_row(row), flush=True)
    if aps:
        print(
            f"AP@0.5 on {args.images} ({args.annotations}), predict.py: onnxruntime fp32 end-to-end "
            f"{aps['fp32']:.4f}, int8 {aps['int8']:.4f} (difference {aps['int8'] - aps['fp32']:+.4f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
