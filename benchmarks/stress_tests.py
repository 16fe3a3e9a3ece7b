"""Run tests many times while other processes load every core, and count the outcomes per test.

    python benchmarks/stress_tests.py --repeat 20 --load 2 -m multiprocess

Multi-process tests must pass on a loaded machine (CI shares its cores), not only on a quiet one. Each
repeat is one pytest run of the selected tests, with ``--load`` busy-loop processes beside it; the table at
the end counts passed/failed/skipped per test (a test that failed once names the repeat whose log to read,
under ``--log-dir``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

from ssd_lightning.tables import markdown_table

BUSY_LOOP = "while True: pass"


def _outcome(case: ET.Element) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    if case.find("skipped") is not None:
        return "skipped"
    return "passed"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes running beside the tests")
    parser.add_argument("--log-dir", type=Path, default=Path("outputs/stress_tests"))
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="what to select, e.g. -m multiprocess")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    counts: dict[str, Counter] = defaultdict(Counter)
    failed_in: dict[str, list[int]] = defaultdict(list)
    load = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.load)]
    started = time.perf_counter()
    try:
        for i in range(1, args.repeat + 1):
            xml, log = args.log_dir / f"run{i:02d}.xml", args.log_dir / f"run{i:02d}.log"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
            with open(log, "w") as out:
                code = subprocess.call([*cmd, *args.pytest_args], stdout=out, stderr=subprocess.STDOUT)
            if not xml.is_file():
                print(f"repeat {i}: pytest exited {code} without results, see {log}", flush=True)
                continue
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('classname')}::{case.get('name')}"
                outcome = _outcome(case)
                counts[name][outcome] += 1
                if outcome == "failed":
                    failed_in[name].append(i)
            done = sum(c["passed"] for c in counts.values())
            print(f"repeat {i}/{args.repeat}: exit {code}, {done} passes so far", flush=True)
    finally:
        for proc in load:
            proc.kill()
    minutes = (time.perf_counter() - started) / 60
    print(f"\n{args.repeat} repeats with {args.load} busy-loop processes, {minutes:.1f} min\n")
    rows = [
        [
            name,
            counts[name]["passed"],
            counts[name]["failed"],
            counts[name]["skipped"],
            failed_in.get(name) or "",
        ]
        for name in sorted(counts)
    ]
    print(markdown_table(["test", "passed", "failed", "skipped", "failed in repeats"], rows))
    return 1 if any(failed_in.values()) else 0  # looking a name up must not count as a failure


if __name__ == "__main__":
    sys.exit(main())
