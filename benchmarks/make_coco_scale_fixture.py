"""Write a COCO-2017-sized dataset for start-up benchmarks: real annotation volume, few real pixels.

``<out>/{train2017,val2017}/<id:012d>.jpg`` are hard links (symlinks where hard links fail) to a handful
of real JPEGs of COCO's usual sizes, so 118,287 + 5,000 images cost a few MB of disk; the annotation files
have COCO's shape and volume: the 80 category ids (1..90 with gaps, names and supercategories), images
with license/url/date fields, and per image 0-20 boxes (about 7.2 on average, ~1 % of images empty) with
a polygon ``segmentation`` (22 points by default), ``area``, ``iscrowd`` (~1 % crowd boxes with an
RLE ``segmentation``). At the default size the train file is about 435 MB with ~847k boxes.

    .venv/bin/python benchmarks/make_coco_scale_fixture.py --out /tmp/coco_scale            # full size
    .venv/bin/python benchmarks/make_coco_scale_fixture.py --out /tmp/coco_small \
        --train-images 500 --val-images 50

Boxes lie inside their image unless ``--outside N`` asks for N train boxes that extend 1 px past the
right edge (the datamodule clips those and reads a clipped copy). The dataset's pixels carry no meaning:
use it to time reading and checking, not training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

# COCO's 80 detection categories: (id, name, supercategory), in the order of instances_*2017.json.
_SUPER = (
    ("person", 1, 1), ("vehicle", 2, 9), ("outdoor", 10, 15), ("animal", 16, 25), ("accessory", 27, 33),
    ("sports", 34, 43), ("kitchen", 44, 51), ("food", 52, 61), ("furniture", 62, 70), ("electronic", 72, 77),
    ("appliance", 78, 83), ("indoor", 84, 90),
)  # fmt: skip
# COCO's usual image sizes (width, height); one real JPEG of each.
_SIZES = ((640, 480), (480, 640), (640, 427), (427, 640), (640, 360), (500, 375), (640, 512), (612, 612))
_CHUNK = 20_000  # annotations encoded per json.dumps call (bounds the generator's memory)


def coco_categories() -> list[dict]:
    """COCO 2017's category list (ids 1..90 with gaps), as in instances_val2017.json."""
    from ssd_lightning.data.categories import COCO_CATEGORY_IDS, COCO_CLASS_NAMES

    cats = []
    for cid, name in zip(COCO_CATEGORY_IDS, COCO_CLASS_NAMES[1:], strict=True):
        sup = next(s for s, lo, hi in _SUPER if lo <= cid <= hi)
        cats.append({"supercategory": sup, "id": cid, "name": name})
    return cats


