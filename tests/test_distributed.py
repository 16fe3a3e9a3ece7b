"""Lightning DDP on CPU (gloo) through `train.py`, as the launch scripts run it: torchrun with 2 "nodes",
Lightning's own 2-process launcher (the LR rule sees the world size), and a multirun with `ddp_spawn`.

Each run is a subprocess with a timeout: a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

import pytest

from tests.helpers import ProcessGroup, csv_rows, last_checkpoint, launch_train_py, requires_dali

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, requires_dali]

TIMEOUT_S = 240  # a hang, not a slow machine: these runs take 30-100 s on 2 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    return csv_rows(run_dir / "csv" / "metrics.csv")


def _first(rows: list[dict[str, str]], key: str) -> float:
    return next(float(r[key]) for r in rows if r.get(key))


def _run_all(*runs: ProcessGroup) -> list[str]:
    """Outputs (stdout and stderr) of every run; a run still going after ``TIMEOUT_S`` fails the test and
    every process group started here is killed."""
    with contextlib.ExitStack() as stack:
        for run in runs:
            stack.enter_context(run)
        return [run.finish(timeout=TIMEOUT_S).stdout for run in runs]


@pytest.mark.dali  # the shards of each DALI reader
def test_torchrun_two_nodes_train_on_shards_and_agree(shapes_coco, tmp_path):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule
    from ssd_lightning.evaluation import evaluate_coco

    run_dir, port, batch = tmp_path / "run", _free_port(), 4
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    train_args = [
        "experiment=demo",
        "debug=fast",
        "trainer=ddp_cpu",
        "trainer.devices=1",
        "trainer.num_nodes=2",
        "trainer.limit_train_batches=1.0",  # whole shards: the step count shows the sharding
        "trainer.limit_val_batches=1.0",
        # an untrained net with the default head biases scores boxes of every image above 0.05, so every
        # val image shows up in the detections (the demo's 0.99 background prior would leave none)
        "model.net.background_prior=null",
        f"data.root={shapes_coco}",
        f"data.batch_size={batch}",
        "data.eval_batch_size=4",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
    ]
    nodes = [launch_train_py(*train_args, torchrun=[*common, "--node-rank", str(node)]) for node in (0, 1)]
    outputs = _run_all(*nodes)
    for node, (run, out) in enumerate(zip(nodes, outputs, strict=True)):
        assert run.proc.returncode == 0, f"node {node}:\n{out[-4000:]}"
        assert f"GLOBAL_RANK: {node}, MEMBER: {node + 1}/2" in out
    assert "fit finished" in outputs[0] and "fit finished" not in outputs[1]  # rank 0 reports

    # every rank ran one epoch over its own half: the steps of a 2-shard loader, not of the whole set
    dm = CocoDALIDataModule(shapes_coco, batch_size=batch, device="cpu", num_threads=1)
    dm.setup("fit")
    per_shard = len(dm.make_loader("train", shard_id=0, num_shards=2))
    assert per_shard == len(dm.make_loader("train", shard_id=1, num_shards=2))
    assert per_shard < len(dm.make_loader("train", shard_id=0, num_shards=1))
    # written once (by rank 0), not once per node; no temporary file left
    written = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert written == ["best.ckpt", "epoch_0.ckpt", "last.ckpt"]  # best: the epoch's evaluation
    ckpt = last_checkpoint(run_dir)
    assert ckpt["global_step"] == per_shard

    # validation: each rank decoded its shard, rank 0 evaluated the union: every val image, once
    ann = shapes_coco / "annotations" / "instances_val2017.json"
    val_ids = sorted(im["id"] for im in json.loads(ann.read_text())["images"])
    detections = json.loads((run_dir / "detections_epoch_0.json").read_text())
    assert sorted({d["image_id"] for d in detections}) == val_ids
    logged = _first(_metrics(run_dir), "val/mAP")
    assert evaluate_coco(ann, detections, verbose=False)["mAP"] == pytest.approx(logged, abs=1e-6)


@pytest.mark.no_dali  # the LR rule: DALI only carries the data
def test_two_process_ddp_scales_the_lr_by_the_world_size(shapes_coco, tmp_path):
    base_lr, batch = 0.01, 4
    run = launch_train_py(
        "experiment=demo",
        "debug=fast",
        "trainer=ddp_cpu",  # Lightning starts rank 1 itself, re-invoking train.py
        "trainer.limit_val_batches=0",
        f"data.root={shapes_coco}",
        f"data.batch_size={batch}",
        "logger=csv",
        "model/optimizer=sgd",
        f"model.optimizer.lr={base_lr}",
        "model.lr_scaling.rule=linear",
        "model.lr_scaling.reference_batch_size=32",
        "model.scheduler.name=constant",
        "model.scheduler.warmup_steps=0",
        f"paths.log_dir={tmp_path}",  # no hydra.run.dir: the time-stamped run directory of rank 0
    )
    (out,) = _run_all(run)
    assert run.proc.returncode == 0, out[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out
    # rank 1 was started with rank 0's run directory: one run directory, not one per rank
    (run_dir,) = (tmp_path / "demo").iterdir()
    rows = _metrics(run_dir)
    expected = base_lr * 2 * batch / 32
    assert _first(rows, "lr-SGD/other") == pytest.approx(expected, rel=1e-12)


@pytest.mark.no_dali  # the launchers: DALI only carries the data
def test_multirun_with_ddp_spawn_runs_each_job_once(shapes_coco, tmp_path):
    sweep_dir = tmp_path / "sweep"
    run = launch_train_py(
        "-m",
        "experiment=demo",
        "debug=fast",
        "trainer=ddp_cpu",
        "trainer.strategy=ddp_spawn",  # workers are spawned per job; `ddp` would re-run the sweep in rank 1
        "trainer.limit_val_batches=0",
        f"data.root={shapes_coco}",
        "data.batch_size=4",
        "logger=csv",
        "model/optimizer=sgd",
        "model.optimizer.lr=0.01,0.02",
        "model.lr_scaling.rule=linear",
        "model.scheduler.name=constant",
        "model.scheduler.warmup_steps=0",
        f"hydra.sweep.dir={sweep_dir}",
    )
    (out,) = _run_all(run)
    assert run.proc.returncode == 0, out[-4000:]
    assert out.count("Launching 2 jobs locally") == 1  # the sweep ran once, in the main process only
    assert out.count("GLOBAL_RANK: 1, MEMBER: 2/2") == 2  # one rank-1 worker per job
    rows = csv_rows(sweep_dir / "summary.csv")
    assert [r["overrides"] for r in rows] == ["model.optimizer.lr=0.01", "model.optimizer.lr=0.02"]
    for job, lr in enumerate([0.01, 0.02]):
        assert _first(_metrics(sweep_dir / str(job)), "lr-SGD/other") == pytest.approx(lr * 2 * 4 / 32)
