"""Batched SSD decoder vs the NVIDIA reference per-image decode, side by side on the same inputs.

    python benchmarks/benchmark_decoder.py --batch-size 32

Inputs are random network outputs for SSD300 (8732 boxes, 81 classes): N(0, 1) offsets and N(0, 1)
logits, which fill the top-200 cut and NMS of every (image, class) (the heavy case; docs/benchmarks.md).
The reference is the faithful re-implementation in tests/reference_ssd.py (per image, per class Python
loop; stable sorts, see there). Prints ms per batch, the speed-up and
whether every image's detections are identical (boxes, scores and labels, bit for bit).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_ssd import ref_decode_as_dicts  # noqa: E402

from ssd_lightning.models import BoxCoder, dboxes300_coco  # noqa: E402
from ssd_lightning.tables import markdown_table


def _identical(ours: list[dict], ref: list[dict]) -> bool:
    return len(ours) == len(ref) and all(
        o[k].shape == r[k].shape and torch.equal(o[k], r[k])
        for o, r in zip(ours, ref, strict=True)
        for k in ("boxes", "scores", "labels")
    )


def _time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=81, help="including background")
    parser.add_argument("--logit-scale", type=float, default=1.0, help="std of the random logits")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the batched decoder (best kept)")
    parser.add_argument("--ref-repeats", type=int, default=1, help="runs of the reference (best kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(args.seed)
    locs = torch.randn(args.batch_size, 4, 8732, generator=g)
    logits = torch.randn(args.batch_size, args.num_classes, 8732, generator=g) * args.logit_scale
    coder = BoxCoder(dboxes300_coco())
    coder.decode(locs[:1], logits[:1])  # warm-up

    t_ours, ours = _time(lambda: coder.decode(locs, logits), args.repeats)
    t_ref, ref = _time(lambda: ref_decode_as_dicts(locs, logits), args.ref_repeats)
    same = _identical(ours, ref)
    dets = sum(len(d["scores"]) for d in ours)

    print(
        f"SSD300 decode, CPU, batch {args.batch_size}, {args.num_classes} classes, "
        f"{torch.get_num_threads()} threads, {dets} detections in the batch"
    )
    rows = [
        [
            *("reference per-image loop", f"{t_ref * 1e3:.0f}", f"{t_ref * 1e3 / args.batch_size:.1f}"),
            *("1.0x", "-"),
        ],
        [
            *("BoxCoder.decode (batched)", f"{t_ours * 1e3:.0f}", f"{t_ours * 1e3 / args.batch_size:.1f}"),
            *(f"{t_ref / t_ours:.1f}x", "yes" if same else "NO"),
        ],
    ]
    columns = ["decoder", "ms / batch", "ms / image", "speed-up", "identical detections"]
    print(markdown_table(columns, rows, align="lrrrl"))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