def _source_jpegs(folder: Path, rng: np.random.Generator) -> list[tuple[Path, int, int]]:
    """A few smooth, decodable JPEGs of COCO sizes: (path, width, height)."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k, (w, h) in enumerate(_SIZES):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 127 // (w + h) + 64], -1).astype(np.uint8)
        img = Image.fromarray(base)
        draw = ImageDraw.Draw(img)
        for _ in range(6):
            x0, y0 = int(rng.integers(0, w - 40)), int(rng.integers(0, h - 40))
            x1, y1 = x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2))
            draw.ellipse((x0, y0, x1, y1), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        path = folder / f"source_{k}_{w}x{h}.jpg"
        img.save(path, quality=90)
        out.append((path, w, h))
    return out


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        os.symlink(src.resolve(), dst)


def _annotations(
    rng: np.random.Generator,
    image_ids: np.ndarray,
    sizes: np.ndarray,
    category_ids: np.ndarray,
    first_id: int,
    points: int,
    outside: int,
) -> tuple[int, list[str]]:
    """(number of boxes, JSON chunks of the annotations list without brackets) for the given images."""
    n_images = len(image_ids)
    counts = np.where(rng.random(n_images) < 0.01, 0, 1 + np.minimum(rng.poisson(6.2, n_images), 19))
    owner = np.repeat(np.arange(n_images), counts)
    total = len(owner)
    iw, ih = sizes[owner, 0].astype(np.float64), sizes[owner, 1].astype(np.float64)
    bw = np.round(iw * np.exp(rng.uniform(np.log(0.02), np.log(0.9), total)), 2)
    bh = np.round(ih * np.exp(rng.uniform(np.log(0.02), np.log(0.9), total)), 2)
    x = np.round(rng.uniform(0, 1, total) * (iw - bw), 2)
    y = np.round(rng.uniform(0, 1, total) * (ih - bh), 2)
    if outside:
        pick = rng.choice(total, size=min(outside, total), replace=False)
        x[pick] = iw[pick] - bw[pick] + 1.0  # 1 px past the right edge: within the clipping tolerance
    crowd = rng.random(total) < 0.009
    cats = category_ids[rng.integers(0, len(category_ids), total)]
    angles = np.linspace(0, 2 * np.pi, points, endpoint=False)
    chunks = []
    for lo in range(0, total, _CHUNK):
        hi = min(lo + _CHUNK, total)
        r = rng.uniform(0.8, 1.0, (hi - lo, points))  # a wobbly ellipse inscribed in the box
        px = x[lo:hi, None] + bw[lo:hi, None] * (0.5 + 0.5 * r * np.cos(angles))
        py = y[lo:hi, None] + bh[lo:hi, None] * (0.5 + 0.5 * r * np.sin(angles))
        polys = np.round(np.stack([px, py], -1).reshape(hi - lo, 2 * points), 2).tolist()
        area = np.round(bw[lo:hi] * bh[lo:hi] * np.pi / 4 * 0.81, 4).tolist()
        boxes = np.stack([x[lo:hi], y[lo:hi], bw[lo:hi], bh[lo:hi]], 1).tolist()
        anns = []
        for k in range(hi - lo):
            i = lo + k
            if crowd[i]:
                runs = rng.integers(1, 400, 2 * points).tolist()
                seg = {"counts": runs, "size": [int(sizes[owner[i], 1]), int(sizes[owner[i], 0])]}
            else:
                seg = [polys[k]]
            anns.append(
                {
                    "segmentation": seg,
                    "area": area[k],
                    "iscrowd": int(crowd[i]),
                    "image_id": int(image_ids[owner[i]]),
                    "bbox": boxes[k],
                    "category_id": int(cats[i]),
                    "id": first_id + i,
                }
            )
        chunks.append(json.dumps(anns)[1:-1])
    return total, chunks


def write_split(
    root: Path,
    split: str,
    num_images: int,
    sources: list[tuple[Path, int, int]],
    rng: np.random.Generator,
    *,
    first_image_id: int,
    first_ann_id: int,
    points: int,
    outside: int = 0,
) -> tuple[int, int]:
    """Write ``<root>/<split>2017`` links and ``annotations/instances_<split>2017.json``: (images, boxes)."""
    image_dir = root / f"{split}2017"
    image_dir.mkdir(parents=True, exist_ok=True)
    # COCO's ids are sparse and unordered in the file; keep them unique and spread out
    ids = first_image_id + np.sort(rng.choice(num_images * 5, num_images, replace=False))
    ids = ids[rng.permutation(num_images)]
    which = rng.integers(0, len(sources), num_images)
    sizes = np.array([[sources[k][1], sources[k][2]] for k in which], dtype=np.int64)
    images = []
    for iid, k in zip(ids.tolist(), which.tolist(), strict=True):
        name = f"{iid:012d}.jpg"
        _link(sources[k][0], image_dir / name)
        images.append(
            {
                "license": 1 + iid % 8,
                "file_name": name,
                "coco_url": f"http://images.cocodataset.org/{split}2017/{name}",
                "height": sources[k][2],
                "width": sources[k][1],
                "date_captured": "2013-11-14 17:02:52",
                "flickr_url": f"http://farm4.staticflickr.com/{iid % 9000}/{iid}_0000000000_z.jpg",
                "id": iid,
            }
        )
    category_ids = np.array([c["id"] for c in coco_categories()])
    n_boxes, chunks = _annotations(rng, ids, sizes, category_ids, first_ann_id, points, outside)
    head = {
        "info": {"description": "COCO-2017-sized fixture (ssd_lightning)", "version": "1.0", "year": 2017},
        "licenses": [
            {"url": "http://creativecommons.org/licenses/", "id": k, "name": "CC"} for k in range(1, 9)
        ],
    }
    ann_dir = root / "annotations"
    ann_dir.mkdir(exist_ok=True)
    path = ann_dir / f"instances_{split}2017.json"
    tmp = path.with_suffix(".json.part")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(head)[:-1])
        f.write(', "images": ')
        f.write(json.dumps(images))
        f.write(', "annotations": [')
        f.write(", ".join(chunks))
        f.write('], "categories": ')
        f.write(json.dumps(coco_categories()))
        f.write("}")
    os.replace(tmp, path)
    return num_images, n_boxes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (must not exist, or be empty)")
    parser.add_argument("--train-images", type=int, default=118_287)
    parser.add_argument("--val-images", type=int, default=5_000)
    parser.add_argument("--polygon-points", type=int, default=22, help="points per polygon (file size)")
    parser.add_argument("--outside", type=int, default=0, help="train boxes 1 px past their image")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"{args.out} exists and is not empty; pick another --out", file=sys.stderr)
        return 2
    if min(args.train_images, args.val_images) < 1 or args.polygon_points < 3:
        print("--train-images and --val-images must be >= 1, --polygon-points >= 3", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    sources = _source_jpegs(args.out / "_sources", rng)
    common = {"points": args.polygon_points}
    n_train, b_train = write_split(
        args.out, "train", args.train_images, sources, rng, first_image_id=1, first_ann_id=1,
        outside=args.outside, **common,
    )  # fmt: skip
    n_val, b_val = write_split(
        args.out, "val", args.val_images, sources, rng, first_image_id=10 * args.train_images + 1,
        first_ann_id=10_000_000 + 1, **common,
    )  # fmt: skip
    size = (args.out / "annotations" / "instances_train2017.json").stat().st_size
    print(
        f"{args.out}: train {n_train} images / {b_train} boxes ({size / 1e6:.0f} MB JSON), "
        f"val {n_val} images / {b_val} boxes, in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
