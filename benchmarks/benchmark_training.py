"""Lightning path vs a bare PyTorch loop on this machine: same model, data, optimizer and precision.

Rows:
  * training img/s: ``run_benchmark_task("benchmark_training")`` (SSDLitModule + ThroughputBenchmark) vs a
    plain loop doing forward + loss under autocast, backward, optimizer step, zero_grad;
  * inference img/s (forward + decode/NMS): ``run_benchmark_task("benchmark_inference")`` vs a plain
    ``inference_mode`` loop;
  * the Lightning training path in fp32 and with channels_last, against the main precision.
``--precision auto`` (the default) is train.py's rule: bf16 where the CPU has native bf16 kernels, float32
where it does not (bf16 runs 10-15x slower there); bf16 rows are only run there or when asked for.
Both sides time the same region (batch already in memory; clock read at iteration start and end) and run
alternately (L, B, B, L, ...) ``--repeats`` times; the medians pool every timed iteration of a variant.

    .venv/bin/python benchmarks/benchmark_training.py                      # resnet18, batch 8, 5 + 20
    .venv/bin/python benchmarks/benchmark_training.py --backbone mobilenet_v2 --iterations 50 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch

from ssd_lightning.callbacks.throughput import ThroughputBenchmark, device_name, throughput_statistics
from ssd_lightning.cli.benchmark import run_benchmark_task
from ssd_lightning.data.synthetic import SyntheticDetectionDataModule
from ssd_lightning.models import BoxCoder, SSDLoss, dboxes300_coco, ssd300
from ssd_lightning.models.cpu_bf16 import cpu_has_native_bf16, run_strided_depthwise_in_float32
from ssd_lightning.modules.ssd import SSDLitModule
from ssd_lightning.optim import build_optimizer
from ssd_lightning.tables import markdown_table

PRECISIONS = {"bf16": ("bf16-mixed", "bfloat16"), "fp32": ("32-true", "float32")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default="resnet18", help="resnet18|34|50|101|152|mobilenet_v2")
    p.add_argument("--batch-size", type=int, default=8, help="training and inference batch")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per run")
    p.add_argument("--iterations", type=int, default=20, help="timed iterations per run")
    p.add_argument("--repeats", type=int, default=2, help="runs per side, alternating the order")
    p.add_argument(
        "--precision",
        choices=["auto", *sorted(PRECISIONS)],
        default="auto",
        help="main precision; auto: bf16 on CPUs with native bf16 kernels, else fp32 (as train.py)",
    )
    p.add_argument("--num-classes", type=int, default=81)
    p.add_argument("--lr", type=float, default=2.6e-3)
    p.add_argument("--skip-inference", action="store_true")
    p.add_argument("--skip-variants", action="store_true", help="no fp32 / channels_last rows")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    if min(args.batch_size, args.iterations, args.repeats) < 1 or args.warmup < 0:
        p.error("--batch-size, --iterations, --repeats must be >= 1 and --warmup >= 0")
    if args.precision == "auto":
        args.precision = "bf16" if cpu_has_native_bf16() else "fp32"
    return args


def _optimizer(lr: float) -> Callable[..., torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, lr=lr, momentum=0.9, weight_decay=5e-4)


def _net(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    return ssd300(backbone=args.backbone, num_classes=args.num_classes)


def _datamodule(args: argparse.Namespace, dtype: str) -> SyntheticDetectionDataModule:
    dm = SyntheticDetectionDataModule(
        batch_size=args.batch_size,
        eval_batch_size=args.batch_size,
        num_classes=args.num_classes,
        steps_per_epoch=args.warmup + args.iterations,
        output_dtype=dtype,
        seed=0,
    )
    dm.setup("fit")
    return dm


# --------------------------------------------------------------------------------------------------------
# Lightning path
# --------------------------------------------------------------------------------------------------------
def lightning_run(args: argparse.Namespace, task: str, precision: str, channels_last: bool) -> list[float]:
    """Per-iteration seconds of one ``run_benchmark_task`` run."""
    trainer_precision, dtype = PRECISIONS[precision]
    callback = ThroughputBenchmark(warmup=args.warmup, iterations=args.iterations, print_table=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision=trainer_precision,
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = SSDLitModule(
        _net(args), optimizer=_optimizer(args.lr), lr_scaling={"rule": "none"}, channels_last=channels_last
    )
    out = Path("outputs") / "benchmark_training_script"
    run_benchmark_task(
        task,
        trainer=trainer,
        model=model,
        datamodule=_datamodule(args, dtype),
        output_dir=out,
        config_summary={"backbone": args.backbone, "script": "benchmark_training.py"},
    )
    return callback.iteration_times


# --------------------------------------------------------------------------------------------------------
# Bare PyTorch loops (what one would write by hand)
# --------------------------------------------------------------------------------------------------------
def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


def bare_training(args: argparse.Namespace, precision: str, channels_last: bool) -> list[float]:
    net = _net(args)
    if precision == "bf16":  # what the Lightning module does on a CPU with bf16-mixed (no-op for ResNets)
        run_strided_depthwise_in_float32(net)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    net.to(memory_format=memory_format).train()
    loss_fn = SSDLoss(dboxes300_coco())
    opt = build_optimizer(
        functools.partial(torch.optim.SGD, momentum=0.9), net, lr=args.lr, weight_decay=5e-4
    )
    batches = list(_datamodule(args, PRECISIONS[precision][1]).train_dataloader())
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        with _autocast(precision):
            locs, logits = net(batch["images"].contiguous(memory_format=memory_format))
            gt_boxes = batch["boxes"].transpose(1, 2)
            loss = loss_fn(locs.float(), logits.float(), gt_boxes.float(), batch["labels"].long())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def bare_inference(args: argparse.Namespace, precision: str) -> list[float]:
    net = _net(args).eval()
    coder = BoxCoder(dboxes300_coco())
    batches = list(_datamodule(args, PRECISIONS[precision][1]).val_dataloader())
    times = []
    with torch.inference_mode():
        for i, batch in enumerate(batches):
            start = time.perf_counter()
            with _autocast(precision):
                locs, logits = net(batch["images"])
            detections = coder.decode(locs.float(), logits.float())  # the default settings, as the module
            sizes = batch["image_sizes"].float()
            scale = torch.stack([sizes[:, 1], sizes[:, 0], sizes[:, 1], sizes[:, 0]], dim=1)
            _ = [d["boxes"] * scale[k] for k, d in enumerate(detections)]
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    return times


# --------------------------------------------------------------------------------------------------------
def _stats(times: list[float], batch: int) -> dict[str, float]:
    t = torch.tensor([times], dtype=torch.float64)
    return throughput_statistics(t, torch.full_like(t, batch, dtype=torch.int64))


def side_by_side(args, name: str, ours: Callable[[], list[float]], bare: Callable[[], list[float]]) -> dict:
    ours_times, bare_times = [], []
    for r in range(args.repeats):
        order = [(ours, ours_times), (bare, bare_times)]
        for fn, sink in order if r % 2 == 0 else reversed(order):
            sink.extend(fn())
        print(f"  {name}: repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    o, b = _stats(ours_times, args.batch_size), _stats(bare_times, args.batch_size)
    return {"name": name, "lightning": o, "bare": b}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    p = args.precision
    rows = [
        side_by_side(
            args,
            f"training {p}",
            lambda: lightning_run(args, "benchmark_training", p, False),
            lambda: bare_training(args, p, False),
        )
    ]
    if not args.skip_inference:
        rows.append(
            side_by_side(
                args,
                f"inference {p} (forward + decode)",
                lambda: lightning_run(args, "benchmark_inference", p, False),
                lambda: bare_inference(args, p),
            )
        )
    variants = []
    if not args.skip_variants:
        other = "fp32" if p == "bf16" else "bf16"
        candidates = [(f"training {other}", other, False), (f"training {p} channels_last", p, True)]
        if other == "bf16" and not cpu_has_native_bf16():
            print("  no bf16 row: this CPU has no native bf16 kernels", file=sys.stderr, flush=True)
            candidates = candidates[1:]
        for name, precision, cl in candidates:
            times = [
                t
                for _ in range(args.repeats)
                for t in lightning_run(args, "benchmark_training", precision, cl)
            ]
            variants.append({"name": name, "lightning": _stats(times, args.batch_size)})
            print(f"  {name} done", file=sys.stderr, flush=True)

    head = (
        f"SSD300 {args.backbone}, batch {args.batch_size}, {args.warmup} warm-up + {args.iterations} timed "
        f"iterations x {args.repeats} runs per side; {device_name(torch.device('cpu'))}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, Lightning {pl.__version__}, "
        f"Python {platform.python_version()}"
    )
    table_rows = []
    for row in rows:
        o, b = row["lightning"], row["bare"]
        ratio = o["images_per_second_median"] / b["images_per_second_median"]
        mean_ratio = o["images_per_second_mean"] / b["images_per_second_mean"]
        row["ratio"] = ratio
        table_rows.append([
            row["name"], f"{o['images_per_second_median']:.2f}", f"{b['images_per_second_median']:.2f}",
            f"{ratio:.3f}", f"{mean_ratio:.3f}",
        ])  # fmt: skip
    columns = ["measurement", "Lightning img/s (median)", "bare PyTorch img/s (median)", "ratio"]
    lines = [head, "", markdown_table([*columns, "Lightning / bare mean"], table_rows)]
    if variants:
        base = rows[0]["lightning"]["images_per_second_median"]
        table = [[f"training {p}", f"{base:.2f}", "1.000"]]
        for v in variants:
            m = v["lightning"]["images_per_second_median"]
            table.append([v["name"], f"{m:.2f}", f"{m / base:.3f}"])
        lines += ["", markdown_table(["Lightning training", "img/s (median)", f"vs training {p}"], table)]
    print("\n".join(lines), flush=True)
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "header": head,
        "rows": rows,
        "variants": variants,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
