"""``validate_config``: cheap checks of a composed config before anything heavy starts.

Hydra already rejects unknown groups/options and misspelled keys (struct mode). This catches what Hydra
cannot: wrong types and impossible values of the keys users override most, and hardware the config asks for
but the machine does not have. Every problem names the key, the value and what is accepted; all problems are
reported together in one :class:`~ssd_lightning.errors.ConfigError`.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ssd_lightning.cli.launch_check import multirun_launch_problem
from ssd_lightning.errors import ConfigError, UserError

__all__ = ["TASKS", "check_writable_dir", "validate_config"]

TASKS = ("fit", "validate", "benchmark_training", "benchmark_inference", "inspect_data")
_GPU_ACCELERATORS = ("gpu", "cuda")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _select(cfg: DictConfig, key: str):
    return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)


class _Problems:
    """Collects ``key=value: what is accepted`` lines."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.lines: list[str] = []

    def check(self, key: str, ok: Callable[[object], bool], accepted: str) -> None:
        """Add a problem when ``key`` is set and ``ok(value)`` is false (unset keys are not checked)."""
        value = _select(self.cfg, key)
        if value is not None and not ok(value):
            self.add(key, value, accepted)

    def add(self, key: str, value, accepted: str) -> None:
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        self.lines.append(f"{key}={value!r}: {accepted}")


def _increasing_ints(value) -> bool:
    items = list(value) if OmegaConf.is_list(value) or isinstance(value, list) else None
    return (
        items is not None
        and all(_is_int(v) and v >= 0 for v in items)
        and all(a < b for a, b in zip(items, items[1:], strict=False))
    )


def _check_values(p: _Problems) -> None:
    p.check("task", lambda v: v in TASKS, f"must be one of {', '.join(TASKS)}")
    p.check("seed", _is_int, "must be an integer (or null for a random seed)")
    p.check("trainer.max_epochs", lambda v: _is_int(v) and (v >= 1 or v == -1), "must be an integer >= 1")
    for key in ("data.batch_size", "data.eval_batch_size"):
        p.check(key, lambda v: _is_int(v) and v > 0, "must be a positive integer (images per device)")
    p.check("data.num_threads", lambda v: _is_int(v) and v > 0, "must be a positive integer (DALI threads)")
    p.check("model.optimizer.lr", lambda v: _is_number(v) and v > 0, "must be a positive number (base LR)")
    p.check("model.optimizer.weight_decay", lambda v: _is_number(v) and v >= 0, "must be a number >= 0")
    p.check("model.scheduler.warmup_steps", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0")
    p.check("model.scheduler.gamma", lambda v: _is_number(v) and 0 < v <= 1, "must be in (0, 1]")
    p.check("model.scheduler.milestones", _increasing_ints, "must be strictly increasing non-negative epochs")
    # null: read from the data (train._num_classes_from_data); synthetic data has nothing to read it from
    p.check("model.net.num_classes", lambda v: _is_int(v) and v >= 2, "must be an integer >= 2, or null")
    if _select(p.cfg, "model.net.num_classes") is None and "num_classes" in (_select(p.cfg, "data") or {}):
        p.add(
            "model.net.num_classes",
            None,
            "null reads it from annotations or image folders; set it for this data",
        )
    p.check("eval_epochs", _increasing_ints, "must be strictly increasing non-negative 0-based epochs")
    if str(_select(p.cfg, "model.net._target_") or "").endswith("ssd300"):
        from ssd_lightning.models.backbones import SSD_BACKBONES

        names = ", ".join(SSD_BACKBONES)
        p.check("model.net.backbone", lambda v: v in SSD_BACKBONES, f"must be one of {names}")
        p.check(
            "model.net.background_prior", lambda v: _is_number(v) and 0 < v < 1, "must be in (0, 1) or null"
        )
        p.check("model.net.zero_init_residual", lambda v: isinstance(v, bool), "must be true or false")


def _check_weight_files(p: _Problems) -> None:
    """``model.init_from``, ``model.trust_checkpoint``: a missing file fails before anything heavy starts."""
    p.check("model.trust_checkpoint", lambda v: isinstance(v, bool), "must be true or false")
    init_from = _select(p.cfg, "model.init_from")
    if init_from is None:
        return
    if _select(p.cfg, "model.nvidia_checkpoint") is not None:
        p.add(
            "model.init_from",
            init_from,
            "model.nvidia_checkpoint is set too: nvidia_checkpoint loads every weight strictly (to evaluate "
            "it), init_from what matches (to fine-tune); keep one",
        )
    elif not _select(p.cfg, "ckpt_path") and not Path(str(init_from)).expanduser().is_file():
        p.add(
            "model.init_from",
            init_from,
            "no such file; point it at an NVIDIA SSD300 checkpoint, a .ckpt of a run of this project or a "
            "state dict (when resuming with ckpt_path=, the file is not read)",
        )


def _check_devices(p: _Problems, cuda_device_count: int) -> None:
    accelerator = str(_select(p.cfg, "trainer.accelerator") or "auto")
    devices = _select(p.cfg, "trainer.devices")
    wants_gpu = accelerator in _GPU_ACCELERATORS
    if wants_gpu and cuda_device_count == 0:
        p.add("trainer.accelerator", accelerator, "this machine has no CUDA device; use trainer=cpu")
    elif accelerator in ("auto", *_GPU_ACCELERATORS) and _is_int(devices) and devices > 1:
        if cuda_device_count == 0:
            p.add(
                "trainer.devices",
                devices,
                "asks for that many GPUs but this machine has none; add trainer=cpu for one CPU process "
                "(or trainer=ddp_cpu for 2 CPU processes)",
            )
        elif devices > cuda_device_count:
            p.add("trainer.devices", devices, f"this machine has {cuda_device_count} CUDA devices")


def _check_multirun_launch(p: _Problems, cuda_device_count: int, hydra_cfg: DictConfig | None) -> None:
    """A multirun job must not start its ranks with Lightning's launcher (cli/launch_check.py)."""
    if hydra_cfg is None and HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
    if hydra_cfg is not None:
        problem = multirun_launch_problem(p.cfg, hydra_cfg, cuda_device_count=cuda_device_count)
        if problem:
            p.add(*problem)


def validate_config(
    cfg: DictConfig, *, cuda_device_count: int | None = None, hydra_cfg: DictConfig | None = None
) -> list[str]:
    """Raise :class:`ConfigError` listing every problem; return warnings (strings) for odd but valid settings.

    ``cuda_device_count`` defaults to ``torch.cuda.device_count()``; ``hydra_cfg`` (the job's ``hydra`` node,
    for the multirun checks) to ``HydraConfig.get()`` when Hydra runs the job.
    """
    if cuda_device_count is None:
        cuda_device_count = torch.cuda.device_count()
    problems = _Problems(cfg)
    _check_values(problems)
    _check_weight_files(problems)
    _check_devices(problems, cuda_device_count)
    _check_multirun_launch(problems, cuda_device_count, hydra_cfg)
    if problems.lines:
        count = len(problems.lines)
        raise ConfigError(
            f"{count} config problem{'s' if count > 1 else ''}:\n  "
            + "\n  ".join(problems.lines)
            + "\n(show the composed config with: python train.py <your overrides> --cfg job)"
        )
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
    """Create ``path`` and prove it takes a file, so a read-only or full output dir fails before training."""
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
