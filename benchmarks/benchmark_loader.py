"""Images/s of the SSD300 training data path: datamodule vs bare DALI vs torchvision.transforms.v2.

All of them read the same COCO-layout images, apply the SSD augmentation (IoU crop, flip, colour jitter,
resize 300, normalise) and encode targets onto the 8732 default boxes, with the same number of worker
threads and the same batch size. Without ``--root`` a shapes dataset is generated in a temp directory.

Each repeat builds every loader afresh and times it, rotating the order from repeat to repeat so that load
drift on a shared machine hits every loader alike; the table reports the median and the range over repeats,
and the ratio to the bare pipeline is computed within each repeat before taking its median.

    .venv/bin/python benchmarks/benchmark_loader.py --batches 30 --warmup 3 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ssd_lightning.tables import markdown_table


def _timed(batches: Iterator, warmup: int, count: int, batch_size: int) -> tuple[float, float]:
    """(images/s, CPU ms per image used by this process, all its threads: DALI's workers included)."""
    for _ in range(warmup):
        next(batches)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        next(batches)
    images = count * batch_size
    return images / (time.perf_counter() - start), 1e3 * (time.process_time() - cpu) / images


def _forever(iterable: Iterable) -> Iterator:
    while True:
        yield from iterable


def _bare_pipeline(root: Path, batch_size: int, threads: int):
    from ssd_lightning.data.dali_pipelines import coco_train_pipeline
    from ssd_lightning.models import dboxes300_coco

    pipe = coco_train_pipeline(
        batch_size=batch_size,
        num_threads=threads,
        device_id=None,
        prefetch_queue_depth=2,
        seed=0,
        file_root=str(root / "train2017"),
        annotations_file=str(root / "annotations" / "instances_train2017.json"),
        anchors_ltrb=dboxes300_coco().ltrb.flatten().tolist(),
        device="cpu",
    )
    pipe.build()
    return pipe


def bench_bare_dali(
    root: Path, batch_size: int, threads: int, warmup: int, count: int
) -> tuple[float, float]:
    pipe = _bare_pipeline(root, batch_size, threads)

    def run():
        while True:
            yield pipe.run()

    return _timed(run(), warmup, count, batch_size)


def bench_generic_iterator(
    root: Path, batch_size: int, threads: int, warmup: int, count: int
) -> tuple[float, float]:
    """DALI's own DALIGenericIterator (zero-copy ``torch.from_dlpack`` under DALI's default executor)."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    pipe = _bare_pipeline(root, batch_size, threads)
    it = DALIGenericIterator(
        pipe,
        ["images", "boxes", "labels"],
        reader_name="Reader",
        last_batch_policy=LastBatchPolicy.DROP,
        auto_reset=True,
    )
    return _timed(_forever(it), warmup, count, batch_size)


def bench_datamodule(
    root: Path, batch_size: int, threads: int, warmup: int, count: int
) -> tuple[float, float]:
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    dm = CocoDALIDataModule(root, batch_size=batch_size, num_threads=threads, device="cpu", seed=0)
    dm.setup("fit")
    return _timed(_forever(dm.train_dataloader()), warmup, count, batch_size)


class _TorchvisionSSD(torch.utils.data.Dataset):
    """COCO images + boxes -> SSD augmentation with transforms.v2 -> BoxCoder-encoded targets."""

    def __init__(self, root: Path) -> None:
        from torchvision.transforms import v2

        from ssd_lightning.data.categories import CategoryMap

        data = json.loads((root / "annotations" / "instances_train2017.json").read_text())
        self.cmap = CategoryMap.from_coco(data)
        anns: dict[int, list] = {}
        for a in data["annotations"]:
            anns.setdefault(a["image_id"], []).append(a)
        self.items = [
            (root / "train2017" / im["file_name"], anns[im["id"]])
            for im in data["images"]
            if im["id"] in anns
        ]
        self.transform = v2.Compose(
            [
                v2.RandomIoUCrop(),
                v2.SanitizeBoundingBoxes(),
                v2.RandomHorizontalFlip(0.5),
                v2.ColorJitter(brightness=0.125, contrast=0.5, saturation=0.5, hue=0.5 / 360),
                v2.Resize((300, 300)),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
            ]
        )
        self.coder = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from torchvision import tv_tensors
        from torchvision.io import ImageReadMode, decode_image, read_file

        from ssd_lightning.models.boxes import BoxCoder, dboxes300_coco

        if self.coder is None:
            self.coder = BoxCoder(dboxes300_coco())
        path, anns = self.items[i]
        img = decode_image(read_file(str(path)), mode=ImageReadMode.RGB)
        h, w = img.shape[-2:]
        xywh = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32)
        boxes = tv_tensors.BoundingBoxes(
            torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1), format="XYXY", canvas_size=(h, w)
        )
        labels = self.cmap.category_id_to_label(torch.tensor([a["category_id"] for a in anns]))
        img, target = self.transform(img, {"boxes": boxes, "labels": labels})
        scale = torch.tensor([300.0, 300.0, 300.0, 300.0])
        enc_boxes, enc_labels = self.coder.encode(
            target["boxes"].as_subclass(torch.Tensor) / scale, target["labels"]
        )
        return img, enc_boxes, enc_labels


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)


def bench_torchvision(
    root: Path, batch_size: int, threads: int, warmup: int, count: int
) -> tuple[float, float]:
    loader = torch.utils.data.DataLoader(
        _TorchvisionSSD(root),
        batch_size=batch_size,
        shuffle=True,
        num_workers=threads,
        drop_last=True,
        persistent_workers=True,
        worker_init_fn=_worker_init,
        prefetch_factor=2,
        # fork() after DALI's threads exist in this process can deadlock a worker: start them fresh
        multiprocessing_context="spawn",
    )
    return _timed(_forever(loader), warmup, count, batch_size)


LOADERS = {
    "bare DALI pipeline": bench_bare_dali,
    "DALIGenericIterator": bench_generic_iterator,
    "CocoDALIDataModule": bench_datamodule,
    "torchvision v2 + DataLoader": bench_torchvision,
}
SHORT = {"bare": "bare DALI pipeline", "generic": "DALIGenericIterator"}
SHORT |= {"datamodule": "CocoDALIDataModule", "torchvision": "torchvision v2 + DataLoader"}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=None, help="COCO-layout root (default: generate shapes)")
    parser.add_argument("--num-images", type=int, default=400, help="images to generate without --root")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="DALI threads = DataLoader workers")
    parser.add_argument("--warmup", type=int, default=2, help="batches before timing")
    parser.add_argument("--batches", type=int, default=10, help="timed batches")
    parser.add_argument("--repeats", type=int, default=3, help="timings per loader (order rotated)")
    parser.add_argument(
        "--loaders", default="bare,generic,datamodule,torchvision", help=f"comma-separated: {sorted(SHORT)}"
    )
    args = parser.parse_args()
    names = [SHORT[k.strip()] for k in args.loaders.split(",")]
    if "bare DALI pipeline" not in names:
        names.insert(0, "bare DALI pipeline")

    root = args.root
    if root is None:
        from ssd_lightning.data.shapes import make_detection_dataset

        root = make_detection_dataset(
            Path(tempfile.mkdtemp()) / "shapes", num_train=args.num_images, num_val=1
        )
    common = (root, args.batch_size, args.threads, args.warmup, args.batches)
    runs: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            ips, ms = LOADERS[name](*common)
            runs[name].append(ips)
            cpu[name].append(ms)
        print(f"repeat {r + 1}: " + ", ".join(f"{n} {runs[n][-1]:.1f}" for n in names), flush=True)

    bare = runs["bare DALI pipeline"]
    tv = runs.get("torchvision v2 + DataLoader")
    print(
        f"\n{args.repeats} repeats of {args.batches} x {args.batch_size} images after {args.warmup} warm-up "
        f"batches, {args.threads} threads/workers, root={root}"
    )
    columns = ["loader", "images/s median (min-max)", "vs bare DALI (min-max)", "CPU ms/image", "CPU vs bare"]
    bare_ms = statistics.median(cpu["bare DALI pipeline"])
    rows = []
    for name, ips in runs.items():
        ratio = [a / b for a, b in zip(ips, bare, strict=True)]
        vs_tv = f"{statistics.median(ips) / statistics.median(tv):.2f}x" if tv else "-"
        ms, vs_ms = f"{statistics.median(cpu[name]):.2f}", f"{bare_ms / statistics.median(cpu[name]):.3f}x"
        if name == "torchvision v2 + DataLoader":
            ms, vs_ms = "(workers not counted)", "-"
        rows.append([
            name, f"{statistics.median(ips):.1f} ({min(ips):.1f}-{max(ips):.1f})",
            f"{statistics.median(ratio):.3f}x ({min(ratio):.3f}-{max(ratio):.3f})", ms, vs_ms, vs_tv,
        ])  # fmt: skip
    print(markdown_table([*columns, "vs torchvision"], rows, align="lrrrrr"))


if __name__ == "__main__":
    main()
