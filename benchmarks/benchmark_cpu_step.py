"""One training step of the demo detector on a CPU: backbone widths, float32 strided depthwise, side by side.

Times forward + loss + backward + AdamW of SSD300-MobileNetV2 (5 classes, bf16 autocast, channels_last,
random images, random encoded targets) for each variant, interleaved round by round in one process, and
prints the median seconds per step and the ratio to the first variant. A variant is ``w<width>`` with an
optional ``+fp32dw`` (its strided depthwise convolutions in float32, what a CPU bf16 run does by itself:
:mod:`ssd_lightning.models.cpu_bf16`). Figures: docs/benchmarks.md.

    python benchmarks/benchmark_cpu_step.py
    python benchmarks/benchmark_cpu_step.py --variants w1.0 w1.0+fp32dw w0.5 w0.5+fp32dw --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/benchmark_cpu_step.py` from any folder
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ssd_lightning.models import SSDLoss, dboxes300_coco, ssd300  # noqa: E402
from ssd_lightning.models.cpu_bf16 import run_strided_depthwise_in_float32  # noqa: E402
from ssd_lightning.tables import markdown_table  # noqa: E402

NUM_BOXES = 8732


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["w1.0", "w1.0+fp32dw", "w0.5", "w0.5+fp32dw", "w0.35+fp32dw"],
        help="w<width>[+fp32dw] each; ratios are to the first",
    )
    parser.add_argument("--batch", type=int, default=8, help="images per step (the demo's 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (this box has 2 cores)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (one step per variant each)")
    return parser.parse_args(argv)


def parse_variant(name: str) -> tuple[float, bool]:
    width, _, extra = name.partition("+")
    if not width.startswith("w") or extra not in ("", "fp32dw"):
        raise SystemExit(f"bad variant {name!r}: expected w<width> or w<width>+fp32dw, e.g. w0.5+fp32dw")
    return float(width[1:]), extra == "fp32dw"


def random_batch(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed random images (channels_last) and encoded targets: boxes (cx, cy, w, h) in (0.25, 0.75), ~1 %
    of the default boxes positive."""
    g = torch.Generator().manual_seed(1)
    images = torch.randn(size, 3, 300, 300, generator=g).contiguous(memory_format=torch.channels_last)
    boxes = torch.rand(size, 4, NUM_BOXES, generator=g) * 0.5 + 0.25
    positive = torch.rand(size, NUM_BOXES, generator=g) < 0.01
    labels = positive.long() * torch.randint(1, 5, (size, NUM_BOXES), generator=g)
    return images, boxes, labels


class Step:
    """One variant's network, optimizer and loss, stepping on fixed random data."""

    def __init__(self, name: str, images: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor) -> None:
        width, fp32_depthwise = parse_variant(name)
        torch.manual_seed(0)
        self.net = ssd300(
            backbone="mobilenet_v2", num_classes=5, width_mult=width, background_prior=0.99,
            zero_init_residual=True,
        ).to(memory_format=torch.channels_last)  # fmt: skip
        if fp32_depthwise:
            run_strided_depthwise_in_float32(self.net)
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=1e-4)
        self.loss_fn = SSDLoss(dboxes300_coco())
        self.images, self.boxes, self.labels = images, boxes, labels

    def __call__(self) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            locs, logits = self.net(self.images)
        loss = self.loss_fn(locs.float(), logits.float(), self.boxes, self.labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name in args.variants:
        parse_variant(name)
    torch.set_num_threads(args.threads)
    batch = random_batch(args.batch)
    steps = {name: Step(name, *batch) for name in args.variants}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in args.variants}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(step())
    base = statistics.median(times[args.variants[0]])
    rows = []
    for name in args.variants:
        median = statistics.median(times[name])
        rows.append([name, f"{median:.3f}", f"{args.batch / median:.1f}", f"{median / base:.3f}"])
    print(
        f"SSD300-MobileNetV2 training step, batch {args.batch}, bf16 autocast, channels_last, "
        f"{args.threads} threads, median of {args.repeats}"
    )
    print(markdown_table(["variant", "s/step", "img/s", "vs first"], rows, align="lrrr"))


if __name__ == "__main__":
    main()
