"""benchmarks/gpu_benchmark.sh and gpu_benchmark.py: the one-shot GPU throughput table, checked on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, compose_config

# the benchmark experiments run on synthetic data: nothing here depends on the DALI line
pytestmark = pytest.mark.no_dali

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_benchmark.sh"


def _load():
    spec = spec_from_file_location("gpu_benchmark", REPO_ROOT / "benchmarks" / "gpu_benchmark.py")
    module = module_from_spec(spec)
    sys.modules["gpu_benchmark"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gb = _load()


def test_full_plan_covers_the_issue_matrix_with_compile_rows_last():
    runs = gb.plan(False, compile_runs=True)
    ssd = {(r.mode, r.precision, r.batch) for r in runs if r.backbone == "resnet50" and not r.compile}
    expected = {
        (m, p, b) for m in ("training", "inference") for p in ("bf16", "fp16") for b in (64, 128, 256)
    }
    assert expected <= ssd
    assert all(r.channels_last for r in runs if r.backbone == "resnet50" and r.batch != 128)
    assert {(r.mode, r.model) for r in runs if r.model == "mobilenetv2"} == {
        ("training", "mobilenetv2"),
        ("inference", "mobilenetv2"),
    }
    compiled = [i for i, r in enumerate(runs) if r.compile]
    assert compiled and compiled == list(range(len(runs) - len(compiled), len(runs)))  # cut first by a budget
    assert not any(r.compile for r in gb.plan(False, compile_runs=False))
    assert len({r.name for r in runs}) == len(runs)
    assert any(r.fused_sgd and r.precision == "fp16" for r in runs)  # the GradScaler's per-step sync, removed


ALL_ROWS = gb.plan(False, compile_runs=True) + gb.plan(True, compile_runs=True)
PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}


@pytest.mark.parametrize("run", ALL_ROWS, ids=lambda r: r.name)
def test_every_row_composes_to_the_settings_it_names(run, tmp_path):
    cfg = compose_config([*gb.overrides(run, warmup=20, iterations=50), f"paths.output_dir={tmp_path}"])
    assert cfg.task == f"benchmark_{run.mode}"
    batch = cfg.data.batch_size if run.mode == "training" else cfg.data.eval_batch_size
    assert batch == run.batch
    assert (
        cfg.trainer.precision == {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}[run.precision]
    )
    assert cfg.model.channels_last is run.channels_last and cfg.compile is run.compile
    assert cfg.data.steps_per_epoch == 70 and cfg.benchmark_warmup == 20 and cfg.benchmark_iterations == 50
    assert cfg.trainer.enable_progress_bar is False  # the bar's refresh reads the loss back every step
    assert cfg.model.optimizer.get("fused", False) is run.fused_sgd
    if run.backbone:
        assert cfg.model.net.backbone == run.backbone
    else:
        assert cfg.model._target_.endswith("ClassifierLitModule")


def test_forward_flops_match_the_issue_figure_for_ssd300_resnet50():
    gflop = gb.forward_gflop("ssd300", "resnet50")
    assert gflop == pytest.approx(40.0, rel=0.02)  # the issue's 40 GFLOP per 300x300 image
    assert gb.bound_img_s(gflop, "training", 790.0) == pytest.approx(790e3 / (3 * gflop))
    assert 6400 < gb.bound_img_s(gflop, "training", 790.0) < 6700
    assert 19000 < gb.bound_img_s(gflop, "inference", 790.0) < 20000


def _record(mode: str, img_s: float, backbone: str | None = "resnet50") -> dict:
    run = gb.Run("ssd300" if backbone else "mobilenetv2", backbone, mode, "bf16", 128)
    stats = {"images_per_second_median": img_s, "images_per_second_p90": img_s * 0.9}
    return {
        "name": run.name,
        "run": gb.dataclasses.asdict(run),
        "status": "ok",
        "benchmark": {"statistics": stats, "peak_memory_bytes": 3 * 2**30},
    }


def test_table_gives_reference_ratio_bound_fraction_and_goal():
    gflop = {"ssd300-resnet50": 40.0, "mobilenetv2": 0.6}
    records = [
        gb.enrich(_record("training", 3258.0), gflop, 790.0),
        gb.enrich(_record("inference", 5000.0), gflop, 790.0),
        gb.enrich(_record("training", 9000.0, backbone=None), gflop, 790.0),
        {
            "name": "x",
            "run": gb.dataclasses.asdict(gb.Run("ssd300", "resnet50", "training", "fp16", 256)),
            "status": "skipped",
            "error": "budget",
        },
    ]
    d = records[0]["derived"]
    assert d["vs_reference"] == pytest.approx(3258.0 / 724.0)
    assert d["fraction_of_bound"] == pytest.approx(3258.0 / (790e3 / 120.0))
    assert d["achieved_tflops"] == pytest.approx(3258.0 * 120.0 / 1e3)
    assert records[2]["derived"]["reference_images_per_second"] is None  # no reference for MobileNetV2
    table = gb.format_table(records)
    lines = table.splitlines()
    assert len(lines) == 2 + len(records)
    assert "| SSD300-ResNet50 | training | bf16 | 128 | true | false | 3,258 |" in lines[2]
    assert "4.50x of 724" in lines[2] and "49.5%" in lines[2]
    assert "4.73x of 1,057" in lines[3] and "25.3%" in lines[3]
    assert lines[5].endswith("skipped: budget |")
    goals = "\n".join(gb.goal_lines(records))
    assert "training: 3,258 img/s" in goals and "goal 2,500: met" in goals
    assert "inference: 5,000 img/s" in goals and "goal 6,000: NOT met" in goals


def test_rows_past_the_budget_are_listed_as_skipped_and_results_still_written(tmp_path, capsys):
    assert gb.main(["--smoke", "--out", str(tmp_path), "--budget-s", "0"]) == 1  # nothing ran
    results = json.loads((tmp_path / "results.json").read_text())
    planned = gb.plan(True, compile_runs=False)
    assert [r["name"] for r in results["runs"]] == [r.name for r in planned]
    assert {r["status"] for r in results["runs"]} == {"skipped"}
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("skipped: budget") == len(planned)
    assert "python train.py experiment=ssd300_benchmark_training" in summary


def test_dry_run_prints_the_train_py_commands(capsys):
    assert gb.main(["--dry-run", "--no-compile"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == len(gb.plan(False, compile_runs=False))
    assert (
        "ssd300-resnet50_training_fp16_bs256: python train.py experiment=ssd300_benchmark_training "
        "model.net.backbone=resnet50 precision=fp16 data.batch_size=256 model.channels_last=true "
        "compile=false"
    ) in "\n".join(out)


@pytest.mark.slow
def test_smoke_run_of_the_shell_script_writes_the_table_and_every_benchmark_json(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_BENCH_SMOKE": "1", "PYTHON": sys.executable}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    planned = gb.plan(True, compile_runs=False)
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results["runs"]] == [r.name for r in planned]
    for record, run in zip(results["runs"], planned, strict=True):
        assert record["status"] == "ok", record.get("traceback")
        on_disk = json.loads((out / "runs" / run.name / "benchmark.json").read_text())
        assert on_disk["statistics"] == record["benchmark"]["statistics"]
        assert on_disk["mode"] == run.mode and on_disk["batch_size_per_device"] == run.batch
        assert on_disk["iterations"] == 3 and on_disk["warmup"] == 1
        assert on_disk["channels_last"] is run.channels_last
        img_s = on_disk["statistics"]["images_per_second_median"]
        assert record["derived"]["images_per_second_median"] == img_s > 0
    stdout = proc.stdout
    assert "| model | mode | precision | batch |" in stdout  # the table is printed, not only written
    assert stdout.count(" | ok |") == len(planned)
    assert (out / "gpu_benchmark.log").read_text() == stdout
    assert (out / "summary.md").read_text().count(" | ok |") == len(planned)


def _hide_hydra(tmp_path: Path) -> dict[str, str]:
    """Environment in which ``import hydra`` fails (a stub shadows the real one)."""
    stub = tmp_path / "hide" / "hydra"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(stub.parent)}
    return {**env, "OUT": str(tmp_path / "out")}


def test_without_the_installed_package_the_script_says_how_to_get_it_and_installs_nothing(tmp_path):
    env = {**_hide_hydra(tmp_path), "PIP_NO_INDEX": "1"}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "pip install -e ." in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing run, nothing written


def test_the_script_needs_only_the_installed_package_and_runs_from_any_directory(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    command = ["bash", str(SCRIPT), "--dry-run", "--no-compile"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([line for line in proc.stdout.splitlines() if ": python train.py " in line]) == len(
        gb.plan(False, compile_runs=False)
    )
    assert (tmp_path / "out" / "gpu_benchmark.log").read_text() == proc.stdout


def test_the_script_carries_no_wheels_and_names_no_tool():
    text = SCRIPT.read_text() + (REPO_ROOT / "benchmarks" / "gpu_benchmark.py").read_text()
    for word in ("wheel", "pip install --", "--target", "device tool", "PACK_RUNS", "carry"):
        assert word not in text, word
