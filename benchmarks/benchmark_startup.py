"""Start-up cost of the COCO training data path per rank: CocoDALIDataModule vs DALI's bare readers.coco.

For 1, 2 and 4 ranks started at once on this machine (processes with RANK/LOCAL_RANK/WORLD_SIZE set, each
reading its shard), every process reports the seconds from "modules imported" to "first training batch in
hand" and its peak RSS (``VmHWM``, imports included). Rows:

* ``bare DALI readers.coco``: the training pipeline (``coco_train_pipeline``) built on the original
  annotation file and run once: the floor, no checks;
* ``datamodule, cold cache``: ``CocoDALIDataModule.setup("fit")`` (checks train and val) + the first batch
  of ``make_loader("train")``, with an empty check cache (the first run on a dataset);
* ``datamodule, warm cache``: the same again with the cache the cold run left (every later run).

Each row gives the slowest rank's time and the largest peak RSS over ranks (median over ``--repeats``), and
the RSS right after the imports (torch, DALI, Lightning: the same for every row).
Make a COCO-sized dataset first:

    .venv/bin/python benchmarks/make_coco_scale_fixture.py --out /tmp/coco_scale
    .venv/bin/python benchmarks/benchmark_startup.py --root /tmp/coco_scale --ranks 1,2,4 --repeats 3
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "bare": "bare DALI readers.coco",
    "cold": "datamodule, cold cache",
    "warm": "datamodule, warm cache",
}


def _status_gib(field: str) -> float:
    """``VmHWM`` (peak RSS) or ``VmRSS`` of this process in GiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def child(mode: str, root: Path, cache_dir: Path, batch_size: int, threads: int) -> None:
    """One rank: time to the first training batch; prints a JSON line."""
    import torch  # noqa: F401 - imported before timing, like the datamodule's own imports

    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule
    from ssd_lightning.data.dali_pipelines import coco_train_pipeline
    from ssd_lightning.models import dboxes300_coco

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    imports_rss = _status_gib("VmRSS")
    start = time.perf_counter()
    if mode == "bare":
        pipe = coco_train_pipeline(
            batch_size=batch_size,
            num_threads=threads,
            device_id=None,
            prefetch_queue_depth=2,
            seed=rank,
            file_root=str(root / "train2017"),
            annotations_file=str(root / "annotations" / "instances_train2017.json"),
            anchors_ltrb=dboxes300_coco().ltrb.flatten().tolist(),
            shard_id=rank,
            num_shards=world,
            device="cpu",
        )
        pipe.build()
        pipe.run()
    else:
        kwargs = (
            {"cache_dir": cache_dir}
            if "cache_dir" in inspect.signature(CocoDALIDataModule).parameters
            else {}
        )
        dm = CocoDALIDataModule(
            root, batch_size=batch_size, num_threads=threads, device="cpu", seed=0, **kwargs
        )
        dm.setup("fit")
        next(iter(dm.make_loader("train", shard_id=rank, num_shards=world)))
    seconds = time.perf_counter() - start
    peak = _status_gib("VmHWM")
    print(json.dumps({"rank": rank, "seconds": seconds, "peak": peak, "imports": imports_rss}), flush=True)


def launch(mode: str, ranks: int, args: argparse.Namespace, cache_dir: Path) -> tuple[float, float, float]:
    """Start ``ranks`` processes at once: slowest rank's seconds, largest peak RSS, largest RSS at start."""
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
        cmd = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--root",
            str(args.root),
            "--cache-dir",
            str(cache_dir),
        ]
        cmd += ["--batch-size", str(args.batch_size), "--threads", str(args.threads)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{mode} rank failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return tuple(max(r[k] for r in results) for k in ("seconds", "peak", "imports"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, required=True, help="COCO-layout root")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated numbers of concurrent ranks")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="DALI threads per rank")
    parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.root, args.cache_dir, args.batch_size, args.threads)
        return

    ann = args.root / "annotations" / "instances_train2017.json"
    rows: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    for repeat in range(args.repeats):
        for ranks in [int(r) for r in args.ranks.split(",")]:
            with tempfile.TemporaryDirectory(prefix="split_cache_") as cache_dir:
                for mode in ("bare", "cold", "warm"):  # cold then warm share the cache directory
                    seconds, peak, imports = launch(mode, ranks, args, Path(cache_dir))
                    rows.setdefault((ranks, mode), []).append((seconds, peak, imports))
                    print(
                        f"repeat {repeat + 1}, {ranks} rank(s), {MODES[mode]}: {seconds:.2f} s, "
                        f"{peak:.2f} GiB"
                    )

    print(
        f"\n{ann} ({ann.stat().st_size / 1e6:.0f} MB); batch {args.batch_size}, {args.threads} DALI threads "
        f"per rank, {os.cpu_count()} CPUs; median of {args.repeats} repeat(s)"
    )
    from ssd_lightning.tables import markdown_table

    table = []
    for (ranks, mode), values in rows.items():
        seconds, peak, imports = (statistics.median(v[k] for v in values) for k in range(3))
        bare = statistics.median(v[0] for v in rows[(ranks, "bare")])
        cells = [ranks, MODES[mode], f"{seconds:.2f}", f"{seconds / bare:.2f}x", f"{peak:.2f}"]
        table.append([*cells, f"{imports:.2f}"])
    columns = ["ranks", "start-up path", "s to first batch (slowest rank)", "vs bare"]
    columns += ["peak RSS GiB (largest rank)", "RSS after imports"]
    print(markdown_table(columns, table, align="rlrrrr"))


if __name__ == "__main__":
    main()
