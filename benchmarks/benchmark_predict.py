"""Images/s and peak RSS of ``predict.py`` against the bare network, on small images and on 12-MP JPEGs.

    python benchmarks/benchmark_predict.py                  # the demo's network, random weights
    python benchmarks/benchmark_predict.py --ckpt outputs/demo/<run>/checkpoints/last.ckpt   # + mAP per row
    python benchmarks/benchmark_predict.py --device cuda     # on a GPU: JPEGs decoded there (nvJPEG)

Images (generated in ``--workdir``, default a temporary folder): ``--small`` validation images of a shapes
dataset (160-480 px, as the demo's) and ``--large`` of them enlarged to 4000x3000 (bilinear, then per-pixel
noise, JPEG quality 90: ~3 MB each, a camera photo's size and decoding cost), their annotations scaled.
Every row runs in a fresh process, so its peak RSS (``VmHWM``) is its own:

* ``network``: ``Detector.detect`` (forward + decode) on the preprocessed batches, already in memory, at the
  chosen precision (``--dtype auto``: predict.py's rule); the second of two passes;
* ``predict draw=false`` / ``predict draw=true``: ``predict_images`` with predict.py's defaults (workers,
  batch size, fast decoding, picture size), from the files to ``predictions.json`` (and the pictures);
* ``predict exact decode``: the same with ``fast_decode=false`` (every pixel decoded), ``draw=false``;
* ``predict host decode``: ``gpu_decode=false``, ``draw=false``: with ``--device cuda``, JPEGs read on the
  host as on a CPU (elsewhere the same as ``predict draw=false``);
* ``predict ONNX``: the end-to-end export of the same weights in onnxruntime, ``draw=false`` (when
  onnxruntime is installed).

Without ``--ckpt`` the network is the demo's (SSD300, MobileNetV2 0.5, 5 classes) with random weights: fine
for speed, but the decoder's work follows the number of detections, which a trained model has fewer of.
With ``--ckpt`` each predict row also gives its mAP on the images' annotations. The same command against an
earlier checkout (``--before <checkout>``, e.g. ``git worktree add /tmp/before <commit>``) adds its predict
rows, run in the same way (``PYTHONPATH=<checkout>``; settings it lacks are left out).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ssd_lightning.tables import markdown_table

LARGE_SIZE = (4000, 3000)
ROWS = {  # name -> predict_images settings (None: the bare network)
    "network": None,
    "predict draw=false": {"draw": False},
    "predict draw=true": {"draw": True},
    "predict exact decode": {"draw": False, "fast_decode": False},
    "predict host decode": {"draw": False, "gpu_decode": False},
    "predict ONNX": {"draw": False},
    # the network's outputs for the first batch returned for every batch: predict.py's own work per image,
    # what a fast (GPU) network waits on
    "predict replayed network": {"draw": False},
}


def _accepted(function, settings: dict) -> dict:
    """The ``settings`` that ``function`` takes (an older checkout lacks some)."""
    names = inspect.signature(function).parameters
    return {key: value for key, value in settings.items() if key in names}


# ------------------------------------------------------------------------------------------ images
def _make_images(workdir: Path, small: int, large: int) -> None:
    """``<workdir>/small`` and ``<workdir>/large`` with ``instances.json`` each (made once)."""
    from ssd_lightning.data.shapes import make_detection_dataset

    if (workdir / "large" / "instances.json").is_file():
        return
    source = make_detection_dataset(workdir / "shapes", num_train=0, num_val=max(small, large), seed=0)
    dataset = json.loads((source / "annotations" / "instances_val2017.json").read_text())
    rng = np.random.default_rng(0)
    for name, count in (("small", small), ("large", large)):
        folder = workdir / name
        folder.mkdir(parents=True, exist_ok=True)
        images = dataset["images"][:count]
        kept = {image["id"] for image in images}
        annotations = [dict(a) for a in dataset["annotations"] if a["image_id"] in kept]
        if name == "large":
            by_id = {image["id"]: image for image in images}
            for a in annotations:
                image = by_id[a["image_id"]]
                sx, sy = LARGE_SIZE[0] / image["width"], LARGE_SIZE[1] / image["height"]
                x, y, w, h = a["bbox"]
                a.update(bbox=[x * sx, y * sy, w * sx, h * sy], area=w * sx * h * sy)
        written = []
        for image in images:
            picture = Image.open(source / "val2017" / image["file_name"]).convert("RGB")
            if name == "large":
                picture = picture.resize(LARGE_SIZE, Image.BILINEAR)
                noisy = np.asarray(picture, dtype=np.int16) + rng.integers(-8, 9, (*LARGE_SIZE[::-1], 3))
                picture = Image.fromarray(noisy.clip(0, 255).astype(np.uint8))
            picture.save(folder / image["file_name"], quality=90)
            written.append({**image, "width": picture.width, "height": picture.height})
        (folder / "instances.json").write_text(
            json.dumps({**dataset, "images": written, "annotations": annotations})
        )


# ------------------------------------------------------------------------------------------ one row
def _detector(args: argparse.Namespace, onnx: Path | None = None):
    from ssd_lightning.inference.detector import Detector, load_detector

    if onnx is not None:
        return load_detector(onnx=onnx, device="cpu")
    if args.ckpt:
        return load_detector(args.ckpt, device=args.device, **_accepted(load_detector, {"dtype": args.dtype}))
    from ssd_lightning.data.categories import CategoryMap
    from ssd_lightning.models import ssd300

    torch.manual_seed(0)
    net = ssd300(backbone="mobilenet_v2", num_classes=5, width_mult=0.5).eval().to(args.device)
    settings = {}
    if "dtype" in inspect.signature(Detector).parameters:
        from ssd_lightning.inference.detector import resolve_dtype

        settings["dtype"] = resolve_dtype(args.dtype, args.device)[0]
    names = ["rectangle", "ellipse", "triangle", "star"]
    return Detector(categories=CategoryMap.from_names(names), net=net, source="random weights", **settings)


def _run_row(args: argparse.Namespace) -> dict:
    """Measure row ``args.row`` on image set ``args.set``: ``{"img_s", "cpu_ms", "rss_mib", "mAP",
    "precision"}`` (``cpu_ms``: CPU time of all the process's threads per image)."""
    from ssd_lightning.inference import predict

    folder = args.workdir / args.set
    inputs = predict.collect_inputs(folder)
    onnx = args.workdir / "e2e.onnx" if args.row == "predict ONNX" else None
    detector = _detector(args, onnx)
    tensors, sizes = [], []
    for item in inputs if ROWS[args.row] is None else inputs[: args.batch_size]:
        opened = predict.open_image(item.path)
        image = opened[0] if isinstance(opened, tuple) else opened  # an older checkout: the image alone
        tensors.append(predict.preprocess(image))
        sizes.append((image.height, image.width))
    first = detector.detect(torch.stack(tensors[: args.batch_size]), sizes[: args.batch_size])  # warm-up
    if args.row == "predict replayed network":
        object.__setattr__(detector, "detect", lambda images, batch_sizes: first[: len(batch_sizes)])
    _synchronize(args.device)
    result = {"precision": getattr(detector, "dtype", "fp32") if onnx is None else "as exported"}
    start, cpu = time.perf_counter(), time.process_time()
    if ROWS[args.row] is None:
        for k in range(0, len(tensors), args.batch_size):
            batch = slice(k, k + args.batch_size)
            detector.detect(torch.stack(tensors[batch]), sizes[batch])
    else:
        settings = {"batch_size": args.batch_size, "workers": args.workers, **ROWS[args.row]}
        out = Path(tempfile.mkdtemp(prefix="predict_", dir=args.workdir))
        predict.predict_images(detector, inputs, out, **_accepted(predict.predict_images, settings))
    _synchronize(args.device)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if ROWS[args.row] is not None and args.ckpt and args.row != "predict replayed network":
        from ssd_lightning.evaluation import evaluate_coco

        annotations = folder / "instances.json"
        image_ids = predict.match_annotation_ids(inputs, json.loads(annotations.read_text()))
        out_ids = out / "with_ids.json"
        entries = json.loads((out / "predictions.json").read_text())
        for entry in entries:
            entry["image_id"] = image_ids[entry["image_id"]]
        out_ids.write_text(json.dumps(entries))
        result["mAP"] = evaluate_coco(annotations, out_ids, verbose=False)["mAP"]
    result.update(img_s=len(inputs) / seconds, cpu_ms=1000 * cpu / len(inputs), rss_mib=_peak_rss_mib())
    return result


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _peak_rss_mib() -> float:
    """This process's peak RSS: ``VmHWM`` (``ru_maxrss`` keeps the parent's peak across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB on most systems


# ------------------------------------------------------------------------------------------ main
def _export_onnx(args: argparse.Namespace) -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        print("no onnxruntime: no ONNX row", file=sys.stderr)
        return False
    from ssd_lightning.inference.export import export_detector

    path = args.workdir / "e2e.onnx"
    if not path.is_file():
        detector = _detector(argparse.Namespace(**{**vars(args), "dtype": "32"}))
        export_detector(detector, path, end_to_end=True)
    return True


def _child(args: argparse.Namespace, row: str, image_set: str, pythonpath: str | None) -> dict | None:
    """:func:`_run_row` in a fresh process (``pythonpath``: the package of another checkout)."""
    command = [sys.executable, __file__, "--row", row, "--set", image_set, "--workdir", str(args.workdir)]
    command += ["--batch-size", str(args.batch_size), "--workers", str(args.workers)]
    command += ["--dtype", str(args.dtype), "--device", args.device] + (
        ["--ckpt", args.ckpt] if args.ckpt else []
    )
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"{row} on {image_set} images failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", help="a train.py checkpoint (default: the demo's network, random weights)")
    parser.add_argument("--small", type=int, default=48, help="small images (the demo's sizes)")
    parser.add_argument("--large", type=int, default=24, help="12-megapixel JPEGs (4000x3000)")
    parser.add_argument("--batch-size", type=int, default=8, help="predict.py's default")
    parser.add_argument("--workers", type=int, default=4, help="predict.py's default")
    parser.add_argument("--dtype", default="auto", help="auto (predict.py's default), fp32, bf16, fp16")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the network (and JPEG decoding) there")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="(network: always)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every row, in rotated order (median)")
    parser.add_argument(
        "--before", type=Path, help="a checkout of an earlier version: its predict rows too, side by side"
    )
    parser.add_argument("--workdir", type=Path, help="where the images go (kept; default: a temporary one)")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # one row, in a child process
    parser.add_argument("--set", choices=["small", "large"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(_run_row(args)))
        return 0

    temporary = None
    if args.workdir is None:
        temporary = tempfile.TemporaryDirectory(prefix="benchmark_predict_")
        args.workdir = Path(temporary.name)
    args.workdir.mkdir(parents=True, exist_ok=True)
    _make_images(args.workdir, args.small, args.large)
    rows = [r for r in ROWS if r in {"network", *args.rows} and (r != "predict ONNX" or _export_onnx(args))]
    versions = [("", None)]
    if args.before:
        versions.append((" (before)", str(args.before.resolve())))
    runs = [  # (row, suffix, PYTHONPATH): the earlier checkout's predict rows after ours
        (row, *version)
        for row in rows
        for version in (versions if row.startswith(("predict draw", "predict replayed")) else versions[:1])
    ]
    measured: dict[tuple, list[dict]] = {}
    for repeat in range(args.repeats):
        for image_set in ("small", "large"):
            for row, suffix, path in runs[repeat % len(runs) :] + runs[: repeat % len(runs)]:  # rotated
                result = _child(args, row, image_set, path)
                if result is None:
                    return 1
                measured.setdefault((image_set, row, suffix), []).append(result)
                print(image_set, row + suffix, result, file=sys.stderr, flush=True)
    table = []
    for image_set, count in (("small", args.small), ("large", args.large)):
        label = "small (160-480 px)" if image_set == "small" else "12 MP JPEG (4000x3000)"
        network = statistics.median(r["img_s"] for r in measured[image_set, "network", ""])
        for row, suffix, _ in runs:
            results = measured[image_set, row, suffix]
            img_s = statistics.median(r["img_s"] for r in results)
            cpu_ms = statistics.median(r["cpu_ms"] for r in results)
            rss = max(r["rss_mib"] for r in results)
            mean_ap = f"{results[0]['mAP']:.4f}" if "mAP" in results[0] else "-"
            cells = [f"{label}, {count}", row + suffix, results[0]["precision"], f"{img_s:.1f}"]
            table.append([*cells, f"{img_s / network:.2f}x", f"{cpu_ms:.0f}", f"{rss:.0f}", mean_ap])
    columns = ["images", "what", "precision", "img/s", "x network", "CPU ms/img", "peak RSS MiB", "mAP"]
    print(markdown_table(columns, table, align="lllrrrrr"))
    if temporary is not None:
        temporary.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
