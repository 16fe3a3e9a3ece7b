"""Time the COCO evaluation step of a validation pass at COCO-val scale, under real multi-process DDP.

Generates a COCO-val-sized ground truth (5,000 images by default, the 80 COCO category ids, all area ranges,
some crowd boxes) and runs ``trainer.validate`` with ``CocoMAPCallback`` in a Lightning ``strategy="ddp"``
job on the CPU (gloo; this script is started again for ranks 1..N-1), with a stand-in model emitting
``--detections`` per image. It prints the callback's seconds per phase (accumulate, gather, write JSON,
evaluate, per-class rows, per-class report, other, epoch end) on rank 0, median over ``--repeats``.
Both backends run in the same job; ``--baseline-rev REV`` adds the callback and ``evaluation.py`` of a git
revision (``git show``), interleaved with today's; ``--per-class both`` also times ``per_class=False``.
Exit 1 if the 12 stats, the per-class APs or the written JSON files differ between configurations.

    python benchmarks/benchmark_eval.py                              # 2 ranks, both backends
    python benchmarks/benchmark_eval.py --baseline-rev e636053       # + the pre-#15 callback and evaluation
    python benchmarks/benchmark_eval.py --images 500 --backends faster_coco_eval   # a quick look
    python benchmarks/benchmark_eval.py --backends faster_coco_eval --per-class both --repeats 3
"""

from __future__ import annotations

import argparse
import atexit
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, Dataset

from ssd_lightning.evaluation import COCO_STAT_NAMES
from ssd_lightning.tables import markdown_table

REPO = Path(__file__).resolve().parents[1]
WORKDIR_ENV = "SSD_BENCHMARK_EVAL_DIR"  # rank 0 creates the work dir, the other ranks inherit its path
#: The 80 category ids of COCO 2017 (1..90 with 10 gaps).
COCO_CATEGORY_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=5000, help="validation images (COCO val2017: 5,000)")
    p.add_argument("--detections", type=int, default=100, help="detections per image")
    p.add_argument("--devices", type=int, default=2, help="DDP processes")
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--backends", nargs="+", default=["faster_coco_eval", "pycocotools"])
    p.add_argument("--baseline-rev", default=None, help="git revision whose callback to time as well")
    p.add_argument("--repeats", type=int, default=1, help="passes per configuration (median reported)")
    p.add_argument("--no-save", action="store_true", help="save_detections=False (no JSON file)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--per-class",
        choices=["on", "off", "both"],
        default="on",
        help="CocoMAPCallback(per_class=...) of the new path; 'both' times it with and without",
    )
    return p.parse_args()


# ---------------------------------------------------------------------------------------------- data
def coco_like_image(rng: np.random.Generator, image_id: int, images: list[dict]) -> tuple[int, int]:
    """Append an image of a COCO-like size to ``images``; return its ``(width, height)``."""
    w, h = int(rng.choice([640, 500, 480])), int(rng.choice([480, 427, 375]))
    images.append({"id": image_id, "width": w, "height": h, "file_name": f"{image_id:012d}.jpg"})
    return w, h


def coco_like_box(rng: np.random.Generator, w: int, h: int) -> tuple[float, float, float, float]:
    """A COCO box ``(x, y, w, h)`` inside a ``w`` x ``h`` image: 41 % small, 34 % medium, 25 % large."""
    r = rng.random()
    side = rng.uniform(4, 32) if r < 0.41 else rng.uniform(32, 96) if r < 0.75 else rng.uniform(96, 400)
    bw = min(side * rng.uniform(0.7, 1.4), w - 1.0)
    bh = min(side * side / bw, h - 1.0)
    return rng.uniform(0, w - bw), rng.uniform(0, h - bh), bw, bh


