"""``logger=wandb`` and ``logger=mlflow``: the real libraries, offline (W&B offline mode, MLflow's SQLite
store in the run directory), read back from what they stored: config, metrics, pictures, the checkpoint
paths, and a resumed run directory continuing the same tracker run."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import hydra
import pytest
from PIL import Image

from tests.helpers import csv_rows, demo_run_overrides, run_train_py, train_config

MISSING = {
    "wandb": 'logger=wandb needs the wandb package: pip install -e ".[loggers]"',
    "mlflow": 'logger=mlflow needs the mlflow package: pip install -e ".[loggers]"',
}


@pytest.fixture
def offline(tmp_path, monkeypatch) -> dict[str, str]:
    """W&B offline and quiet, its settings and caches under ``tmp_path``; no MLflow server from the caller."""
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
        "MLFLOW_TRACKING_URI": "",
        "OMP_NUM_THREADS": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


# -- W&B's offline run files: the .wandb record log, LevelDB-style blocks of protobuf records ----------------
def wandb_records(run_file: Path) -> list:
    """The ``Record`` protobufs of a ``run-<id>.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    block, data = 32768, run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    pos, chunks, records = 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE.../LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def _items(entries) -> dict:
    return {"/".join(e.nested_key) if e.nested_key else e.key: json.loads(e.value_json) for e in entries}


def wandb_run(wandb_dir: Path) -> dict:
    """Every offline run under ``wandb_dir``: ids, history rows, config and summary (later values win)."""
    out: dict = {"ids": [], "history": [], "config": {}, "summary": {}}
    for run_file in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["ids"].append(record.run.run_id)
                out["config"].update(_items(record.run.config.update))
            elif kind == "config":
                out["config"].update(_items(record.config.update))
            elif kind == "history":
                out["history"].append(_items(record.history.item))
            elif kind == "summary":
                out["summary"].update(_items(record.summary.update))
    return out


def _checkpoint_callback(tmp_path: Path):
    from pytorch_lightning.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=tmp_path / "checkpoints", monitor="val/mAP", mode="max")
    callback.last_model_path = str(tmp_path / "checkpoints" / "last.ckpt")
    callback.best_model_path = str(tmp_path / "checkpoints" / "best.ckpt")
    return callback


def _picture(tmp_path: Path) -> Path:
    path = tmp_path / "picture.png"
    Image.new("RGB", (8, 6), (255, 0, 0)).save(path)
    return path


# -- a missing extra ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_missing_extra_is_an_error_naming_the_install_command(name, tmp_path, monkeypatch, capsys):
    from hydra.errors import InstantiationException

    from ssd_lightning.errors import user_errors_as_messages
    from ssd_lightning.io.loggers import MissingExtraError

    cfg = train_config([f"logger={name}"], output_dir=tmp_path)
    monkeypatch.setitem(sys.modules, name, None)  # `import <name>` raises ImportError
    with pytest.raises(InstantiationException) as caught:
        hydra.utils.instantiate(cfg.logger[name])
    assert isinstance(caught.value.__cause__, MissingExtraError)
    assert str(caught.value.__cause__) == MISSING[name]
    with pytest.raises(SystemExit) as exit_, user_errors_as_messages():
        hydra.utils.instantiate(cfg.logger[name])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"Error: {MISSING[name]}" and "Traceback" not in err


# -- each logger on its own, in-process --------------------------------------------------------------------
def test_wandb_logger_keeps_one_run_per_run_directory(tmp_path, offline):
    from ssd_lightning.io.loggers import ResumableWandbLogger

    run_dir, picture = tmp_path / "run", _picture(tmp_path)
    first = ResumableWandbLogger(save_dir=run_dir, project="t")
    first.log_hyperparams({"model": {"lr": 0.5}, "task_name": "demo"})
    first.log_metrics({"val/mAP": 0.25}, step=3)
    first.log_image("analysis/pr_curves", [str(picture)], step=3)
    first.after_save_checkpoint(_checkpoint_callback(run_dir))
    run_id = first.experiment.id
    first.finalize("success")
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id

    time.sleep(1.1)  # W&B names a run's folder by the second it started: a resume is never as quick
    second = ResumableWandbLogger(save_dir=run_dir, project="t")  # resume=<run dir>
    second.log_metrics({"val/mAP": 0.5}, step=6)
    assert second.experiment.id == run_id
    second.finalize("success")

    stored = wandb_run(run_dir / "wandb")
    assert stored["ids"] == [run_id, run_id]
    assert stored["config"]["model"] == {"lr": 0.5} and stored["config"]["task_name"] == "demo"
    maps = {row["trainer/global_step"]: row["val/mAP"] for row in stored["history"] if "val/mAP" in row}
    assert maps == {3: 0.25, 6: 0.5}
    (image,) = [row for row in stored["history"] if "analysis/pr_curves/filenames" in row]
    assert image["trainer/global_step"] == 3 and image["analysis/pr_curves/count"] == 1
    (media,) = image["analysis/pr_curves/filenames"]
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/files"))[0]  # the first part's
    with Image.open(files / media) as stored_picture:
        assert stored_picture.size == (8, 6) and stored_picture.getpixel((0, 0)) == (255, 0, 0)
    assert stored["summary"]["checkpoint/last"] == str(run_dir / "checkpoints" / "last.ckpt")
    assert stored["summary"]["checkpoint/best"] == str(run_dir / "checkpoints" / "best.ckpt")
    assert first.log_dir == str(run_dir / "wandb")


