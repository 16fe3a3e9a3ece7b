"""What the tests share: composed configs and the override lists of the common small runs, a quiet CPU
Trainer, `train.py` (or any script) as a subprocess, process groups that are always cleaned up, and
readers of what a run wrote (checkpoints, ``metrics.csv``).

Every subprocess gets its environment from :func:`subprocess_env`: the repository on ``PYTHONPATH`` (the
``tests.*`` callbacks and data modules load from any working directory) and ``HYDRA_FULL_ERROR`` unset (the
one-line ``Error:`` a user sees) unless a test asks for full tracebacks; the session's split-check cache
(``SSD_LIGHTNING_CACHE_DIR``, set by ``conftest.py``) is inherited.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, open_dict

from ssd_lightning.data.categories import CategoryMap

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
TRAIN_PY = REPO_ROOT / "train.py"

HAS_DALI = importlib.util.find_spec("nvidia.dali") is not None
requires_dali = pytest.mark.skipif(not HAS_DALI, reason="needs NVIDIA DALI")


# ------------------------------------------------------------------------------------------------ configs
def compose_config(overrides: Iterable[str] = (), config_name: str = "train") -> DictConfig:
    """``configs/<config_name>.yaml`` composed with ``overrides`` as train.py does, ``hydra`` node kept."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="test"):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)


def train_config(
    overrides: Iterable[str] = (), *, output_dir: Path | None = None, keep_hydra: bool = False
) -> DictConfig:
    """The config ``train(cfg)`` receives under ``@hydra.main``: composed, its ``hydra`` node installed as the
    runtime ``HydraConfig`` (``${hydra:...}`` resolves) and then removed unless ``keep_hydra``.
    ``output_dir`` becomes ``paths.output_dir``."""
    from hydra.core.hydra_config import HydraConfig

    prefix = [f"paths.output_dir={output_dir}"] if output_dir is not None else []
    cfg = compose_config([*prefix, *overrides])
    HydraConfig.instance().set_config(cfg)
    if not keep_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


# A small SSD300 fit on synthetic batches (no DALI; no annotations, so no COCO mAP), quiet, CSV-logged: add
# the steps, epochs and whatever the test is about.
SYNTHETIC_SSD_RUN = (
    "data=synthetic",
    "data.batch_size=2",
    "model.net.backbone=resnet18",
    "trainer=cpu",
    "+trainer.limit_val_batches=0",
    "+trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "~callbacks.coco_map",
    "eval_epochs=[]",
    "logger=csv",
)


def demo_run_overrides(data_root: Path) -> list[str]:
    """Two tiny epochs of the demo experiment on the shapes COCO set at ``data_root`` (batches of 4, 5 for
    evaluation), logged every step, evaluated after epoch 0 and the last one, a 2-step warm-up."""
    return [
        "experiment=demo",
        f"data.root={data_root}",
        "data.batch_size=4",
        "data.eval_batch_size=5",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1",
        "eval_epochs=[0]",
        "model.scheduler.warmup_steps=2",
    ]


#: Overrides of a one-epoch fit on a format whose class count comes from its files; the heads' prior makes the
#: untrained network's scores pass the 0.05 threshold, so the evaluation has detections to score.
OWN_DATA_FIT = [
    "model.net.num_classes=null",
    "model.net.background_prior=0.5",
    "model.scheduler.warmup_steps=1",
    "trainer.max_epochs=1",
]


def annotations_by_image(annotation_file: Path) -> dict[int, list[dict]]:
    """A COCO file's annotations grouped by image id (every image, an empty list for those without)."""
    data = json.loads(Path(annotation_file).read_text())
    grouped: dict[int, list[dict]] = {image["id"]: [] for image in data["images"]}
    for annotation in data["annotations"]:
        grouped[annotation["image_id"]].append(annotation)
    return grouped