def make_ground_truth(path: Path, num_images: int, seed: int) -> None:
    """COCO val2017 in shape: ~7.3 objects per image, 41 % small / 34 % medium / 25 % large, ~1 % crowd."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(np.arange(1, 600_000), num_images, replace=False)).tolist()
    images, anns = [], []
    for image_id in ids:
        w, h = coco_like_image(rng, image_id, images)
        for _ in range(int(rng.poisson(7.3))):
            x, y, bw, bh = coco_like_box(rng, w, h)
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": image_id,
                    "category_id": int(rng.choice(COCO_CATEGORY_IDS)),
                    "bbox": [round(x, 2), round(y, 2), round(bw, 2), round(bh, 2)],
                    "area": round(bw * bh, 2),
                    "iscrowd": int(rng.random() < 0.01),
                    "segmentation": [],
                }
            )
    cats = [{"id": c, "name": f"category_{c}", "supercategory": "thing"} for c in COCO_CATEGORY_IDS]
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))


class CategoryMap:
    """Contiguous label i+1 <-> COCO_CATEGORY_IDS[i] (what ssd_lightning.data.categories.CategoryMap does)."""

    def __init__(self) -> None:
        self.lut = torch.tensor([-1, *COCO_CATEGORY_IDS])

    def label_to_category_id(self, labels: torch.Tensor) -> torch.Tensor:
        return self.lut[labels.long()]


class IdDataset(Dataset):
    def __init__(self, image_ids: list[int]) -> None:
        self.image_ids = image_ids

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(self.image_ids[i])


class ValData(pl.LightningDataModule):
    def __init__(self, annotation_file: Path, image_ids: list[int], batch_size: int) -> None:
        super().__init__()
        self.val_annotation_file = str(annotation_file)
        self.category_map = CategoryMap()
        self.image_ids, self.batch_size = image_ids, batch_size

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(self.image_ids), batch_size=self.batch_size)


class StandInDetector(pl.LightningModule):
    """Per image (deterministic in the image id, so any rank split gives the same detections): 1-3 jittered
    copies of every ground-truth box (10 % with another class), then background boxes up to ``k``; scores in
    [0.05, 1), ltrb pixels, contiguous labels, as ``SSDLitModule.validation_step`` returns them."""

    def __init__(self, annotation_file: Path, k: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        data = json.loads(Path(annotation_file).read_text())
        self.size = {im["id"]: (im["width"], im["height"]) for im in data["images"]}
        self.gt: dict[int, list] = defaultdict(list)
        for a in data["annotations"]:
            self.gt[a["image_id"]].append((a["bbox"], COCO_CATEGORY_IDS.index(a["category_id"]) + 1))
        self.k = k

    def _detections(self, image_id: int) -> dict[str, Any]:
        rng = np.random.default_rng(image_id)
        w, h = self.size[image_id]
        xywh, labels = [], []
        for box, label in self.gt[image_id]:
            for _ in range(rng.integers(1, 4)):
                xywh.append(np.asarray(box) + rng.normal(0, 0.08, 4) * np.asarray(box)[[2, 3, 2, 3]])
                labels.append(label if rng.random() < 0.9 else int(rng.integers(1, 81)))
        n_bg = max(self.k - len(xywh), 0)
        bw, bh = rng.uniform(4, w / 2, n_bg), rng.uniform(4, h / 2, n_bg)
        bg = np.stack([rng.uniform(0, w - bw), rng.uniform(0, h - bh), bw, bh], axis=1)
        xywh = np.concatenate([np.reshape(xywh, (-1, 4)), bg])[: self.k]
        labels = np.concatenate([np.asarray(labels, dtype=np.int64), rng.integers(1, 81, n_bg)])[: self.k]
        xywh[:, 2:] = np.abs(xywh[:, 2:])
        ltrb = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1)
        return {
            "image_id": image_id,
            "boxes": torch.tensor(ltrb, dtype=torch.float32),
            "scores": torch.tensor(rng.uniform(0.05, 1.0, len(ltrb)), dtype=torch.float32),
            "labels": torch.tensor(labels, dtype=torch.int64),
        }

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        return {"detections": [self._detections(i) for i in batch.tolist()]}


# ------------------------------------------------------------------------------------- the callbacks
def load_baseline(rev: str, workdir: Path) -> Any:
    """The callback module of git revision ``rev``, importing that revision's ``evaluation`` module."""
    modules = {}
    for name, path in (
        ("evaluation", "ssd_lightning/evaluation.py"),
        ("coco_map", "ssd_lightning/callbacks/coco_map.py"),
    ):
        target = workdir / f"baseline_{name}.py"
        if not target.exists():  # written by rank 0 before the other ranks start
            source = subprocess.run(
                ["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True
            ).stdout
            source = source.replace("from ssd_lightning.evaluation import", "from baseline_evaluation import")
            target.write_text(source)
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"baseline_{name}"] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules["coco_map"]


