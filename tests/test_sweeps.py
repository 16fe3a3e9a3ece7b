"""Multirun sweeps of train.py: the sweep summary (ssd_lightning.cli.sweep_summary: the CSV reader, the
callback under a real Hydra multirun of a toy app), the ready-made sweep configs, the check that keeps a
multirun from starting ranks with Lightning's own launcher, and real multiruns of train.py on generated data
with the submitit launcher (hydra/launcher=submitit_local) and the Optuna sweeper (sweep=demo_optuna)."""

from __future__ import annotations

import importlib.util
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from ssd_lightning.cli.launch_check import SLURM_LAUNCHER, multirun_launch_problem
from ssd_lightning.cli.sweep_summary import read_last_metrics
from tests.helpers import compose_config, csv_rows, requires_dali, run_script, run_train_py, train_config

SWEEP_PLUGINS = ("hydra_plugins.hydra_submitit_launcher", "hydra_plugins.hydra_optuna_sweeper")
needs_sweep_plugins = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in SWEEP_PLUGINS),
    reason="pip install -e '.[sweeps]'",
)


# ------------------------------------------------------------------------------- the summary of a multirun
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


def _toy_sweep(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    sweep_dir = tmp_path / "sweep"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "cfg.yaml").write_text(TOY_CFG.format(sweep_dir=sweep_dir))
    (tmp_path / "app.py").write_text(textwrap.dedent(TOY_APP))
    result = run_script("app.py", "-m", *args, cwd=tmp_path, env=env, timeout=120, full_error=True)
    return result, sweep_dir


def test_callback_writes_one_row_per_job_with_its_overrides_and_metrics(tmp_path):
    result, sweep_dir = _toy_sweep(tmp_path, "lr=0.2,0.3", "tag=same")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = csv_rows(sweep_dir / "summary.csv")
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
    rows = csv_rows(sweep_dir / "summary.csv")
    assert [(r["overrides"], r["status"]) for r in rows] == [("lr=0.2", "COMPLETED"), ("lr=5.0", "FAILED")]
    assert float(rows[0]["val/acc1"]) == pytest.approx(1.3)  # returned 0.3 + 1, logged 0.3
    assert rows[1]["val/acc1"] == ""
    assert "Job 1 FAILED: ValueError: lr too large" in (sweep_dir / "summary.md").read_text()


def test_one_job_multirun_has_a_summary_and_a_plain_run_none(tmp_path):
    result, sweep_dir = _toy_sweep(tmp_path)  # -m with no sweep: one job, still a multirun
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = csv_rows(sweep_dir / "summary.csv")
    assert row["overrides"] == ""
    plain = run_script("app.py", "hydra.run.dir=run", cwd=tmp_path, timeout=120, full_error=True)
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


# ------------------------------------------------------------------------------- ready-made sweep configs
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


# ------------------------------------------------------------------------------- which multiruns may start
def _multirun_cfg(overrides: list[str]):
    cfg = compose_config(overrides)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
    return cfg


@needs_sweep_plugins
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


@needs_sweep_plugins
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


