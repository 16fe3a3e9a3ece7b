"""Multirun summaries (ssd_lightning.cli.sweep_summary): the CSV reader, the callback under a real Hydra
multirun, the ready-made sweep configs, and a 2-job sweep of train.py."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from ssd_lightning.cli.sweep_summary import read_last_metrics
from tests.conftest import REPO_ROOT, compose_config


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_read_last_metrics_takes_the_last_logged_value_of_each_selected_column(tmp_path):
    # the sparse layout Lightning's CSVLogger writes: one row per logging call
    (tmp_path / "metrics.csv").write_text(
        "epoch,lr,step,train/loss_epoch,train/loss_step,val/mAP\n"
        "0,0.1,0,,5.0,\n"
        "0,,1,4.5,,\n"
        "0,,1,,,0.25\n"
        "1,0.05,2,,3.0,\n"
        "1,,3,2.5,,\n"
        "1,,3,,,0.5\n"
    )
    got = read_last_metrics(tmp_path / "metrics.csv", ["val/*", "train/*_epoch"])
    assert got == {"val/mAP": 0.5, "train/loss_epoch": 2.5}
    assert read_last_metrics(tmp_path / "metrics.csv")["lr"] == 0.05  # default: every column but epoch/step
    assert read_last_metrics(tmp_path / "missing.csv") == {}


TOY_APP = """
import csv, os
import hydra
from omegaconf import DictConfig

@hydra.main(version_base="1.3", config_path="conf", config_name="cfg")
def main(cfg: DictConfig) -> float:
    if cfg.lr > 1:
        raise ValueError("lr too large")
    out = hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
    os.makedirs(f"{out}/csv")
    with open(f"{out}/csv/metrics.csv", "w") as f:
        f.write("epoch,step,val/acc1,train/loss_epoch,lr\\n0,0,,{:.3f},{}\\n0,0,{:.3f},,\\n".format(
            1 - cfg.lr, cfg.lr, 0.1 + cfg.lr))
    return 0.1 + cfg.lr + 1000 * cfg.offset   # the returned value wins over the logged one

main()
"""

TOY_CFG = """
lr: 0.1
offset: 0.0
tag: same
optimized_metric: val/acc1
hydra:
  sweep:
    dir: {sweep_dir}
    subdir: ${{hydra.job.num}}
  callbacks:
    sweep_summary:
      _target_: ssd_lightning.cli.sweep_summary.SweepSummary
      metrics: ["val/*", "train/*_epoch"]
