"""The demo's training step with and without `reuse_host_memory`, side by side.

Each round starts two child processes, one per side (order alternating round by round): each runs the
demo detector's bare training step (``benchmark_cpu_step.py``'s, width 0.5 with float32 strided depthwise,
as a CPU bf16 run does) ``--steps`` times after a warm-up, and reports its median seconds per step, the
minor page faults per step and its peak resident memory. The side ``reuse`` calls
:func:`ssd_lightning.cli.host_memory.reuse_host_memory` before importing torch, as ``train.py`` does; the
settings are process-wide and cannot be undone, hence one process per measurement. Figures:
docs/benchmarks.md, "Host memory".

    python benchmarks/benchmark_host_memory.py
    python benchmarks/benchmark_host_memory.py --rounds 4 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/benchmark_host_memory.py` from any folder
    sys.path.insert(0, str(REPO))

from ssd_lightning.cli.host_memory import TORCH_HUGE_PAGES, reuse_host_memory  # noqa: E402
from ssd_lightning.tables import markdown_table  # noqa: E402

SIDES = ("default", "reuse")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="child processes per side")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per child")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per child")
    parser.add_argument("--batch", type=int, default=8, help="images per step (the demo's 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (this box has 2 cores)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)  # one measurement, in a child
    return parser.parse_args(argv)


def measure(side: str, args: argparse.Namespace) -> dict[str, float]:
    """Run in a child: the bare step ``args.steps`` times; its median time, faults per step, peak RSS."""
    if side == "reuse":
        reuse_host_memory()  # before torch, as train.py does
    import torch
    from benchmark_cpu_step import Step, random_batch  # this script's folder is first on sys.path

    torch.set_num_threads(args.threads)
    step = Step("w0.5+fp32dw", *random_batch(args.batch))
    for _ in range(args.warmup):
        step()
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [step() for _ in range(args.steps)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "s_per_step": statistics.median(times),
        "faults_per_step": faults / args.steps,
        "peak_gib": peak_kib / 2**20,
    }


def run_child(side: str, args: argparse.Namespace) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != TORCH_HUGE_PAGES}  # each side decides for itself
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    argv = [
        *(sys.executable, __file__, "--child", side, "--steps", str(args.steps)),
        *("--warmup", str(args.warmup), "--batch", str(args.batch), "--threads", str(args.threads)),
    ]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the {side} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return
    results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            results[side].append(run_child(side, args))
    base = statistics.median(r["s_per_step"] for r in results["default"])
    rows = []
    for side in SIDES:
        per_child = [r["s_per_step"] for r in results[side]]
        median = statistics.median(per_child)
        rows.append([
            side,
            " / ".join(f"{t:.3f}" for t in per_child),
            f"{median:.3f}",
            f"{median / base:.3f}",
            f"{statistics.median(r['faults_per_step'] for r in results[side]):,.0f}",
            f"{max(r['peak_gib'] for r in results[side]):.2f}",
        ])  # fmt: skip
    print(
        f"SSD300-MobileNetV2 0.5 training step, batch {args.batch}, bf16, {args.threads} threads: "
        f"{args.rounds} processes per side, {args.steps} steps each (order alternating)"
    )
    print(markdown_table(
        ["side", "s/step per process", "median s/step", "vs default", "page faults/step", "peak GiB"],
        rows,
        align="llrrrr",
    ))  # fmt: skip


if __name__ == "__main__":
    main()
