"""OmegaConf resolvers that ``configs/`` uses, registered without importing torch or Lightning.

``${if:cond,a,b}``, ``${eval_resize:weights,default}`` and the run directories of ``resume=``/``run_dir=``;
each stays registered while old run directories use it. Light, for ``train.py --cfg job`` and ``--help``.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from ssd_lightning.cli.run_dir import hydra_subdir_for, log_name_for, output_dir_for

__all__ = ["eval_resize_for_weights", "register_resolvers"]


def eval_resize_for_weights(weights: str | None, default: int) -> int:
    """Torchvision's resize before the centre crop for ``weights`` (256 for IMAGENET1K_V1, 232 for V2)."""
    if weights is None:
        return default
    from ssd_lightning.models.mobilenetv2 import resolve_weights  # torchvision: only when weights are named

    resolved = resolve_weights(weights)
    return default if resolved is None else int(resolved.transforms().resize_size[0])


def register_resolvers() -> None:
    """Register every resolver ``configs/`` uses (idempotent)."""
    OmegaConf.register_new_resolver("if", lambda cond, a, b: a if cond else b, replace=True)
    OmegaConf.register_new_resolver("eval_resize", eval_resize_for_weights, replace=True)
    OmegaConf.register_new_resolver("run_output_dir", output_dir_for, replace=True)
    OmegaConf.register_new_resolver("hydra_subdir", hydra_subdir_for, replace=True)
    OmegaConf.register_new_resolver("log_name", log_name_for, replace=True)