def quiet_trainer(root: Path | None = None, callbacks: Sequence = (), **kwargs: object):
    """A one-device CPU ``pl.Trainer`` without logger, progress bar or model summary, checkpointing only if
    ``callbacks`` hold a ``ModelCheckpoint``, writing under ``root``; ``kwargs`` override any of these."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    options: dict[str, object] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    if root is not None:
        options["default_root_dir"] = str(root)
    return pl.Trainer(callbacks=list(callbacks), **{**options, **kwargs})


# ------------------------------------------------------------------------------------------- subprocesses
def subprocess_env(env: Mapping[str, str] | None = None, *, full_error: bool = False) -> dict[str, str]:
    """This process's environment for a child: the repository first on ``PYTHONPATH``, ``HYDRA_FULL_ERROR=1``
    only if ``full_error`` (absent otherwise), then ``env`` on top."""
    out = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    if full_error:
        out["HYDRA_FULL_ERROR"] = "1"
    out.update(env or {})
    return out


def processes_in_group(pgid: int) -> list[str]:
    """``"pid pgid stat args"`` of the live (non-zombie) processes whose process group is ``pgid``."""
    ps = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat=,args="], capture_output=True, text=True)
    rows = (line.split(None, 3) for line in ps.stdout.splitlines())
    return [" ".join(r) for r in rows if len(r) >= 3 and r[1] == str(pgid) and not r[2].startswith("Z")]


def kill_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM to every process of group ``pgid``, SIGKILL to whatever is left after ``grace_s`` seconds."""
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            return  # the group is gone
        deadline = time.monotonic() + wait_s
        while processes_in_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not processes_in_group(pgid):
            return


