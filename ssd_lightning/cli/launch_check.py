"""The multirun launch check: a sweep job must not start its ranks with Lightning's own launcher."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.types import RunMode
from omegaconf import DictConfig

__all__ = ["SLURM_LAUNCHER", "multirun_launch_problem"]

SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
_SPAWNING = ("spawn", "fork", "forkserver")  # start methods whose workers Lightning creates from this process


def _process_count(devices: Any, accelerator: str, cuda_device_count: int) -> int:
    """Processes per node that ``Trainer(devices=...)`` asks for (a list or "0,1" of GPU ids counts them)."""
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    if text in ("-1", "auto"):
        return cuda_device_count if accelerator in ("auto", "gpu", "cuda") else 1
    return int(text) if text.isdigit() else 1


def _strategy_name(strategy: Any) -> tuple[str, bool]:
    """A readable name of ``trainer.strategy`` and whether Lightning spawns its workers from this process."""
    if isinstance(strategy, DictConfig | dict):
        target = str(strategy.get("_target_", ""))
        return target.rsplit(".", 1)[-1] or "?", str(strategy.get("start_method", "popen")) in _SPAWNING
    name = str(strategy)
    return name, any(word in name for word in (*_SPAWNING, "notebook"))


def multirun_launch_problem(
    cfg: DictConfig, hydra_cfg: DictConfig, *, cuda_device_count: int = 0
) -> tuple[str, Any, str] | None:
    """``(key, value, what to do)`` when a multirun job would start its ranks with Lightning's launcher (it
    re-runs the command, ``-m`` included), else None. ``hydra_cfg``: the job's ``hydra`` node."""
    if hydra_cfg.get("mode") != RunMode.MULTIRUN:
        return None
    trainer = cfg.get("trainer") or {}
    accelerator = str(trainer.get("accelerator") or "auto")
    per_node = _process_count(trainer.get("devices", 1), accelerator, cuda_device_count)
    nodes = int(trainer.get("num_nodes") or 1)
    launcher = hydra_cfg.get("launcher") or {}
    if str(launcher.get("_target_", "")) == SLURM_LAUNCHER:
        for key, expected, name in (
            ("tasks_per_node", per_node, "trainer.devices"),
            ("nodes", nodes, "trainer.num_nodes"),
        ):
            value = launcher.get(key)
            if value is not None and int(value) != expected:
                return (
                    f"hydra.launcher.{key}",
                    value,
                    f"must equal {name} ({expected}): srun starts one task per device and Lightning "
                    f"refuses other counts (configs/hydra/launcher/slurm.yaml sets it from {name})",
                )
        return None
    strategy, spawns = _strategy_name(trainer.get("strategy", "auto"))
    if per_node * nodes <= 1 or spawns:
        return None
    return (
        "trainer.strategy",
        strategy,
        f"a multirun (-m) cannot start {per_node * nodes} processes per job with Lightning's launcher (it "
        "re-runs the command, -m included, for every extra rank, so each rank would run the whole sweep); "
        "use trainer.strategy=ddp_spawn (one machine), hydra/launcher=slurm (one SLURM job per sweep job, "
        "srun starts the ranks) or trainer.devices=1",
    )
