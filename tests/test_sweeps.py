"""Sweeps that scale: the submitit launchers (hydra/launcher=submitit_local, hydra/launcher=slurm) and the
Optuna sweeper (sweep=demo_optuna) with the real plugins and the real train.py on generated data, and the
check that keeps a multirun from starting ranks with Lightning's own launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from ssd_lightning.cli.launch_check import SLURM_LAUNCHER, multirun_launch_problem
from ssd_lightning.cli.sweep_summary import read_last_metrics
from tests.conftest import REPO_ROOT, compose_config

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[sweeps]'")
pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[sweeps]'")


def _multirun_cfg(overrides: list[str]):
    cfg = compose_config(overrides)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
    return cfg


# ------------------------------------------------------------------------------- which multiruns may start
@pytest.mark.no_dali
@pytest.mark.parametrize(
    "overrides",
    [
        ["experiment=demo", "trainer=ddp_cpu"],  # DDPStrategy (popen) x 2 CPU processes
        ["experiment=demo", "trainer.devices=2", "trainer.strategy=ddp"],
        [
            "experiment=demo",
            "trainer=ddp_cpu",
            "hydra/launcher=submitit_local",
        ],  # not SLURM: Lightning launches
        ["experiment=demo", "trainer.num_nodes=2", "trainer.strategy=ddp"],
    ],
)
def test_multirun_with_lightnings_launcher_is_refused_naming_what_works(overrides):
    cfg = _multirun_cfg(overrides)
    key, _, message = multirun_launch_problem(cfg, cfg.hydra)
    assert key == "trainer.strategy"
    assert "ddp_spawn" in message and "hydra/launcher=slurm" in message


@pytest.mark.no_dali
@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        (["experiment=demo", "trainer=ddp_cpu"], RunMode.RUN),  # a plain run: Lightning's launcher is fine
        (["experiment=demo", "trainer=ddp_cpu", "trainer.strategy=ddp_spawn"], RunMode.MULTIRUN),
        (["experiment=demo", "trainer=ddp_cpu", "+trainer.strategy.start_method=spawn"], RunMode.MULTIRUN),
        (["experiment=demo"], RunMode.MULTIRUN),  # one process per job
        (["experiment=ssd300_fp16_8gpu", "hydra/launcher=slurm"], RunMode.MULTIRUN),  # srun starts the ranks
        (
            ["experiment=ssd300_fp16_8gpu", "hydra/launcher=slurm", "trainer.num_nodes=2"],
            RunMode.MULTIRUN,
        ),
    ],
)
def test_multiruns_whose_ranks_are_not_started_by_lightning_pass(overrides, mode):
    cfg = compose_config(overrides)
    with open_dict(cfg):
        cfg.hydra.mode = mode
    assert multirun_launch_problem(cfg, cfg.hydra, cuda_device_count=8) is None


@pytest.mark.no_dali
def test_slurm_launcher_task_count_must_match_the_trainer():
    cfg = _multirun_cfg(
        ["experiment=ssd300_fp16_8gpu", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=4"]
    )
    key, value, message = multirun_launch_problem(cfg, cfg.hydra, cuda_device_count=8)
    assert (key, value) == ("hydra.launcher.tasks_per_node", 4)
    assert "trainer.devices (8)" in message


@pytest.mark.no_dali
def test_slurm_launcher_asks_for_one_task_per_gpu_on_every_node():
    """The launcher Hydra would build for `hydra/launcher=slurm`: its sbatch parameters follow the Trainer."""
    cfg = compose_config(
        [
            "experiment=ssd300_fp16_8gpu",
            "hydra/launcher=slurm",
            "trainer.num_nodes=2",
            "hydra.launcher.partition=gpu",
        ]
    )
    HydraConfig.instance().set_config(cfg)  # ${hydra:...} in paths, as when Hydra instantiates it
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__module__ + "." + type(launcher).__name__ == SLURM_LAUNCHER
    params = launcher.params
    assert (params["tasks_per_node"], params["gpus_per_node"], params["nodes"]) == (8, 8, 2)
    assert params["partition"] == "gpu" and params["max_num_timeout"] == 3  # requeued at the time limit
    assert params["name"] == "test"  # hydra.job.name: Lightning ignores SLURM jobs named bash/interactive


@pytest.mark.no_dali
def test_demo_optuna_search_space_names_keys_of_the_demo():
    cfg = compose_config(["experiment=demo", "sweep=demo_optuna"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize"
    assert cfg.optimized_metric == "val/mAP"
    for key in sweeper.params:
        assert OmegaConf.select(cfg, key, default=None) is not None, key
    # COCO recipe with the grid sweep keeps the basic sweeper
    assert compose_config(["sweep=ssd300_lr_batch"]).hydra.sweeper._target_.endswith("BasicSweeper")


# ------------------------------------------------------------------------------- real multiruns of train.py
def _train_multirun(
    sweep_dir: Path, *overrides: str, timeout: int = 420, full_error: bool = True
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HYDRA_FULL_ERROR": "1" if full_error else "0"},
    )


def _fast_demo(shapes_coco: Path) -> list[str]:
    return ["experiment=demo", "debug=fast", f"data.root={shapes_coco}", "data.batch_size=4"]


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    import csv

    with open(sweep_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.no_dali  # the Hydra plugins' path; the demo's data path runs per DALI line in test_train
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_submitit_local_runs_each_job_in_its_own_process_and_the_parent_writes_the_summary(
    shapes_coco, tmp_path
):
    pytest.importorskip("nvidia.dali")
    sweep_dir = tmp_path / "multirun"
    result = _train_multirun(
        sweep_dir,
        *_fast_demo(shapes_coco),
        "model.optimizer.lr=1e-3,3e-3",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # submitit ran the jobs: one folder per job with its own log, and a job id that is not the sweep's pid
    assert len(list((sweep_dir / ".submitit").glob("*/*_log.out"))) == 2
    job_ids = set()
    for job in ("0", "1"):
        hydra_yaml = yaml.safe_load((sweep_dir / job / ".hydra" / "hydra.yaml").read_text())["hydra"]
        job_ids.add(str(hydra_yaml["job"]["id"]))
        assert hydra_yaml["launcher"]["_target_"].endswith("submitit_launcher.LocalLauncher")
        assert (sweep_dir / job / "checkpoints" / "last.ckpt").is_file()
    assert len(job_ids) == 2 and all(i.isdigit() for i in job_ids)
    rows = _rows(sweep_dir)
    assert [r["overrides"] for r in rows] == ["model.optimizer.lr=0.001", "model.optimizer.lr=0.003"]
    for job, row in enumerate(rows):
        assert row["status"] == "COMPLETED"
        logged = read_last_metrics(sweep_dir / str(job) / "csv" / "metrics.csv", ["val/mAP"])["val/mAP"]
        assert float(row["val/mAP"]) == pytest.approx(logged, rel=1e-6)  # what the job returned
        assert float(row["train/loss_epoch"]) > 0
    assert "`model.optimizer.lr=0.003`" in (sweep_dir / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.no_dali  # the sweeper's path; the demo's data path runs per DALI line in test_train
@pytest.mark.timeout(480)
def test_optuna_sweep_runs_trials_from_the_search_space_and_reports_the_best(shapes_coco, tmp_path):
    pytest.importorskip("nvidia.dali")
    sweep_dir = tmp_path / "multirun"
    result = _train_multirun(
        sweep_dir,
        *_fast_demo(shapes_coco),
        "sweep=demo_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(sweep_dir)
    assert [r["job"] for r in rows] == ["0", "1"] and {r["status"] for r in rows} == {"COMPLETED"}
    returned = []
    for job in ("0", "1"):
        cfg = yaml.safe_load((sweep_dir / job / ".hydra" / "config.yaml").read_text())
        assert 5e-4 <= cfg["model"]["optimizer"]["lr"] <= 8e-3
        assert 1e-5 <= cfg["model"]["optimizer"]["weight_decay"] <= 1e-2
        assert cfg["model"]["scheduler"]["warmup_steps"] in (0, 50, 100, 200, 400)
        assert cfg["trainer"]["limit_train_batches"] == 2  # debug=fast reached every trial
        overrides = (sweep_dir / job / ".hydra" / "overrides.yaml").read_text()
        assert f"model.optimizer.lr={cfg['model']['optimizer']['lr']}" in overrides
        returned.append(float(rows[int(job)]["val/mAP"]))
        logged = read_last_metrics(sweep_dir / job / "csv" / "metrics.csv", ["val/mAP"])["val/mAP"]
        assert returned[-1] == pytest.approx(logged, rel=1e-6)
    # two trials sampled different points, and Optuna's best is the best job of the table
    assert rows[0]["overrides"] != rows[1]["overrides"]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(returned), rel=1e-6)
    best_job = returned.index(max(returned))
    assert f"model.optimizer.lr={best['best_params']['model.optimizer.lr']}" in rows[best_job]["overrides"]


@pytest.mark.timeout(180)
def test_train_py_multirun_with_in_process_ddp_fails_at_once(shapes_coco, tmp_path):
    sweep_dir = tmp_path / "multirun"
    overrides = [*_fast_demo(shapes_coco), "trainer=ddp_cpu", "model.optimizer.lr=1e-3,3e-3"]
    result = _train_multirun(sweep_dir, *overrides, timeout=150, full_error=False)
    assert result.returncode != 0
    assert "trainer.strategy='DDPStrategy'" in result.stderr, result.stderr[-3000:]
    assert "ddp_spawn" in result.stderr and "hydra/launcher=slurm" in result.stderr
    assert "Traceback" not in result.stderr  # one message, no stack trace
    assert not list(sweep_dir.rglob("*.ckpt")) and not list(sweep_dir.rglob("metrics.csv"))
