"""Every measurement harness in benchmarks/ starts: ``--help`` exits 0 with its usage line, from anywhere."""

from __future__ import annotations

import os

import pytest

from tests.helpers import REPO_ROOT, run_script

# --help runs no DALI pipeline: not repeated per DALI line
pytestmark = pytest.mark.no_dali

BENCHMARKS = REPO_ROOT / "benchmarks"
HARNESSES = sorted(p.name for p in BENCHMARKS.glob("*.py"))
# what docs/benchmarks.md and the harnesses' own docstrings name: none may go missing unnoticed
EXPECTED = {
    "benchmark_analysis.py",
    "benchmark_cpu_step.py",
    "benchmark_decoder.py",
    "benchmark_demo.py",
    "benchmark_eval.py",
    "benchmark_finetune.py",
    "benchmark_host_memory.py",
    "benchmark_loader.py",
    "benchmark_onnx.py",
    "benchmark_startup.py",
    "benchmark_training.py",
    "gpu_benchmark.py",
    "make_coco_scale_fixture.py",
    "stress_tests.py",
}


def test_the_harnesses_live_in_benchmarks_and_not_in_scripts():
    assert set(HARNESSES) == EXPECTED
    assert not {p.name for p in (REPO_ROOT / "scripts").glob("*")} & (EXPECTED | {"gpu_benchmark.sh"})


@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_help(harness: str, tmp_path):
    # from another directory: a harness finds the package (installed) and the repository files it reads
    # (tests/reference_ssd.py, configs/) from its own location, not the cwd
    # (so the caller's PYTHONPATH only, without run_script's repository entry)
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = run_script(BENCHMARKS / harness, "--help", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {harness} "), proc.stdout[:300]
    assert "Traceback" not in proc.stderr


def test_files_the_harnesses_read_by_path_exist():
    """benchmark_decoder.py imports tests/reference_ssd.py by path (sys.path)."""
    assert (REPO_ROOT / "tests" / "reference_ssd.py").is_file()
    assert 'parents[1] / "tests"' in (BENCHMARKS / "benchmark_decoder.py").read_text()
