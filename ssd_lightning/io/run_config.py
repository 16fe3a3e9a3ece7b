"""Run configs written by earlier versions: class paths that have moved since, mapped to where they live."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig

__all__ = ["MOVED_TARGETS", "update_moved_targets"]

#: ``_target_`` values of stored run configs (``<run>/.hydra/config.yaml``) -> their current place.
MOVED_TARGETS = {
    "ssd_lightning.loggers.ContinuingCSVLogger": "ssd_lightning.io.loggers.ContinuingCSVLogger",
    "ssd_lightning.models.mobilenet_v2": "ssd_lightning.modules.nets.build_mobilenet_v2",
}


def update_moved_targets(cfg: DictConfig | ListConfig) -> list[str]:
    """Point every moved ``_target_`` in ``cfg`` at its current place (in place); the keys changed."""
    changed: list[str] = []

    def walk(node: DictConfig | ListConfig, prefix: str) -> None:
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
        for key, value in list(items):
            if isinstance(value, DictConfig | ListConfig):
                walk(value, f"{prefix}{key}.")
            elif key == "_target_" and value in MOVED_TARGETS:
                node[key] = MOVED_TARGETS[value]
                changed.append(f"{prefix}{key}")

    walk(cfg, "")
    return changed
