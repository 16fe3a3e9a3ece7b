"""The GPU throughput matrix: SSD300-ResNet50 and MobileNetV2, training and inference, several batches.

Each row is the ``benchmark_training`` / ``benchmark_inference`` task of ``train.py`` (same configs, same
``ThroughputBenchmark``), composed with Hydra's compose API and run in this process (imports paid once);
its equivalent ``python train.py ...`` command is printed. Rows run in priority order under a time budget:
rows past it are listed as skipped; ``results.json`` and ``summary.md`` are rewritten after every row.
Columns: median img/s; the NVIDIA reference figure (SSD300-ResNet50 only); the compute bound
``peak FLOP/s / FLOP per image`` (forward FLOPs counted on the meta device, training = 3 x forward) and the
fraction of it reached. Figures and the bound's assumptions: docs/benchmarks.md. Needs ``pip install -e .``.

    bash benchmarks/gpu_benchmark.sh                     # this, with a log and a hard stop
    python benchmarks/gpu_benchmark.py --out gpu_results
    python benchmarks/gpu_benchmark.py --smoke           # CPU: ResNet-18, batch 2, 1 + 3 iterations
    python benchmarks/gpu_benchmark.py --dry-run         # the plan and its train.py commands, nothing run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ssd_lightning.tables import markdown_table

REPO_ROOT = Path(__file__).resolve().parents[1]

REFERENCE_IMG_S = {"training": 724.0, "inference": 1057.0}  # NVIDIA SSD300 v1.1, 1xA100 AMP (bs128 / bs64)
REFERENCE_NOTE = {"training": "1xA100 AMP bs128", "inference": "1xA100 AMP bs64"}
GOAL_IMG_S = {"training": 2500.0, "inference": 6000.0}  # issue #8, SSD300-ResNet50 on one H200
TRAINING_FLOP_FACTOR = 3.0  # forward + backward (2x forward)
DEFAULT_PEAK_TFLOPS = 790.0  # H200 bf16 dense: an assumed achievable rate (docs/benchmarks.md)
EXPERIMENTS = {
    ("ssd300", "training"): "ssd300_benchmark_training",
    ("ssd300", "inference"): "ssd300_benchmark_inference",
    ("mobilenetv2", "training"): "mobilenetv2_benchmark_training",
    ("mobilenetv2", "inference"): "mobilenetv2_benchmark_inference",
}
IMAGE_SIZE = {"ssd300": 300, "mobilenetv2": 224}


@dataclasses.dataclass(frozen=True)
class Run:
    """One row: a benchmark task with its model, precision, batch and speed switches."""

    model: str  # ssd300 | mobilenetv2
    backbone: str | None  # SSD300 backbone; None for MobileNetV2
    mode: str  # training | inference
    precision: str  # bf16 | fp16 | fp32 (configs/precision)
    batch: int
    channels_last: bool = True
    compile: bool = False
    fused_sgd: bool = False  # SGD(fused=True): with fp16 the GradScaler then has no per-step .item()

    @property
    def name(self) -> str:
        net = f"{self.model}-{self.backbone}" if self.backbone else self.model
        parts = [net, self.mode, self.precision, f"bs{self.batch}"]
        parts += [] if self.channels_last else ["nchw"]
        parts += ["compile"] if self.compile else []
        parts += ["fusedsgd"] if self.fused_sgd else []
        return "_".join(parts)

    @property
    def label(self) -> str:
        """Model as the table names it: ``SSD300-ResNet50``, ``SSD300-ResNet18``, ``MobileNetV2``."""
        name = "MobileNetV2"
        if self.backbone:
            name = "SSD300-" + self.backbone.replace("resnet", "ResNet")
        return name + (" (fused SGD)" if self.fused_sgd else "")


def plan(smoke: bool, *, compile_runs: bool, batches: Sequence[int] | None = None) -> list[Run]:
    """Rows in priority order (a budget cut drops the tail)."""
    if smoke:  # every switch once, on a small model: a CPU check of the whole path
        n = (batches or [2])[0]
        return [
            Run("ssd300", "resnet18", "training", "bf16", n),
            Run("ssd300", "resnet18", "inference", "bf16", n),
            Run("ssd300", "resnet18", "training", "fp16", n, channels_last=False, fused_sgd=True),
            Run("mobilenetv2", None, "training", "bf16", n),
            Run("mobilenetv2", None, "inference", "bf16", n),
            *([Run("ssd300", "resnet18", "training", "bf16", n, compile=True)] if compile_runs else []),
        ]
    b = list(batches or [64, 128, 256])
    runs = []
    for precision in ("bf16", "fp16"):
        runs += [Run("ssd300", "resnet50", "training", precision, n) for n in b]
        runs += [Run("ssd300", "resnet50", "inference", precision, n) for n in b]
    runs += [Run("mobilenetv2", None, m, "bf16", 256) for m in ("training", "inference")]
    runs += [
        Run("ssd300", "resnet50", "training", "fp16", 128, fused_sgd=True),
        Run("ssd300", "resnet50", "training", "bf16", 128, channels_last=False),
    ]
    if compile_runs:
        runs += [
            Run("ssd300", "resnet50", "training", "bf16", 128, compile=True),
            Run("ssd300", "resnet50", "inference", "bf16", 64, compile=True),
        ]
    return runs


def overrides(run: Run, *, warmup: int, iterations: int) -> list[str]:
    """``train.py`` overrides of a row (without the output directory)."""
    batch_key = "data.batch_size" if run.mode == "training" else "data.eval_batch_size"
    items = [
        f"experiment={EXPERIMENTS[(run.model, run.mode)]}",
        f"precision={run.precision}",
        f"{batch_key}={run.batch}",
        f"model.channels_last={str(run.channels_last).lower()}",
        f"compile={str(run.compile).lower()}",
        f"benchmark_warmup={warmup}",
        f"benchmark_iterations={iterations}",
        f"data.steps_per_epoch={warmup + iterations}",
    ]
    if run.backbone:
        items.insert(1, f"model.net.backbone={run.backbone}")
    if run.fused_sgd:
        items.append("+model.optimizer.fused=true")
    if run.mode == "training":  # the other split's batches are generated too: keep them small
        items.append(f"data.eval_batch_size={min(run.batch, 8)}")
    else:
        items.append(f"data.batch_size={min(run.batch, 8)}")
    return items


def command_line(run: Run, *, warmup: int, iterations: int) -> str:
    return "python train.py " + " ".join(overrides(run, warmup=warmup, iterations=iterations))


# --------------------------------------------------------------------------------------------------------
# FLOPs and bounds
# --------------------------------------------------------------------------------------------------------
def forward_gflop(model: str, backbone: str | None) -> float:
    """Forward GFLOP of one image (2 FLOP per multiply-add), counted on the meta device (no memory)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ssd_lightning.models import mobilenet_v2, ssd300

    size = IMAGE_SIZE[model]
    with torch.device("meta"):
        if model == "ssd300":
            net = ssd300(backbone=backbone, num_classes=81)
        else:
            net = mobilenet_v2(num_classes=1000)
        net.eval()
        x = torch.empty(1, 3, size, size)
    with FlopCounterMode(display=False) as counter:
        net(x)
    return counter.get_total_flops() / 1e9


