"""`make train`'s job at two commits, side by side: wall time, peak memory, AP@0.5 and AP per seed.

Runs ``python train.py experiment=demo seed=<s>`` from a checkout of ``--baseline`` (a git revision, checked
out with ``git worktree`` into the output folder) and from ``--candidate`` (default: this working tree), in
the order baseline, candidate, candidate, baseline, ... so that a machine drifting in speed hurts both sides
alike. Each side's dataset is generated before its first run, with that side's own generator and config,
and not timed (as ``make train`` after the dataset exists). Wall time is the whole ``train.py`` process;
peak memory its maximum resident set size; AP@0.5 and AP the best of the run's evaluations in
``csv/metrics.csv``. Prints the commands and a markdown table (ratios: candidate / baseline).
Figures: docs/benchmarks.md.

    python benchmarks/benchmark_demo.py --baseline e05b2f2 --seeds 42 43
    python benchmarks/benchmark_demo.py --baseline e05b2f2 --dry-run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/benchmark_demo.py` from any folder
    sys.path.insert(0, str(REPO))

from ssd_lightning.metrics_csv import read_metrics_csv  # noqa: E402
from ssd_lightning.tables import markdown_table  # noqa: E402

# Runs one command and prints its peak resident set size (KiB on Linux) as the last line.
_MEASURE = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:])\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(code)\n"
)
# Generates the dataset of the composed demo config with the checkout's own datamodule (untimed).
_PREPARE = (
    "import sys, hydra\n"
    "from hydra import compose, initialize_config_dir\n"
    "from ssd_lightning.cli.resolvers import register_resolvers\n"
    "register_resolvers()\n"
    "with initialize_config_dir(config_dir=sys.argv[1], version_base='1.3'):\n"
    "    cfg = compose('train', overrides=sys.argv[2:], return_hydra_config=True)\n"
    "from hydra.core.hydra_config import HydraConfig\n"
    "HydraConfig.instance().set_config(cfg)\n"
    "hydra.utils.instantiate(cfg.data).prepare_data()\n"
)


@dataclass
class Side:
    """One checkout: its name, source folder and dataset folder."""

    name: str
    tree: Path
    data_root: Path

    def env(self) -> dict[str, str]:
        # the checkout's package first, whatever is installed (an editable install points elsewhere)
        return {**os.environ, "PYTHONPATH": str(self.tree)}


@dataclass
class Result:
    side: str
    seed: int
    seconds: float
    peak_gib: float
    ap50: float
    ap: float
    evaluations: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="git revision to compare against, e.g. e05b2f2")
    parser.add_argument(
        "--candidate", default=None, help="git revision of the other side (default: this working tree)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="seeds, one run per side each")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every run of both sides (repeatable), e.g. trainer.max_epochs=1",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of checkouts, datasets and runs (default outputs/benchmark_demo/<date>_<time>)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return parser.parse_args(argv)


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout


def checkout(revision: str, folder: Path) -> Path:
    """A detached worktree of ``revision`` at ``folder`` (kept: remove with ``git worktree remove``)."""
    if not folder.exists():
        _git("worktree", "add", "--detach", str(folder), revision)
    return folder


def train_command(side: Side, seed: int, overrides: list[str], run_dir: Path) -> list[str]:
    return [
        sys.executable,
        str(side.tree / "train.py"),
        "experiment=demo",
        f"data.root={side.data_root}",
        f"seed={seed}",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]


def prepare(side: Side, overrides: list[str]) -> None:
    """Generate ``side``'s dataset, if missing, as its own ``train.py`` would (not timed)."""
    args = [str(side.tree / "configs"), "experiment=demo", f"data.root={side.data_root}", *overrides]
    subprocess.run([sys.executable, "-c", _PREPARE, *args], check=True, env=side.env(), cwd=side.tree)


def best(rows: list[dict[str, str]], key: str) -> tuple[float, int]:
    values = [r[key] for r in rows if key in r]
    return (max(values) if values else float("nan")), len(values)


def run(side: Side, seed: int, overrides: list[str], run_dir: Path) -> Result:
    command = train_command(side, seed, overrides, run_dir)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, *command],
        env=side.env(),
        cwd=side.tree,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{side.name} seed {seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    peak_kib = int(done.stdout.strip().splitlines()[-1])
    rows = read_metrics_csv(run_dir / "csv" / "metrics.csv")
    ap50, evaluations = best(rows, "val/mAP_50")
    ap, _ = best(rows, "val/mAP")
    return Result(side.name, seed, seconds, peak_kib / 2**20, ap50, ap, evaluations)


def order(seeds: list[int]) -> list[tuple[str, int]]:
    """baseline, candidate, candidate, baseline, ...: each side as often first as second."""
    out = []
    for i, seed in enumerate(seeds):
        pair = [("baseline", seed), ("candidate", seed)]
        out += pair if i % 2 == 0 else pair[::-1]
    return out


def table(results: list[Result]) -> str:
    base = {r.seed: r for r in results if r.side == "baseline"}
    rows = []
    for r in sorted(results, key=lambda r: (r.seed, r.side != "baseline")):
        ratio = f"{r.seconds / base[r.seed].seconds:.3f}x" if r.seed in base else ""
        rows.append(
            [
                r.side,
                r.seed,
                f"{r.seconds / 60:.2f}",
                ratio,
                f"{r.peak_gib:.2f}",
                r.evaluations,
                f"{r.ap50:.3f}",
                f"{r.ap:.3f}",
            ]  # fmt: skip
        )
    columns = ["side", "seed", "wall min", "vs baseline", "peak GiB", "evaluations", "best AP@0.5", "best AP"]
    return markdown_table(columns, rows, align="llrrrrrr")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = (args.out or REPO / "outputs" / "benchmark_demo" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    trees = {
        "baseline": out / "baseline_tree",
        "candidate": REPO if args.candidate is None else out / "candidate_tree",
    }
    sides = {name: Side(name, tree, out / f"{name}_data") for name, tree in trees.items()}
    plan = [(side, seed, out / f"{side}_seed{seed}") for side, seed in order(args.seeds)]
    for side, seed, run_dir in plan:
        print(" ".join(train_command(sides[side], seed, args.override, run_dir)))
    if args.dry_run:
        return
    checkout(args.baseline, trees["baseline"])
    if args.candidate is not None:
        checkout(args.candidate, trees["candidate"])
    for side in sides.values():
        prepare(side, args.override)
    results = []
    for side, seed, run_dir in plan:
        results.append(run(sides[side], seed, args.override, run_dir))
        print(f"{side} seed {seed}: {results[-1]}", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
