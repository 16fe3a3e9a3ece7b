"""``validate_config``: the checks of a composed config that no single constructor can make.

What spans config groups (devices x accelerator, multirun x launcher, model x data), is read by the run
orchestration (``task``, ``seed``) or must fail before anything is built; reported in one ConfigError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ssd_lightning.cli.launch_check import multirun_launch_problem
from ssd_lightning.errors import ConfigError, UserError
from ssd_lightning.io.weights import INIT_FROM_FILES, check_checkpoint_file
from ssd_lightning.optim import increasing_epochs, is_int

__all__ = ["TASKS", "check_writable_dir", "validate_config"]

TASKS = ("fit", "validate", "benchmark_training", "benchmark_inference", "inspect_data")
_GPU_ACCELERATORS = ("gpu", "cuda")


def _select(cfg: DictConfig, key: str):
    return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)


class _Problems(list):
    """``key=value: what is accepted`` lines of ``cfg``."""

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def check(self, key: str, ok: Callable[[object], bool], accepted: str) -> None:
        value = _select(self.cfg, key)
        if value is not None and not ok(value):
            self.add(key, value, accepted)

    def add(self, key: str, value, accepted: str) -> None:
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        self.append(f"{key}={value!r}: {accepted}")


def _check_values(p: _Problems) -> None:
    # read by cli/train.py, which decides from it what to build (its benchmark branch checks only at the end)
    p.check("task", lambda v: v in TASKS, f"must be one of {', '.join(TASKS)}")
    # read by cli/train.py: pl.seed_everything takes 1.5 as 1 silently
    p.check("seed", is_int, "must be an integer (or null for a random seed)")
    # Lightning's Trainer accepts 0 (trains nothing) and strings
    p.check("trainer.max_epochs", lambda v: is_int(v) and (v >= 1 or v == -1), "must be an integer >= 1")
    # data/ checks neither with a data.* key yet (tests/test_configs.py pins data.batch_size here)
    for key in ("data.batch_size", "data.eval_batch_size"):
        p.check(key, lambda v: is_int(v) and v > 0, "must be a positive integer (images per device)")
    # model x data: null reads it from the data (train._num_classes_from_data); synthetic data has nothing
    key = "model.net.num_classes"
    if _select(p.cfg, key) is None and "num_classes" in (_select(p.cfg, "data") or {}):
        p.add(key, None, "null reads it from annotations or image folders; set it for this data")
    # callbacks/eval_schedule.py checks it too; tests/test_configs.py pins it here
    p.check("eval_epochs", increasing_epochs, "must be strictly increasing non-negative 0-based epochs")
    # read by the model's weight files and, as bool(value) ("no" is true), by the Trainer's checkpoint IO
    p.check("model.trust_checkpoint", lambda v: isinstance(v, bool), "must be true or false")


def _check_devices(p: _Problems, cuda_device_count: int) -> None:
    accelerator = str(_select(p.cfg, "trainer.accelerator") or "auto")
    devices = _select(p.cfg, "trainer.devices")
    if accelerator in _GPU_ACCELERATORS and cuda_device_count == 0:
        p.add("trainer.accelerator", accelerator, "this machine has no CUDA device; use trainer=cpu")
    elif accelerator in ("auto", *_GPU_ACCELERATORS) and is_int(devices) and devices > 1:
        if cuda_device_count == 0:
            p.add(
                "trainer.devices",
                devices,
                "asks for that many GPUs but this machine has none; add trainer=cpu for one CPU process "
                "(or trainer=ddp_cpu for 2 CPU processes)",
            )
        elif devices > cuda_device_count:
            p.add("trainer.devices", devices, f"this machine has {cuda_device_count} CUDA devices")


def validate_config(
    cfg: DictConfig, *, cuda_device_count: int | None = None, hydra_cfg: DictConfig | None = None
) -> list[str]:
    """Raise one :class:`ConfigError` listing every problem; return warnings for odd but valid settings."""
    if cuda_device_count is None:
        cuda_device_count = torch.cuda.device_count()
    problems = _Problems(cfg)
    _check_values(problems)
    _check_devices(problems, cuda_device_count)
    if hydra_cfg is None and HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
    if hydra_cfg is not None and (
        launch := multirun_launch_problem(cfg, hydra_cfg, cuda_device_count=cuda_device_count)
    ):
        problems.add(*launch)  # a multirun job must not start its ranks with Lightning's launcher
    if problems:
        raise ConfigError(
            f"{len(problems)} config problem{'s' if len(problems) > 1 else ''}:\n  "
            + "\n  ".join(problems)
            + "\n(show the composed config with: python train.py <your overrides> --cfg job)"
        )
    # read at fit start (not when resuming): a missing file fails now, as it would then
    init_from = _select(cfg, "model.init_from")
    if init_from is not None and not _select(cfg, "ckpt_path"):
        check_checkpoint_file(init_from, what="model.init_from", expected=INIT_FROM_FILES)
    warnings = []
    accelerator = str(_select(cfg, "trainer.accelerator") or "auto")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and cuda_device_count == 0)
    if on_cpu and str(_select(cfg, "trainer.precision")) in ("16-mixed", "16"):
        warnings.append(
            "precision=fp16 on a CPU runs as bf16-mixed (CPUs have no fp16 autocast); "
            "use precision=bf16 to say so"
        )
    if _select(cfg, "model.init_from") is not None and _select(cfg, "task") == "validate":
        warnings.append(
            "model.init_from applies to task=fit only; to validate a file's weights use ckpt_path= (a "
            "checkpoint of this project) or model.nvidia_checkpoint="
        )
    return warnings


def check_writable_dir(path: str, key: str) -> None:
    """Create ``path`` and prove it takes a file, so a read-only output dir fails before training."""
    directory = Path(path)
    probe = directory / f".write_test_{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"{key}={path} is not writable ({e.strerror or e}); point {key} (or hydra.run.dir) at a "
            "writable directory"
        ) from e