def bound_img_s(gflop_forward: float, mode: str, peak_tflops: float) -> float:
    """Images/s a device of ``peak_tflops`` could reach if it did nothing but the model's FLOPs."""
    per_image = gflop_forward * (TRAINING_FLOP_FACTOR if mode == "training" else 1.0)
    return peak_tflops * 1e3 / per_image


# --------------------------------------------------------------------------------------------------------
# Running one row in-process
# --------------------------------------------------------------------------------------------------------
def _compose(run_overrides: list[str], output_dir: Path):
    """The composed ``train.yaml`` config, as ``train.py`` would build it (hydra runtime keys filled in)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    config_dir = str(REPO_ROOT / "configs")
    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="gpu_benchmark"):
        cfg = compose(
            config_name="train",
            overrides=[*run_overrides, f"paths.output_dir={output_dir}"],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.callbacks.throughput.print_table = False  # one summary table at the end instead
    return cfg


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_one(run: Run, *, warmup: int, iterations: int, runs_dir: Path) -> dict[str, Any]:
    """Run one row; returns a record with ``status`` ok/failed, the ``benchmark.json`` content and timings."""
    from ssd_lightning.cli.train import train

    out_dir = runs_dir / run.name
    items = overrides(run, warmup=warmup, iterations=iterations)
    record: dict[str, Any] = {
        "name": run.name,
        "run": dataclasses.asdict(run),
        "command": command_line(run, warmup=warmup, iterations=iterations),
        "output_dir": str(out_dir),
    }
    started = time.perf_counter()
    try:
        if run.compile:
            torch.compiler.reset()  # a fresh compile per row: no recompiles for a new batch size
        cfg = _compose(items, out_dir)
        train(cfg)
        with open(out_dir / "benchmark.json", encoding="utf-8") as f:
            record["benchmark"] = json.load(f)
        record["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one failed row (OOM, compile error) must not end the table
        record["status"] = "failed"
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        record["traceback"] = traceback.format_exc(limit=8)
    finally:
        _release_memory()
    record["wall_s"] = time.perf_counter() - started
    return record


# --------------------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str | None = None) -> str:
    """``–`` for missing values; thousands separators; one decimal below 100 (CPU smoke numbers)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec or (",.0f" if abs(value) >= 100 else ".1f"))