@needs_sweep_plugins
@pytest.mark.no_dali
def test_slurm_launcher_task_count_must_match_the_trainer():
    cfg = _multirun_cfg(
        ["experiment=ssd300_fp16_8gpu", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=4"]
    )
    key, value, message = multirun_launch_problem(cfg, cfg.hydra, cuda_device_count=8)
    assert (key, value) == ("hydra.launcher.tasks_per_node", 4)
    assert "trainer.devices (8)" in message


@needs_sweep_plugins
@pytest.mark.no_dali
def test_slurm_launcher_asks_for_one_task_per_gpu_on_every_node():
    """The launcher Hydra would build for `hydra/launcher=slurm`: its sbatch parameters follow the Trainer."""
    cfg = train_config(  # ${hydra:...} in paths resolves, as when Hydra instantiates the launcher
        [
            "experiment=ssd300_fp16_8gpu",
            "hydra/launcher=slurm",
            "trainer.num_nodes=2",
            "hydra.launcher.partition=gpu",
        ],
        keep_hydra=True,
    )
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__module__ + "." + type(launcher).__name__ == SLURM_LAUNCHER
    params = launcher.params
    assert (params["tasks_per_node"], params["gpus_per_node"], params["nodes"]) == (8, 8, 2)
    assert params["partition"] == "gpu" and params["max_num_timeout"] == 3  # requeued at the time limit
    assert params["name"] == "test"  # hydra.job.name: Lightning ignores SLURM jobs named bash/interactive


@needs_sweep_plugins
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
def _fast_demo(shapes_coco: Path) -> list[str]:
    return ["experiment=demo", "debug=fast", f"data.root={shapes_coco}", "data.batch_size=4"]


def _train_multirun(
    sweep_dir: Path, *overrides: str, timeout: int = 420, full_error: bool = True
) -> subprocess.CompletedProcess:
    return run_train_py(
        "-m", *overrides, f"hydra.sweep.dir={sweep_dir}", timeout=timeout, full_error=full_error
    )


@pytest.fixture(scope="module")
def lr_sweep(shapes_coco, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One ``train.py -m`` of the fast demo over two learning rates, its jobs run by submitit_local: what
    the job directories and summary hold, and what submitit did, are asserted on the same sweep."""
    pytest.importorskip("nvidia.dali")
    sweep_dir = tmp_path_factory.mktemp("lr_sweep") / "multirun"
    result = _train_multirun(
        sweep_dir,
        *_fast_demo(shapes_coco),
        "model.optimizer.lr=1e-3,3e-3",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
    )
    return result, sweep_dir


@needs_sweep_plugins
@pytest.mark.slow
@pytest.mark.no_dali  # the Hydra plugins' path; the demo's data path runs per DALI line in test_train
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_submitit_local_runs_each_job_in_its_own_process_and_the_parent_writes_the_summary(lr_sweep):
    result, sweep_dir = lr_sweep
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
    rows = csv_rows(sweep_dir / "summary.csv")
    assert [r["overrides"] for r in rows] == ["model.optimizer.lr=0.001", "model.optimizer.lr=0.003"]
    for job, row in enumerate(rows):
        assert row["status"] == "COMPLETED"
        logged = read_last_metrics(sweep_dir / str(job) / "csv" / "metrics.csv", ["val/mAP"])["val/mAP"]
        assert float(row["val/mAP"]) == pytest.approx(logged, rel=1e-6)  # what the job returned
        assert float(row["train/loss_epoch"]) > 0
    assert "`model.optimizer.lr=0.003`" in (sweep_dir / "summary.md").read_text()


@needs_sweep_plugins
@pytest.mark.no_dali  # Hydra's multirun: DALI only carries the data
@pytest.mark.slow
def test_train_py_multirun_writes_job_dirs_and_summary(lr_sweep):
    result, sweep_dir = lr_sweep
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        saved = yaml.safe_load((sweep_dir / job / ".hydra" / "config.yaml").read_text())
        assert saved["model"]["optimizer"]["lr"] == [1e-3, 3e-3][int(job)]
        assert (sweep_dir / job / "checkpoints" / "last.ckpt").is_file()
    rows = csv_rows(sweep_dir / "summary.csv")
    assert [r["overrides"] for r in rows] == ["model.optimizer.lr=0.001", "model.optimizer.lr=0.003"]
    for job, row in enumerate(rows):
        assert row["status"] == "COMPLETED"
        # the value train() returned is the last val/mAP each job logged
        logged = read_last_metrics(sweep_dir / str(job) / "csv" / "metrics.csv", ["val/mAP"])["val/mAP"]
        assert 0.0 <= float(row["val/mAP"]) <= 1.0
        assert float(row["val/mAP"]) == pytest.approx(logged, rel=1e-6)
    md = (sweep_dir / "summary.md").read_text()
    assert "`model.optimizer.lr=0.003`" in md and "`experiment=demo`" in md


@needs_sweep_plugins
@pytest.mark.slow
@pytest.mark.no_dali  # the sweeper's path; the demo's data path runs per DALI line in test_train
@pytest.mark.timeout(480)
@requires_dali
def test_optuna_sweep_runs_trials_from_the_search_space_and_reports_the_best(shapes_coco, tmp_path):
    sweep_dir = tmp_path / "multirun"
    result = _train_multirun(
        sweep_dir,
        *_fast_demo(shapes_coco),
        "sweep=demo_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = csv_rows(sweep_dir / "summary.csv")
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


@needs_sweep_plugins
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
