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
    parser.add_argument(
        "--max-size",
        type=int,
        default=None,
        help="detection: largest image side (default 480); classification: the image side (default 96)",
    )
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        if args.kind == "detection":
            num_train = 2000 if args.train is None else args.train
            num_val = 200 if args.val is None else args.val
            root = make_detection_dataset(
                args.out,
                num_train=num_train,
                num_val=num_val,
                seed=args.seed,
                min_size=args.min_size,
                max_size=480 if args.max_size is None else args.max_size,
            )
            counts = f"{num_train} train + {num_val} val images, {len(SHAPE_CATEGORIES)} categories"
        else:
            per_train = 100 if args.train is None else args.train
            per_val = 20 if args.val is None else args.val
            root = make_classification_dataset(
                args.out,
                num_train_per_class=per_train,
                num_val_per_class=per_val,
                seed=args.seed,
                image_size=96 if args.max_size is None else args.max_size,
            )
            n = len(SHAPE_CATEGORIES)
            counts = (
                f"{per_train * n} train + {per_val * n} val images "
                f"({per_train}/{per_val} per class, {n} classes)"
            )
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
