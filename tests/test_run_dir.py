"""A run directory is the unit users continue and evaluate: `resume=<run dir>`,
`task=validate run_dir=<run dir>`, `checkpoints/best.ckpt`, and a CSV log that continues across the resume."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf

from ssd_lightning.callbacks.best_checkpoint import BestCheckpoint
from ssd_lightning.cli import run_lock
from ssd_lightning.cli.run_dir import apply_overrides, hydra_subdir_for, output_dir_for, resolve_run_reference
from ssd_lightning.errors import ConfigError
from ssd_lightning.io.loggers import ContinuingCSVLogger
from tests.helpers import (
    csv_rows,
    demo_run_overrides,
    last_checkpoint,
    load_checkpoint,
    run_train_py,
    subprocess_env,
)


def _stored_run(tmp_path: Path, checkpoints=("last.ckpt",)) -> Path:
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    cfg = {
        "task": "fit",
        "ckpt_path": None,
        "paths": {"output_dir": str(run)},
        "trainer": {"max_epochs": 2, "max_steps": 6, "devices": 1},
        "model": {"optimizer": {"lr": 0.1}},
    }
    OmegaConf.save(OmegaConf.create(cfg), run / ".hydra" / "config.yaml")
    choices = {"experiment": "demo", "trainer": "cpu", "model/optimizer": "adamw"}
    OmegaConf.save(
        OmegaConf.create({"hydra": {"runtime": {"choices": choices}}}), run / ".hydra" / "hydra.yaml"
    )
    (run / "checkpoints").mkdir()
    for name in checkpoints:
        (run / "checkpoints" / name).write_bytes(b"x")
    return run


def _invocation(**keys) -> OmegaConf:
    return OmegaConf.create(
        {"task": "fit", "resume": None, "run_dir": None, "paths": {"output_dir": "/now"}, **keys}
    )


# ------------------------------------------------------------------------------------------ config rules
def _resuming(run: Path) -> OmegaConf:
    return _invocation(resume=str(run), paths={"output_dir": str(run)})  # Hydra's run dir is the run


def test_the_command_lines_overrides_apply_to_the_stored_config(tmp_path):
    run = _stored_run(tmp_path)
    overrides = [f"resume={run}", "trainer.max_epochs=5", "~trainer.max_steps", "+trainer.new_key=3"]
    overrides += ["model.optimizer.lr=0.01", f"hydra.run.dir={run}"]
    overrides += ["experiment=demo", "trainer=cpu", "model/optimizer=adamw"]  # "the same command": skipped
    cfg = resolve_run_reference(_resuming(run), overrides)
    assert cfg.trainer == {"max_epochs": 5, "devices": 1, "new_key": 3}
    assert cfg.model.optimizer.lr == 0.01 and cfg.task == "fit"
    assert cfg.ckpt_path == str(run / "checkpoints" / "last.ckpt") and cfg.resume == str(run)
    assert cfg.paths.output_dir == str(run)
    # the stored file is read, never rewritten
    assert OmegaConf.load(run / ".hydra" / "config.yaml").trainer.max_steps == 6


def test_a_second_resume_continues_from_the_config_the_first_one_ran_with(tmp_path, monkeypatch):
    from ssd_lightning.cli.run_dir import save_run_config

    run = _stored_run(tmp_path)
    first = resolve_run_reference(_resuming(run), ["trainer.max_epochs=80"])
    save_run_config(first, run / ".hydra" / "resume_2026-01-01_00-00-00")
    monkeypatch.setenv("RANK", "1")  # only rank 0 writes it
    save_run_config(first, run / ".hydra" / "resume_2026-01-02_00-00-00")
    assert not (run / ".hydra" / "resume_2026-01-02_00-00-00").exists()
    second = resolve_run_reference(_resuming(run), [])
    assert second.trainer.max_epochs == 80  # not the first start's 2
    (run / ".hydra" / "resume_2026-01-03_00-00-00").mkdir()  # a resume that failed before saving: ignored
    assert resolve_run_reference(_resuming(run), []).trainer.max_epochs == 80


def test_a_resumed_run_from_before_keeps_its_csv(tmp_path):
    run = _stored_run(tmp_path)
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    cfg.logger = {"csv": {"_target_": "pytorch_lightning.loggers.CSVLogger", "save_dir": str(run)}}
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    assert (
        resolve_run_reference(_resuming(run), []).logger.csv._target_
        == "ssd_lightning.io.loggers.ContinuingCSVLogger"
    )


def test_validate_of_a_run_takes_its_best_checkpoint_and_an_explicit_one_wins(tmp_path):
    run = _stored_run(tmp_path, checkpoints=("last.ckpt", "best.ckpt"))
    cfg = resolve_run_reference(
        _invocation(task="validate", run_dir=str(run)), ["task=validate", f"run_dir={run}"]
    )
    assert cfg.task == "validate" and cfg.ckpt_path == str(run / "checkpoints" / "best.ckpt")
    (run / "checkpoints" / "best.ckpt").unlink()  # a run without an evaluation yet: last.ckpt
    cfg = resolve_run_reference(_invocation(task="validate", run_dir=str(run)), ["task=validate"])
    assert cfg.ckpt_path == str(run / "checkpoints" / "last.ckpt")
    cfg = resolve_run_reference(_invocation(run_dir=str(run)), ["task=validate", "ckpt_path=/my.ckpt"])
    assert cfg.ckpt_path == "/my.ckpt"


@pytest.mark.parametrize(
    ("invocation", "overrides", "message"),
    [
        (
            {"resume": "RUN"},
            ["trainer=ddp"],
            "config group choice 'trainer=ddp' cannot be applied to it (the run has trainer=cpu)",
        ),
        ({"resume": "RUN"}, ["experiment=ssd300_fp16_8gpu"], "set the keys it would change instead"),
        (
            {"resume": "RUN", "paths": {"output_dir": "ELSEWHERE"}},
            [],
            "continues the run in its own directory",
        ),
        ({"run_dir": "RUN"}, [], "evaluates a run: add task=validate"),
        ({"resume": "RUN"}, ["model.optimizer.lr=0.1,0.2"], "is a sweep"),
        ({"resume": "RUN", "run_dir": "RUN"}, [], "both given"),
        ({"resume": "RUN", "task": "validate"}, [], "to evaluate a run use run_dir="),
        ({"resume": "NOWHERE"}, [], "not found; resume takes a run directory written by train.py"),
        ({"run_dir": "EMPTY"}, ["task=validate"], "no best.ckpt or last.ckpt in"),
    ],
)
def test_bad_references_are_one_clear_error(tmp_path, invocation, overrides, message):
    run = _stored_run(tmp_path / "a")
    empty = _stored_run(tmp_path / "b", checkpoints=())
    paths = {"RUN": str(run), "NOWHERE": str(tmp_path / "nowhere"), "EMPTY": str(empty), "ELSEWHERE": "/x"}
    keys = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in invocation.items()}
    keys.setdefault("paths", {"output_dir": keys.get("resume") or "/now"})
    keys["paths"] = {"output_dir": paths.get(keys["paths"]["output_dir"], keys["paths"]["output_dir"])}
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_run_reference(_invocation(**keys), overrides)


def test_run_directories_follow_the_reference():
    assert output_dir_for("/r/run", None, "fit", "/outputs/demo/now") == "/r/run"
    assert output_dir_for("~/run", None, "fit", "/x") == str(Path("~/run").expanduser())
    assert output_dir_for(None, None, "fit", "/outputs/demo/now") == "/outputs/demo/now"
    assert output_dir_for(None, "/r/run", "validate", "/x").startswith("/r/run/validate/20")
    assert hydra_subdir_for(None) == ".hydra"
    assert hydra_subdir_for("/r/run").startswith(".hydra/resume_20")


def test_overrides_without_a_reference_change_nothing():
    cfg = _invocation()
    assert resolve_run_reference(cfg, ["trainer=ddp"]) is cfg
    assert apply_overrides(OmegaConf.create({"a": 1}), ["resume=/x", "hydra.job.chdir=true"], "resume") == {
        "a": 1
    }


# ------------------------------------------------------------------------------------------ CSV log
def test_csv_log_continues_and_drops_what_was_logged_after_the_checkpoint(tmp_path):
    first = ContinuingCSVLogger(tmp_path, name="csv", version="")
    for step in range(10):  # the killed run logged steps 0..9; its last checkpoint is at step 6
        first.log_metrics({"train/loss_step": float(step)}, step=step)
    first.log_metrics({"val/mAP": 0.5, "epoch": 0}, step=5)
    first.save()

    resumed = ContinuingCSVLogger(tmp_path, name="csv", version="")
    for step in range(6, 8):
        resumed.log_metrics({"train/loss_step": 100.0 + step, "lr": 0.1}, step=step)  # a new column
    resumed.save()
    rows = csv_rows(tmp_path / "csv" / "metrics.csv")
    losses = [(int(r["step"]), float(r["train/loss_step"])) for r in rows if r["train/loss_step"]]
    assert losses == [(s, float(s)) for s in range(6)] + [(6, 106.0), (7, 107.0)]  # steps 6..9 once, new
    assert [r["val/mAP"] for r in rows if r["val/mAP"]] == ["0.5"]  # older rows keep every column
    assert set(rows[0]) == {"epoch", "step", "train/loss_step", "val/mAP", "lr"}

    resumed.log_metrics({"train/loss_step": 8.0}, step=8)  # later saves append, drop nothing
    resumed.save()
    assert len(csv_rows(tmp_path / "csv" / "metrics.csv")) == len(rows) + 1


def test_a_fresh_csv_log_is_lightnings(tmp_path):
    logger = ContinuingCSVLogger(tmp_path, name="csv", version="")
    logger.log_metrics({"a": 1.0}, step=0)
    logger.save()
    assert csv_rows(tmp_path / "csv" / "metrics.csv") == [{"a": "1.0", "step": "0"}]


# ------------------------------------------------------------------------------------------ best.ckpt
class _Scored(pl.LightningModule):
    """Logs a fixed score per epoch as ``val/score``."""

    def __init__(self, scores: list[float] | None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.scores = scores

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        if self.scores is not None:
            self.log("val/score", self.scores[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)

    val_dataloader = train_dataloader


def _fit(tmp_path: Path, scores: list[float] | None, epochs: int) -> BestCheckpoint:
    best = BestCheckpoint(dirpath=tmp_path / "checkpoints", monitor="val/score")
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[best],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(_Scored(scores))
    return best


def test_best_checkpoint_holds_the_best_evaluation(tmp_path):
    best = _fit(tmp_path, [0.2, 0.7, 0.4, 0.6], epochs=4)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best.ckpt"]
    saved = load_checkpoint(tmp_path / "checkpoints" / "best.ckpt")
    assert saved["epoch"] == 1 and float(best.best_model_score) == pytest.approx(0.7)


def test_without_the_metric_no_best_checkpoint_and_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        _fit(tmp_path, None, epochs=2)
    assert not (tmp_path / "checkpoints" / "best.ckpt").exists()
    assert sum("validation logged no val/score" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------------------------------ end to end
def _train_py(*args: str, returncode: int = 0) -> subprocess.CompletedProcess:
    proc = run_train_py(*args, timeout=300)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.no_dali  # run-directory plumbing; the demo's data path runs per DALI line in test_train
@pytest.mark.timeout(600)
def test_resume_in_place_then_validate_the_run(shapes_coco, tmp_path):
    run, log_dir = tmp_path / "run", tmp_path / "outputs"
    common = [*demo_run_overrides(shapes_coco), f"paths.log_dir={log_dir}"]
    annotations = json.loads((shapes_coco / "annotations" / "instances_train2017.json").read_text())
    steps = len({a["image_id"] for a in annotations["annotations"]}) // 4  # per epoch: images with boxes
    # the preempted run: SIGTERM two steps into epoch 1 of 2
    fault = [
        "+callbacks.fault._target_=tests.fault_injection.SignalAtStep",
        f"+callbacks.fault.step={steps + 2}",
    ]
    _train_py(*common, *fault, f"hydra.run.dir={run}", returncode=143)
    stored = (run / ".hydra" / "config.yaml").read_bytes()

    # its own config, minus the fault (a key the defaults lack is overridden with +, as when it was added)
    _train_py(f"resume={run}", "+callbacks.fault=null", f"paths.log_dir={log_dir}")
    assert not log_dir.exists()  # nothing new besides the run itself
    assert (run / ".hydra" / "config.yaml").read_bytes() == stored
    [resumed_cfg] = run.glob(".hydra/resume_*/run_config.yaml")
    resumed = OmegaConf.load(resumed_cfg)  # the config that ran
    assert resumed.callbacks.fault is None and resumed.data.batch_size == 4 and resumed.resume == str(run)
    last = last_checkpoint(run)
    assert last["epoch"] == 1 and last["global_step"] == 2 * steps
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "best.ckpt",
        "epoch_1.ckpt",
        "last.ckpt",
    ]
    rows = csv_rows(run / "csv" / "metrics.csv")
    assert sorted(int(r["step"]) for r in rows if r.get("train/loss_step")) == list(range(2 * steps))  # once
    maps = {int(r["epoch"]): float(r["val/mAP"]) for r in rows if r.get("val/mAP")}
    assert sorted(maps) == [0, 1]  # evaluated after epoch 0 (first run) and the last epoch (resumed run)
    assert not (run / "train.log").exists()
    log_text = (run / "demo.log").read_text()  # the run's log (task_name=demo), appended
    assert "SIGTERM: stopped at epoch 1" in log_text and "fit finished in" in log_text
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) >= 2  # same log dir
    best = load_checkpoint(run / "checkpoints" / "best.ckpt")
    assert best["epoch"] == max(maps, key=maps.get)

    proc = _train_py("task=validate", f"run_dir={run}", "+trainer.enable_progress_bar=false")
    assert "checkpoint " + str(run / "checkpoints" / "best.ckpt") in proc.stdout + proc.stderr
    [validate_dir] = (run / "validate").iterdir()
    validated = [
        float(r["val/mAP"]) for r in csv_rows(validate_dir / "csv" / "metrics.csv") if r.get("val/mAP")
    ]
    assert validated == [pytest.approx(max(maps.values()), abs=1e-6)]  # the best evaluation, recomputed


# ------------------------------------------------------------------------------------- one owner per run
_HOLD = """
import sys, time
from ssd_lightning.cli.run_lock import own_run_dir
own_run_dir(sys.argv[1])
print("owned", flush=True)
time.sleep(600)
"""


def test_a_run_directory_has_one_owner_and_a_dead_owner_blocks_nothing(tmp_path, monkeypatch):
    """The lock is the kernel's: held while the owner lives, gone when it is killed (kill -9, no clean-up)."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "SUBMITIT_LOCAL_GLOBALID", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    hold = [sys.executable, "-c", _HOLD, str(tmp_path)]
    owner = subprocess.Popen(hold, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert owner.stdout.readline().strip() == "owned"
        with pytest.raises(
            run_lock.RunInUseError, match=f"in use by pid {owner.pid} on host {socket.gethostname()}"
        ):
            run_lock.own_run_dir(tmp_path)
        monkeypatch.setenv("LOCAL_RANK", "1")  # another rank of the owner's job takes no lock
        run_lock.own_run_dir(tmp_path)
        monkeypatch.delenv("LOCAL_RANK")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=60)
    run_lock.own_run_dir(tmp_path)  # the killed owner's file is still there, its lock is not
    try:
        assert f"pid {os.getpid()} " in (tmp_path / run_lock.LOCK_NAME).read_text()
    finally:
        run_lock.release_run_dirs()
    run_lock.own_run_dir(tmp_path)  # released: taken again
    run_lock.release_run_dirs()