def test_mlflow_logger_keeps_one_run_per_run_directory(tmp_path, offline):
    from mlflow.tracking import MlflowClient

    from ssd_lightning.io.loggers import ResumableMLFlowLogger

    run_dir, picture = tmp_path / "run", _picture(tmp_path)
    first = ResumableMLFlowLogger(run_dir=run_dir, experiment_name="t")
    first.log_hyperparams({"model": {"lr": 0.5}, "epochs": 2})
    first.log_metrics({"val/mAP": 0.25}, step=3)
    first.log_image("analysis/pr_curves", [picture], step=3)
    first.after_save_checkpoint(_checkpoint_callback(run_dir))
    first.finalize("success")
    run_id = first.run_id
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    assert first.log_dir == f"sqlite:///{run_dir}/mlflow.db"

    second = ResumableMLFlowLogger(run_dir=run_dir, experiment_name="t")  # resume=<run dir> epochs=3
    second.log_hyperparams({"model": {"lr": 0.5}, "epochs": 3, "new": "x"})
    assert MlflowClient(first.log_dir).get_run(run_id).info.status == "RUNNING"
    second.log_metrics({"val/mAP": 0.5}, step=6)
    second.finalize("success")

    client = MlflowClient(first.log_dir)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_id == second.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.params == {"model/lr": "0.5", "epochs": "2", "new": "x"}
    assert run.data.tags["resumed/epochs"] == "3"
    assert {(m.step, m.value) for m in client.get_metric_history(run_id, "val/mAP")} == {(3, 0.25), (6, 0.5)}
    assert run.data.tags["checkpoint/best"] == str(run_dir / "checkpoints" / "best.ckpt")
    assert run.data.tags["checkpoint/last"] == str(run_dir / "checkpoints" / "last.ckpt")
    (artifact,) = client.list_artifacts(run_id, "analysis/pr_curves/step_3")
    assert artifact.path == "analysis/pr_curves/step_3/picture.png"
    assert (run_dir / "mlartifacts").is_dir()


def test_mlflow_store_is_opened_on_rank_zero_only(tmp_path, offline, monkeypatch):
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from ssd_lightning.io.loggers import ResumableMLFlowLogger

    cfg = train_config(["logger=mlflow"], output_dir=tmp_path)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    other = hydra.utils.instantiate(cfg.logger.mlflow)
    other.log_hyperparams({"a": 1})
    other.log_metrics({"val/mAP": 0.5}, step=1)
    other.finalize("success")
    assert not isinstance(other, ResumableMLFlowLogger) and other.log_dir is None
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, no mlflow_run_id
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    assert isinstance(hydra.utils.instantiate(cfg.logger.mlflow), ResumableMLFlowLogger)


# -- through train.py: CSV, TensorBoard, W&B and MLflow together, then resume=<run dir> ----------------------
def _by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {int(row["step"]): float(row[key]) for row in rows if row.get(key)}


@pytest.mark.no_dali  # the loggers: DALI only carries the data
@pytest.mark.slow
def test_train_py_logs_to_wandb_and_mlflow_and_resume_continues_their_runs(shapes_coco, tmp_path, offline):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    overrides = [o for o in demo_run_overrides(shapes_coco) if not o.startswith("trainer.max_epochs=")]
    fit = run_train_py(
        *overrides, "trainer.max_epochs=1", "logger=[default,wandb,mlflow]", f"hydra.run.dir={run_dir}",
        env=offline,
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    resumed = run_train_py(f"resume={run_dir}", "trainer.max_epochs=2", env=offline)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    rows = csv_rows(run_dir / "csv" / "metrics.csv")
    losses, maps = _by_step(rows, "train/loss_step"), _by_step(rows, "val/mAP")
    assert len(maps) == 2 and min(losses) == 0 and len(losses) >= 8  # both parts, every step
    assert (run_dir / "tensorboard").is_dir() and (run_dir / "curves.png").is_file()
    last, best = str(run_dir / "checkpoints" / "last.ckpt"), str(run_dir / "checkpoints" / "best.ckpt")

    stored = wandb_run(run_dir / "wandb")
    assert stored["ids"] == [(run_dir / "wandb_run_id").read_text().strip()] * 2  # one W&B run, two parts
    steps = [row for row in stored["history"] if "trainer/global_step" in row]
    assert {r["trainer/global_step"]: r["train/loss_step"] for r in steps if "train/loss_step" in r} == (
        pytest.approx(losses, rel=1e-6)
    )
    assert {r["trainer/global_step"]: r["val/mAP"] for r in steps if "val/mAP" in r} == pytest.approx(maps)
    assert stored["config"]["task_name"] == "demo"
    assert stored["config"]["data"]["root"] == str(shapes_coco)
    assert stored["config"]["trainer"]["max_epochs"] == 2  # the resumed part's config
    assert stored["summary"]["checkpoint/last"] == last and stored["summary"]["checkpoint/best"] == best

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_id == (run_dir / "mlflow_run_id").read_text().strip()
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss_step")}
    assert history == pytest.approx(losses, rel=1e-6)
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val/mAP")} == pytest.approx(
        maps
    )
    assert run.data.params["task_name"] == "demo" and run.data.params["data/root"] == str(shapes_coco)
    assert run.data.params["trainer/max_epochs"] == "1" and run.data.tags["resumed/trainer/max_epochs"] == "2"
    assert run.data.tags["checkpoint/last"] == last and run.data.tags["checkpoint/best"] == best
    assert run.info.status == "FINISHED"