class ProcessGroup:
    """``argv`` started in a session (and process group) of its own, as a context manager whose exit kills
    whatever of the group is still running (a hang never outlives its test).

    Output is captured as text; with ``merge_stderr`` stderr goes into stdout. ``signal`` reaches the leader
    or the whole group (a terminal's Ctrl-C); ``finish`` waits and fails the test on a timeout.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: Path = REPO_ROOT,
        env: Mapping[str, str] | None = None,
        full_error: bool = False,
        merge_stderr: bool = True,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.proc = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=subprocess_env(env, full_error=full_error),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.pgid = self.proc.pid

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self, grace_s: float = 5.0) -> str:
        """Ends the group (SIGTERM, then SIGKILL after ``grace_s`` seconds), reaps the leader and returns its
        output (stdout, then stderr)."""
        kill_group(self.pgid, grace_s)
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            stdout, stderr = self.proc.communicate(timeout=30)
        except (subprocess.TimeoutExpired, ValueError):  # a descendant outside the group holds a pipe; read
            return ""
        return (stdout or "") + (stderr or "")

    def signal(self, signum: int, *, to_group: bool = False) -> None:
        """``signum`` to the leader (``kill <pid>``) or to the whole group (a terminal's Ctrl-C)."""
        if to_group:
            os.killpg(self.pgid, signum)
        else:
            self.proc.send_signal(signum)

    def _fail(self, why: str) -> None:
        output = self.kill(grace_s=0)
        pytest.fail(f"{' '.join(self.argv[1:4])} ... {why}:\n{output[-6000:]}")

    def wait_for(self, marker: Path, timeout: float) -> None:
        """Returns once ``marker`` exists; fails the test (killing the group) if the leader ends first or
        ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while not marker.exists():
            if self.proc.poll() is not None:
                self._fail(f"ended (exit {self.proc.returncode}) before {marker} appeared")
            if time.monotonic() > deadline:
                self._fail(f"wrote no {marker} within {timeout:.0f} s")
            time.sleep(0.1)

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """Waits for the leader; its output as a ``CompletedProcess`` (``stderr`` is None when merged).
        A leader still running after ``timeout`` seconds fails the test (a hang), its group killed."""
        try:
            stdout, stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._fail(f"did not end within {timeout:.0f} s (hang?)")
        return subprocess.CompletedProcess(self.argv, self.proc.returncode, stdout, stderr)

    def leftovers(self, within_s: float = 20.0) -> list[str]:
        """The group's processes still alive ``within_s`` seconds after the leader ended (none: ``[]``)."""
        deadline = time.monotonic() + within_s
        while (left := processes_in_group(self.pgid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left


def run_script(
    script: Path | str,
    *args: str,
    cwd: Path = REPO_ROOT,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    full_error: bool = False,
    prefix: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """``python [prefix] <script> <args>`` in its own process group, to the end: stdout and stderr apart.
    Past ``timeout`` seconds the test fails and every process the run started is killed."""
    with ProcessGroup(
        [sys.executable, *prefix, str(script), *args],
        cwd=cwd,
        env=env,
        full_error=full_error,
        merge_stderr=False,
    ) as group:
        return group.finish(timeout)


def run_train_py(
    *overrides: str,
    cwd: Path = REPO_ROOT,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    full_error: bool = False,
) -> subprocess.CompletedProcess:
    """``python train.py <overrides>`` (``-m`` among them for a multirun): see :func:`run_script`."""
    return run_script(TRAIN_PY, *overrides, cwd=cwd, env=env, timeout=timeout, full_error=full_error)


def launch_train_py(
    *overrides: str,
    torchrun: Sequence[str] | None = None,
    cwd: Path = REPO_ROOT,
    env: Mapping[str, str] | None = None,
) -> ProcessGroup:
    """``python train.py <overrides>`` (``python -m torch.distributed.run <torchrun> train.py ...`` with
    ``torchrun``) started in a :class:`ProcessGroup` of its own, stderr merged into stdout."""
    prefix = ["-m", "torch.distributed.run", *torchrun] if torchrun is not None else []
    return ProcessGroup([sys.executable, *prefix, str(TRAIN_PY), *overrides], cwd=cwd, env=env)


# ----------------------------------------------------------------------------------------- what runs wrote
def load_checkpoint(path: Path) -> dict:
    """A Lightning checkpoint file, on the CPU, plain types only (``weights_only``)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def last_checkpoint(run_dir: Path) -> dict:
    """``<run_dir>/checkpoints/last.ckpt`` loaded by :func:`load_checkpoint`."""
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")


def csv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV file with a header (``metrics.csv``, ``summary.csv``), values as strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def metric_by_step(run_dir: Path, key: str) -> dict[int, float]:
    """``{global_step: value}`` of a per-step metric in ``<run_dir>/csv/metrics.csv``."""
    rows = csv_rows(run_dir / "csv" / "metrics.csv")
    return {int(row["step"]): float(row[key]) for row in rows if row.get(key)}


def metric_by_epoch(run_dir: Path, key: str) -> dict[int, float]:
    """``{epoch: value}`` of an epoch-level metric (``train/loss_epoch``) in ``<run_dir>/csv/metrics.csv``."""
    rows = csv_rows(run_dir / "csv" / "metrics.csv")
    return {int(row["epoch"]): float(row[key]) for row in rows if row.get(key)}


def encode_images(coder, boxes_ltrb, labels):
    """``coder.encode`` per image, stacked: (boxes_cxcywh (N, 4, B), labels (N, B)), the loss's layout."""
    encoded = [coder.encode(b, lab) for b, lab in zip(boxes_ltrb, labels, strict=True)]
    return torch.stack([e[0] for e in encoded]).transpose(1, 2), torch.stack([e[1] for e in encoded])


class BrightBox:
    """Duck-typed Detector on ``device``: the box around the bright pixels (white: ~2 after normalising,
    grey noise: < 0) of each input, in the image's pixels; records the device of every batch in ``seen``."""

    image_size = 300
    categories = CategoryMap.from_names(["box"])
    net = "a network"

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.seen: list[torch.device] = []

    def detect(self, images: torch.Tensor, sizes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        self.seen.append(images.device)
        out = []
        for image, (height, width) in zip(images.cpu(), sizes, strict=True):
            ys, xs = torch.nonzero(image.mean(0) > 1.0, as_tuple=True)  # white: ~2, the grey noise: < 0
            box = torch.stack([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]).float() / self.image_size
            scale = torch.tensor([width, height, width, height], dtype=torch.float32)
            out.append(
                {"boxes": (box * scale)[None], "scores": torch.tensor([0.9]), "labels": torch.tensor([1])}
            )
        return out