def enrich(record: dict[str, Any], gflop: dict[str, float], peak_tflops: float) -> dict[str, Any]:
    """Add reference ratio, bound and fraction of bound to an ok record (in place; returned)."""
    run = record["run"]
    if record.get("status") != "ok":
        return record
    stats = record["benchmark"]["statistics"]
    img_s = float(stats["images_per_second_median"])
    key = f"{run['model']}-{run['backbone']}" if run["backbone"] else run["model"]
    bound = bound_img_s(gflop[key], run["mode"], peak_tflops)
    is_reference_model = run["model"] == "ssd300" and run["backbone"] == "resnet50"
    reference = REFERENCE_IMG_S[run["mode"]] if is_reference_model else None
    factor = TRAINING_FLOP_FACTOR if run["mode"] == "training" else 1.0
    record["derived"] = {
        "images_per_second_median": img_s,
        "reference_images_per_second": reference,
        "vs_reference": img_s / reference if reference else None,
        "bound_images_per_second": bound,
        "fraction_of_bound": img_s / bound,
        "achieved_tflops": img_s * gflop[key] * factor / 1e3,
        "goal_images_per_second": GOAL_IMG_S[run["mode"]] if is_reference_model else None,
    }
    return record


TABLE_COLUMNS = (
    *("model", "mode", "precision", "batch", "channels_last", "compile", "img/s median", "img/s p90"),
    *("vs reference", "bound img/s", "of bound", "TFLOP/s", "peak GiB", "status"),
)


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """Markdown table, one row per planned run (skipped and failed rows included, ``–`` for no value)."""
    rows = []
    for r in records:
        run = r["run"]
        cells = [Run(**run).label, run["mode"], run["precision"], run["batch"]]
        cells += [str(run["channels_last"]).lower(), str(run["compile"]).lower()]
        if r.get("status") == "ok":
            s, d = r["benchmark"]["statistics"], r["derived"]
            ref = d["reference_images_per_second"]
            cells += [
                _fmt(d["images_per_second_median"]),
                _fmt(s["images_per_second_p90"]),
                f"{d['vs_reference']:.2f}x of {ref:,.0f}" if ref else None,
                _fmt(d["bound_images_per_second"]),
                f"{100 * d['fraction_of_bound']:.1f}%",
                _fmt(d["achieved_tflops"], ".1f"),
                _fmt(r["benchmark"]["peak_memory_bytes"] / 2**30, ".1f"),
                "ok",
            ]
        else:
            cells += [None] * 7 + [r.get("status", "?") + (f": {r['error']}" if r.get("error") else "")]
        rows.append(cells)
    return markdown_table(TABLE_COLUMNS, rows, align="lllrll" + "r" * 7 + "l", missing="–")


def goal_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """Best SSD300-ResNet50 img/s per mode against the issue's goals and the reference."""
    lines = []
    for mode in ("training", "inference"):
        ok = [r for r in records if r.get("status") == "ok" and r["derived"]["goal_images_per_second"]]
        ok = [r for r in ok if r["run"]["mode"] == mode]
        if not ok:
            continue
        best = max(ok, key=lambda r: r["derived"]["images_per_second_median"])
        d = best["derived"]
        lines.append(
            f"best SSD300-ResNet50 {mode}: {d['images_per_second_median']:,.0f} img/s ({best['name']}); "
            f"{d['vs_reference']:.2f}x the reference {REFERENCE_IMG_S[mode]:,.0f} ({REFERENCE_NOTE[mode]}); "
            f"{100 * d['fraction_of_bound']:.1f}% of the {d['bound_images_per_second']:,.0f} img/s bound; "
            f"goal {d['goal_images_per_second']:,.0f}: "
            f"{'met' if d['images_per_second_median'] >= d['goal_images_per_second'] else 'NOT met'}"
        )
    return lines


