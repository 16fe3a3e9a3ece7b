"""Fine-tuning vs from scratch at equal steps: does ``model.init_from`` pay off on a new class set?

Three runs of ``python train.py experiment=demo``: (a) the demo on its own data, ``--source-epochs``
epochs (skipped with ``--source-ckpt``); (b) a shapes variant of other classes (``--categories``) with
``model.init_from=<(a)'s last.ckpt>``; (c) (b)'s command without ``model.init_from``. Prints the commands
and a side-by-side table: steps (from each ``last.ckpt``), the last COCO AP@0.5 and AP@[.5:.95] (from
each ``csv/metrics.csv``) and the ratio (b) / (c). Figures: docs/benchmarks.md.

    python benchmarks/benchmark_finetune.py --parallel
    python benchmarks/benchmark_finetune.py --source-ckpt outputs/demo/<run>/checkpoints/last.ckpt
    python benchmarks/benchmark_finetune.py --dry-run            # print the commands only
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ssd_lightning.tables import markdown_table

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CATEGORIES = ("cross", "hexagon", "arrow")


@dataclass
class Run:
    """One ``train.py`` invocation: its name, overrides (after ``experiment=demo``) and run directory."""

    name: str
    overrides: list[str]
    run_dir: Path

    def command(self) -> list[str]:
        return ["python", "train.py", "experiment=demo", *self.overrides, f"hydra.run.dir={self.run_dir}"]


@dataclass
class Result:
    steps: int
    ap50: float
    ap: float
    minutes: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ssd_lightning.data.shapes import SHAPE_CATALOGUE

    names = [c["name"] for c in SHAPE_CATALOGUE]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--source-ckpt",
        type=Path,
        default=None,
        help="a Lightning checkpoint of the demo to fine-tune from (skips run (a))",
    )
    parser.add_argument("--source-epochs", type=int, default=1, help="epochs of run (a) (default 1)")
    parser.add_argument(
        "--categories",
        nargs="+",
        choices=names,
        default=list(DEFAULT_CATEGORIES),
        metavar="NAME",
        help=f"class set of the variant, from {names} (default: %(default)s)",
    )
    parser.add_argument(
        "--num-train", type=int, default=800, help="variant train images (default 800: 95 steps/epoch)"
    )
    parser.add_argument("--num-val", type=int, default=200, help="variant held-out images (default 200)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of runs (b) and (c) (default 2)")
    parser.add_argument("--seed", type=int, default=42, help="seed of every run (default 42)")
    parser.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="variant dataset folder (default data/shapes_<categories>; generated on first use)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of the three run directories (default outputs/benchmark_finetune/<date>_<time>)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every run (repeatable), e.g. --override data.num_threads=2",
    )
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="run (b) and (c) at the same time, each with OMP_NUM_THREADS=1 (a busy or many-core machine)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    for key in ("source_epochs", "num_train", "num_val", "epochs"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if len(set(args.categories)) != len(args.categories):
        parser.error(f"--categories names a class twice: {args.categories}")
    if args.source_ckpt is not None and not args.source_ckpt.is_file():
        parser.error(f"--source-ckpt {args.source_ckpt}: no such file")
    return args


def build_runs(args: argparse.Namespace, stamp: str | None = None) -> tuple[Run | None, Run, Run, Path]:
    """The runs (a) (``None`` with ``--source-ckpt``), (b), (c) and the checkpoint (b) starts from."""
    from ssd_lightning.data.shapes import dataset_folder_name, resolve_categories

    categories = resolve_categories(args.categories)  # id order: the same dataset whatever the order given
    stamp = stamp or time.strftime("%Y-%m-%d_%H-%M-%S")
    out = args.out if args.out is not None else Path("outputs") / "benchmark_finetune" / stamp
    data_root = (
        args.data_root if args.data_root is not None else Path("data") / dataset_folder_name(categories)
    )
    common = [f"seed={args.seed}", *args.override]
    source = None
    if args.source_ckpt is None:
        source = Run("source", [f"trainer.max_epochs={args.source_epochs}", *common], out / "source")
        source_ckpt = source.run_dir / "checkpoints" / "last.ckpt"
    else:
        source_ckpt = args.source_ckpt
    target = [
        f"data.root={data_root}",
        f"data.categories=[{','.join(categories)}]",
        f"data.num_train={args.num_train}",
        f"data.num_val={args.num_val}",
        f"model.net.num_classes={len(categories) + 1}",
        f"trainer.max_epochs={args.epochs}",
        *common,
    ]
    finetune = Run("fine-tuned", [*target, f"model.init_from={source_ckpt}"], out / "finetune")
    scratch = Run("from scratch", target, out / "scratch")
    return source, finetune, scratch, source_ckpt


def read_result(run_dir: Path, minutes: float = math.nan) -> Result:
    """Steps from ``<run_dir>/checkpoints/last.ckpt``; the last COCO AP@0.5 and AP of ``csv/metrics.csv``."""
    from ssd_lightning.io.weights import read_checkpoint
    from ssd_lightning.metrics_csv import read_last_metrics

    steps = int(read_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"])
    metrics = read_last_metrics(run_dir / "csv" / "metrics.csv", ["val/mAP", "val/mAP_50"])
    if "val/mAP" not in metrics or "val/mAP_50" not in metrics:
        raise RuntimeError(f"{run_dir / 'csv' / 'metrics.csv'} has no val/mAP: the run was not evaluated")
    return Result(steps, metrics["val/mAP_50"], metrics["val/mAP"], minutes)


def execute(runs: list[Run], env: dict[str, str] | None = None) -> list[Result]:
    """Run ``runs`` at the same time from the repository root (output in ``<run_dir>.out``), wait for all,
    raise if one fails."""
    started = []
    for run in runs:
        (REPO / run.run_dir).parent.mkdir(parents=True, exist_ok=True)
        log_path = REPO / run.run_dir.parent / f"{run.run_dir.name}.out"
        print(f"[{time.strftime('%H:%M:%S')}] {run.name}: {shlex.join(run.command())}", flush=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, *run.command()[1:]],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        started.append((run, proc, log_path, time.perf_counter()))
    return [_finish(*item) for item in started]


def _finish(run: Run, proc: subprocess.Popen, log_path: Path, start: float) -> Result:
    proc.wait()
    minutes = (time.perf_counter() - start) / 60
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{run.name} failed (exit {proc.returncode}); end of {log_path}:\n{tail}")
    result = read_result(REPO / run.run_dir, minutes)
    print(
        f"[{time.strftime('%H:%M:%S')}] {run.name}: {result.steps} steps in {minutes:.1f} min, "
        f"AP@0.5 {result.ap50:.3f}, AP {result.ap:.3f}",
        flush=True,
    )
    return result


def format_table(source: Result | None, finetune: Result, scratch: Result, source_ckpt: Path) -> str:
    """Markdown table: (a), (b), (c) and the ratio (b) / (c) of each AP."""

    def row(name: str, r: Result) -> list[str]:
        minutes = "" if math.isnan(r.minutes) else f"{r.minutes:.1f}"
        return [name, str(r.steps), f"{r.ap50:.3f}", f"{r.ap:.3f}", minutes]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b > 0 else "n/a (from scratch at 0)"

    rows = []
    if source is not None:
        rows.append(row("(a) source: the demo on data/shapes (4 classes; its own val split)", source))
    rows += [
        row(f"(b) fine-tuned from {source_ckpt.name} (`model.init_from`)", finetune),
        row("(c) from scratch, same command otherwise", scratch),
        ["(b) / (c)", "", ratio(finetune.ap50, scratch.ap50), ratio(finetune.ap, scratch.ap), ""],
    ]
    return markdown_table(("run", "steps", "AP@0.5", "AP@[.5:.95]", "minutes (run)"), rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source, finetune, scratch, source_ckpt = build_runs(args)
    runs = [r for r in (source, finetune, scratch) if r is not None]
    commands = "\n".join(shlex.join(r.command()) for r in runs)
    if args.dry_run:
        print(commands)
        return 0
    results = {}
    if source is not None:
        results["source"] = execute([source])[0]
    if args.parallel:
        both = execute([finetune, scratch], env={"OMP_NUM_THREADS": "1"})
    else:
        both = [execute([finetune])[0], execute([scratch])[0]]
    results[finetune.name], results[scratch.name] = both
    if results[finetune.name].steps != results[scratch.name].steps:
        raise SystemExit(
            f"steps differ: fine-tuned {results[finetune.name].steps}, from scratch "
            f"{results[scratch.name].steps}; the comparison is only meaningful at equal steps"
        )
    print("\nCommands (from the repository root):\n" + commands + "\n")
    table = format_table(results.get("source"), results[finetune.name], results[scratch.name], source_ckpt)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