PHASES: dict[str, float] = defaultdict(float)  # wall-clock seconds
CPU: dict[str, float] = defaultdict(float)  # CPU seconds of this process (all its threads)


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[name] += time.perf_counter() - t0
            CPU[name] += time.process_time() - c0

    return wrapper


def instrument(module: Any) -> type:
    """Time the module-level helpers the callback calls, and the two hooks; returns the timed class."""
    if not getattr(module, "_benchmark_instrumented", False):
        module._gather_to_rank_zero = _timed("gather", module._gather_to_rank_zero)
        for name in (
            "_atomic_write_json",
            "atomic_write_json",
        ):  # the helper's name in older / newer revisions
            if hasattr(module, name):
                setattr(module, name, _timed("write JSON", getattr(module, name)))
        module.evaluate_coco = _timed("evaluate", module.evaluate_coco)
        # per-class AP: evaluate_coco_per_class in older revisions, evaluate_coco_detailed in newer ones
        for name in ("evaluate_coco_per_class", "evaluate_coco_detailed"):
            if hasattr(module, name):
                setattr(module, name, _timed("evaluate", getattr(module, name)))
                evaluation = sys.modules[getattr(module, name).__module__]
                if hasattr(evaluation, "_class_rows"):
                    evaluation._class_rows = _timed("per-class rows", evaluation._class_rows)
        module._benchmark_instrumented = True
    base = module.CocoMAPCallback

    class Timed(base):
        def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
            _timed("accumulate", super().on_validation_batch_end)(*args, **kwargs)

        def _report_per_class(self, *args: Any, **kwargs: Any) -> None:
            _timed("per-class report", super()._report_per_class)(*args, **kwargs)

        def on_validation_epoch_end(self, *args: Any, **kwargs: Any) -> None:
            _timed("epoch end", super().on_validation_epoch_end)(*args, **kwargs)

    return Timed


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    args = parse_args()
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=PossibleUserWarning)
    child = WORKDIR_ENV in os.environ
    if child:
        workdir = Path(os.environ[WORKDIR_ENV])
    else:
        workdir = Path(tempfile.mkdtemp(prefix="benchmark_eval_"))
        atexit.register(shutil.rmtree, workdir, ignore_errors=True)  # the launched ranks share it
        os.environ[WORKDIR_ENV] = str(workdir)
    ann_file = workdir / "instances_val.json"
    if not child:
        t0 = time.perf_counter()
        make_ground_truth(ann_file, args.images, args.seed)
        n_boxes = len(json.loads(ann_file.read_text())["annotations"])
        print(f"ground truth: {args.images} images, {n_boxes} boxes ({time.perf_counter() - t0:.1f} s)")

    import ssd_lightning.callbacks.coco_map as coco_map

    new = instrument(coco_map)
    paths: dict[str, Any] = {}
    if args.baseline_rev:
        paths[f"old ({args.baseline_rev})"] = instrument(load_baseline(args.baseline_rev, workdir))
    if args.per_class in ("off", "both"):
        paths["new, per-class off"] = functools.partial(new, per_class=False)
    if args.per_class in ("on", "both"):
        paths["new"] = new
    configs = [(path, backend) for path in paths for backend in args.backends]
    image_ids = [im["id"] for im in json.loads(ann_file.read_text())["images"]]
    model = StandInDetector(ann_file, args.detections)

    load_before = f"{os.getloadavg()[0]:.1f}"
    runs: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    stats: dict[tuple[str, str], dict[str, float]] = {}
    digests: dict[tuple[str, str], str] = {}
    for repeat in range(args.repeats):
        for i, (path, backend) in enumerate(configs):
            out_dir = workdir / f"out_{i}"
            cb = paths[path](
                backend=backend, verbose=False, save_detections=not args.no_save, output_dir=out_dir
            )
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=args.devices,
                strategy="ddp",
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[cb],
                default_root_dir=str(workdir),
            )
            PHASES.clear()
            CPU.clear()
            trainer.validate(model, datamodule=ValData(ann_file, image_ids, args.batch_size), verbose=False)
            # slowest rank's accumulation; every other phase as rank 0 sees it
            mine = torch.tensor([PHASES["accumulate"]], dtype=torch.float64)
            torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
            if trainer.global_rank == 0:
                timing = dict(PHASES, accumulate=float(mine))
                timing["other"] = timing["epoch end"] - sum(
                    timing.get(k, 0.0) for k in ("gather", "write JSON", "evaluate", "per-class report")
                )
                timing["epoch end CPU"] = CPU["epoch end"]
                runs[path, backend].append(timing)
                stats[path, backend] = cb.last_stats
                if not args.no_save:
                    digests[path, backend] = hashlib.sha256(
                        (out_dir / "detections_epoch_0.json").read_bytes()
                    ).hexdigest()
                print(
                    f"  [{repeat + 1}/{args.repeats}] {path:>16} {backend:>16}: {timing['epoch end']:.2f} s"
                )
    # gloo's threads must not outlive the interpreter (see tests/test_coco_map_callback.py)
    torch.distributed.destroy_process_group()
    if child:
        return 0

    names = [
        "accumulate",
        "gather",
        "write JSON",
        "evaluate",
        "per-class rows",
        "per-class report",
        "other",
        "epoch end",
        "epoch end CPU",
    ]
    medians = {c: {n: statistics.median(r.get(n, 0.0) for r in runs[c]) for n in names} for c in configs}
    reference = medians[configs[-len(args.backends)]]["epoch end"]  # the last path, first backend
    print(
        f"\n{args.images} images x {args.detections} detections = {args.images * args.detections:,} on "
        f"{args.devices} ranks (gloo, CPU, {os.cpu_count()} cores), batch {args.batch_size}, "
        f"median of {args.repeats}; wall-clock seconds on rank 0 (load average before: {load_before}, "
        f"after: {os.getloadavg()[0]:.1f}), and rank 0's CPU seconds for the epoch end (all its threads; "
        "what the wall time would be on an idle machine, the gather's wait aside)\n"
    )
    header = ["path", "backend", *names, "ratio"]
    rows = [
        [path, backend, *(f"{medians[path, backend][n]:.2f}" for n in names)]
        + [f"{medians[path, backend]['epoch end'] / reference:.1f}x"]
        for path, backend in configs
    ]
    print(markdown_table(header, rows, pad=True))

    # the same backend must give exactly the same numbers on both paths; the two backends agree to 1e-12
    # (pycocotools and faster-coco-eval sum in a different order, like the tests allow)
    # (per-class APs too, on the paths that have them)
    twelve = {c: [s[n] for n in COCO_STAT_NAMES] for c, s in stats.items()}
    same = all(twelve[c] == twelve[path, c[1]] for c in configs for path in paths)
    values = np.array(list(twelve.values()))
    spread = float((values.max(axis=0) - values.min(axis=0)).max())
    per_class = [s for s in stats.values() if len(s) > len(COCO_STAT_NAMES)]
    if per_class:
        same = same and all(s.keys() == per_class[0].keys() for s in per_class)
        values = np.array([list(s.values()) for s in per_class]) if same else values
        spread = max(spread, float((values.max(axis=0) - values.min(axis=0)).max()))
    same_json = len(set(digests.values())) <= 1
    first = stats[configs[0]]
    print(
        f"\nmAP {first['mAP']:.4f}, mAP_50 {first['mAP_50']:.4f}; same stats per backend on every path: "
        f"{'yes' if same else 'NO'}; largest difference between backends: {spread:.1e}"
        + (f"; JSON files identical: {'yes' if same_json else 'NO'}" if digests else "")
    )
    if not same or spread > 1e-12:
        for c, s in stats.items():
            print(c, list(s.values()))
    return 0 if same and same_json and spread <= 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
