"""Generate the synthetic shapes dataset (COCO-layout detection or ImageFolder classification).

Examples::

    python scripts/make_shapes_dataset.py --out data/shapes_coco --kind detection --train 2000 --val 200
    python scripts/make_shapes_dataset.py --out data/shapes_cls --kind classification --train 100 --val 20

For ``classification``, ``--train``/``--val`` are images per class and ``--max-size`` is the image side.
"""

from __future__ import annotations

import argparse
import sys
import time

from ssd_lightning.data.shapes import SHAPE_CATEGORIES, make_classification_dataset, make_detection_dataset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    parser.add_argument("--kind", choices=["detection", "classification"], default="detection")
    parser.add_argument("--train", type=int, default=None, help="train images (per class for classification)")
    parser.add_argument("--val", type=int, default=None, help="val images (per class for classification)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-size", type=int, default=160, help="detection: smallest image side")
    sizes = "detection: largest image side (default 480); classification: the image side (default 96)"
    parser.add_argument("--max-size", type=int, default=None, help=sizes)
    args = parser.parse_args(argv)

    defaults = {"detection": (2000, 200, 480), "classification": (100, 20, 96)}[args.kind]
    given = (args.train, args.val, args.max_size)
    train, val, size = (d if a is None else a for a, d in zip(given, defaults, strict=True))
    n = len(SHAPE_CATEGORIES)
    start = time.perf_counter()
    try:
        if args.kind == "detection":
            root = make_detection_dataset(
                args.out, num_train=train, num_val=val, seed=args.seed, min_size=args.min_size, max_size=size
            )
            counts = f"{train} train + {val} val images, {n} categories"
        else:
            root = make_classification_dataset(
                args.out, num_train_per_class=train, num_val_per_class=val, seed=args.seed, image_size=size
            )
            counts = f"{train * n} train + {val * n} val images ({train}/{val} per class, {n} classes)"
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"Wrote shapes {args.kind} dataset to {root.resolve()}: {counts} "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