def write_outputs(out: Path, header: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """Rewrite ``results.json`` and ``summary.md`` under ``out``; return the summary text."""
    text = "\n".join(
        [
            f"# GPU benchmark: {header['device_name']} (torch {header['torch_version']})",
            "",
            f"warm-up {header['warmup']} + {header['iterations']} timed iterations per row; peak "
            f"{header['peak_tflops']:g} TFLOP/s; forward GFLOP/image: "
            + ", ".join(f"{k} {v:.1f}" for k, v in header["forward_gflop"].items()),
            "",
            format_table(records),
            "",
            *goal_lines(records),
            "",
            "Commands (add paths.output_dir=... to place the run):",
            *[f"  {r['name']}: {r['command']}" for r in records],
        ]
    )
    payload = {**header, "runs": records}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    tmp.replace(out / "results.json")
    (out / "summary.md").write_text(text + "\n", encoding="utf-8")
    return text


# --------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_results"))
    p.add_argument("--smoke", action="store_true", default=os.environ.get("GPU_BENCH_SMOKE") == "1")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (20; smoke 1)")
    p.add_argument("--iterations", type=int, default=None, help="timed iterations (50; smoke 3)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="SSD300 batches (default 64 128 256)")
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_BENCH_BUDGET_S", "inf")))
    p.add_argument("--compile-estimate-s", type=float, default=150.0, help="assumed cost of a compiled row")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=float(os.environ.get("GPU_BENCH_PEAK_TFLOPS", DEFAULT_PEAK_TFLOPS)),
    )
    p.add_argument("--only", default=None, help="run only rows whose name contains this text")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its commands; run nothing")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 20
    if args.iterations is None:
        args.iterations = 3 if args.smoke else 50
    if args.warmup < 0 or args.iterations < 1:
        p.error("--warmup must be >= 0 and --iterations >= 1")
    return args


def _quiet_logs() -> None:
    """Warnings and errors only: Lightning's per-Trainer banners would bury the table."""
    import pytorch_lightning  # noqa: F401  (sets its loggers to INFO on import: override after)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("once")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    runs = plan(args.smoke, compile_runs=not args.no_compile and not args.smoke, batches=args.batches)
    if args.only:
        runs = [r for r in runs if args.only in r.name]
    if args.dry_run:
        for r in runs:
            print(f"{r.name}: {command_line(r, warmup=args.warmup, iterations=args.iterations)}")
        return 0
    _quiet_logs()
    out = args.out
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    from ssd_lightning.callbacks.throughput import device_name

    gflop = {}
    for r in runs:
        key = f"{r.model}-{r.backbone}" if r.backbone else r.model
        if key not in gflop:
            gflop[key] = forward_gflop(r.model, r.backbone)
    header = {
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "smoke": args.smoke,
        "warmup": args.warmup,
        "iterations": args.iterations,
        "peak_tflops": args.peak_tflops,
        "budget_s": args.budget_s,
        "forward_gflop": gflop,
    }
    print(
        f"{len(runs)} rows on {header['device_name']} "
        f"(torch {header['torch_version']}, CUDA {header['cuda']}); "
        f"budget {args.budget_s:.0f} s; forward GFLOP/image "
        + ", ".join(f"{k} {v:.1f}" for k, v in gflop.items()),
        flush=True,
    )
    records: list[dict[str, Any]] = []
    estimate = 0.0  # longest non-compiled row so far
    for i, run in enumerate(runs, 1):
        elapsed = time.perf_counter() - started
        cost = args.compile_estimate_s if run.compile else estimate
        if elapsed + cost > args.budget_s:
            records.append(
                {
                    "name": run.name,
                    "run": dataclasses.asdict(run),
                    "command": command_line(run, warmup=args.warmup, iterations=args.iterations),
                    "status": "skipped",
                    "error": f"budget ({elapsed:.0f} s used + ~{cost:.0f} s > {args.budget_s:.0f} s)",
                }
            )
            print(f"[{i}/{len(runs)}] {run.name}: skipped (budget)", flush=True)
            continue
        record = run_one(run, warmup=args.warmup, iterations=args.iterations, runs_dir=runs_dir)
        enrich(record, gflop, args.peak_tflops)
        records.append(record)
        if not run.compile:
            estimate = max(estimate, record["wall_s"])
        if record["status"] == "ok":
            d = record["derived"]
            print(
                f"[{i}/{len(runs)}] {run.name}: {d['images_per_second_median']:,.1f} img/s "
                f"({100 * d['fraction_of_bound']:.1f}% of bound) in {record['wall_s']:.0f} s",
                flush=True,
            )
        else:
            print(f"[{i}/{len(runs)}] {run.name}: FAILED {record['error']}", flush=True)
            print(record["traceback"], flush=True)
        write_outputs(out, header, records)
    header["wall_s"] = time.perf_counter() - started
    text = write_outputs(out, header, records)
    print("\n" + text, flush=True)
    written = f"{out / 'summary.md'}, {out / 'results.json'}, {runs_dir}/<row>/benchmark.json"
    print(f"\nwritten: {written}", flush=True)
    ok = sum(r["status"] == "ok" for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