"""


_ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HYDRA_FULL_ERROR": "1"}


def _toy_sweep(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    sweep_dir = tmp_path / "sweep"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "cfg.yaml").write_text(TOY_CFG.format(sweep_dir=sweep_dir))
    (tmp_path / "app.py").write_text(textwrap.dedent(TOY_APP))
    result = subprocess.run(
        [sys.executable, "app.py", "-m", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_ENV, **env},
    )
    return result, sweep_dir


def test_callback_writes_one_row_per_job_with_its_overrides_and_metrics(tmp_path):
    result, sweep_dir = _toy_sweep(tmp_path, "lr=0.2,0.3", "tag=same")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(sweep_dir / "summary.csv")
    assert [r["job"] for r in rows] == ["0", "1"]
    # only the swept override names each row; the shared one goes to the markdown header
    assert [r["overrides"] for r in rows] == ["lr=0.2", "lr=0.3"]
    assert [r["status"] for r in rows] == ["COMPLETED"] * 2
    assert [float(r["val/acc1"]) for r in rows] == pytest.approx([0.3, 0.4])
    assert [float(r["train/loss_epoch"]) for r in rows] == pytest.approx([0.8, 0.7])
    assert "lr" not in rows[0]  # not selected by the patterns
    assert [r["output_dir"] for r in rows] == [str(sweep_dir / "0"), str(sweep_dir / "1")]
    md = (sweep_dir / "summary.md").read_text()
    assert "`tag=same`" in md and "| 1 | `lr=0.3` | COMPLETED | 0.4 | 0.7 |" in md


def test_returned_metric_wins_and_failed_jobs_are_listed(tmp_path):
    # job 1 fails: Hydra aborts the multirun (no on_multirun_end), the per-job refresh still wrote the table
    result, sweep_dir = _toy_sweep(tmp_path, "lr=0.2,5.0", "offset=0.001")
    assert result.returncode != 0 and "lr too large" in result.stderr
    rows = _rows(sweep_dir / "summary.csv")
    assert [(r["overrides"], r["status"]) for r in rows] == [("lr=0.2", "COMPLETED"), ("lr=5.0", "FAILED")]
    assert float(rows[0]["val/acc1"]) == pytest.approx(1.3)  # returned 0.3 + 1, logged 0.3
    assert rows[1]["val/acc1"] == ""
    assert "Job 1 FAILED: ValueError: lr too large" in (sweep_dir / "summary.md").read_text()


def test_one_job_multirun_has_a_summary_and_a_plain_run_none(tmp_path):
    result, sweep_dir = _toy_sweep(tmp_path)  # -m with no sweep: one job, still a multirun
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = _rows(sweep_dir / "summary.csv")
    assert row["overrides"] == ""
    plain = subprocess.run(
        [sys.executable, "app.py", "hydra.run.dir=run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_ENV,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not (tmp_path / "run" / "summary.csv").exists()
    assert not (tmp_path / "run" / ".hydra" / "job_summary.json").exists()


def test_ddp_child_processes_write_no_summary(tmp_path):
    # Lightning's DDP launcher re-runs train.py (and so the sweep) in ranks 1.. with LOCAL_RANK set
    result, sweep_dir = _toy_sweep(tmp_path, "lr=0.2,0.3", LOCAL_RANK="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (sweep_dir / "0" / "csv" / "metrics.csv").is_file()
    assert not (sweep_dir / "summary.csv").exists()
    assert not list(sweep_dir.rglob("job_summary.json"))


@pytest.mark.parametrize(
    ("sweep", "experiment", "params"),
    [
        (
            "ssd300_lr_batch",
            "ssd300_fp16_8gpu",
            {"model.optimizer.lr": "1.3e-3,2.6e-3,5.2e-3", "data.batch_size": "32,64"},
        ),
        ("mobilenetv2_schedule", "mobilenetv2_imagenet_8gpu", {"model.scheduler.name": "step,cosine"}),
    ],
)
def test_sweep_configs_compose_into_a_multirun_grid(sweep, experiment, params):
    cfg = compose_config([f"experiment={experiment}", f"sweep={sweep}"])
    assert dict(cfg.hydra.sweeper.params) == params
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert cfg.hydra.callbacks.sweep_summary._target_ == "ssd_lightning.cli.sweep_summary.SweepSummary"


@pytest.mark.dali
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_py_multirun_writes_job_dirs_and_summary(shapes_coco, tmp_path):
    pytest.importorskip("nvidia.dali")
    sweep_dir = tmp_path / "multirun"
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "experiment=demo",
            "debug=fast",
            f"data.root={shapes_coco}",
            "data.batch_size=4",
            "model.optimizer.lr=1e-3,3e-3",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        saved = yaml.safe_load((sweep_dir / job / ".hydra" / "config.yaml").read_text())
        assert saved["model"]["optimizer"]["lr"] == [1e-3, 3e-3][int(job)]
        assert (sweep_dir / job / "checkpoints" / "last.ckpt").is_file()
    rows = _rows(sweep_dir / "summary.csv")
    assert [r["overrides"] for r in rows] == ["model.optimizer.lr=0.001", "model.optimizer.lr=0.003"]
    for job, row in enumerate(rows):
        assert row["status"] == "COMPLETED"
        # the value train() returned is the last val/mAP each job logged
        logged = read_last_metrics(sweep_dir / str(job) / "csv" / "metrics.csv", ["val/mAP"])["val/mAP"]
        assert 0.0 <= float(row["val/mAP"]) <= 1.0
        assert float(row["val/mAP"]) == pytest.approx(logged, rel=1e-6)
    md = (sweep_dir / "summary.md").read_text()
    assert "`model.optimizer.lr=0.003`" in md and "`experiment=demo`" in md
