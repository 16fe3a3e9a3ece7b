"""``model.freeze``: keep the first stages of a backbone (or all of it) fixed while the rest trains.

Frozen parameters get ``requires_grad=False`` and their BatchNorm layers stay in eval mode.
"""

from __future__ import annotations

from torch import nn

from ssd_lightning.compat import norm_base_class
from ssd_lightning.errors import ConfigError

__all__ = ["freeze_backbone", "frozen_modules", "keep_frozen_norms_in_eval"]


def freeze_backbone(net: nn.Module, freeze: str | int | None) -> list[nn.Module]:
    """Freeze ``net``'s first ``freeze`` backbone stages (``"backbone"``: all); returns their modules."""
    frozen = frozen_modules(net, freeze)
    for module in frozen:
        module.requires_grad_(False)
    return frozen


def frozen_modules(net: nn.Module, freeze: str | int | None, *, key: str = "model.freeze") -> list[nn.Module]:
    """The modules of the first ``freeze`` backbone stages as they are now in ``net`` (again after a
    SyncBatchNorm conversion); ConfigError for a ``freeze`` not ``"backbone"``, ``None`` or a stage count."""
    if freeze is None:
        return []
    stages = getattr(getattr(net, "feature_extractor", None), "stages", None)
    if not callable(stages):
        raise ConfigError(f"{key}: this network has no backbone stages to freeze ({type(net).__name__})")
    stages = stages()
    if freeze == "backbone":
        count = len(stages)
    elif isinstance(freeze, int) and not isinstance(freeze, bool) and 0 <= freeze <= len(stages):
        count = freeze
    else:
        raise ConfigError(
            f"{key}={freeze!r}: use `backbone`, null, or a number of backbone stages from 0 to {len(stages)} "
            f"(this backbone's stages, first to last: {', '.join(map(_stage_name, stages))})"
        )
    return [module for stage in stages[:count] for module in stage]


def _stage_name(stage: list[nn.Module]) -> str:
    return "+".join(type(m).__name__ for m in stage[:2]) + ("+..." if len(stage) > 2 else "")


def keep_frozen_norms_in_eval(frozen: list[nn.Module]) -> None:
    """Put every BatchNorm inside ``frozen`` in eval mode (call after each ``module.train()``)."""
    norm = norm_base_class()
    for layer in (layer for module in frozen for layer in module.modules() if isinstance(layer, norm)):
        layer.eval()
