"""Networks by name, so a checkpoint can say how to rebuild its network with plain values.

Each builder of :data:`NETWORK_BUILDERS` records ``net.architecture = {"builder": name, "args": {...}}``,
the arguments that decide the network's shape; :func:`build_network` turns it back into the network.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ssd_lightning.models.mobilenetv2 import mobilenet_v2
from ssd_lightning.models.ssd300 import ssd300

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "NETWORK_BUILDERS", "build_network"]

#: Every network's input is ``(pixel - mean) / std`` per RGB channel, 0..255 scale (torchvision's ImageNet).
IMAGENET_MEAN: tuple[float, float, float] = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD: tuple[float, float, float] = (0.229 * 255, 0.224 * 255, 0.225 * 255)

#: Builder name (as recorded in ``net.architecture["builder"]``) -> keyword-only builder.
NETWORK_BUILDERS: dict[str, Callable[..., nn.Module]] = {"ssd300": ssd300, "mobilenet_v2": mobilenet_v2}


def build_network(architecture: Mapping[str, Any]) -> nn.Module:
    """The network a ``net.architecture`` record describes, randomly initialised; ValueError if it cannot."""
    name = architecture.get("builder") if isinstance(architecture, Mapping) else None
    if name not in NETWORK_BUILDERS:
        raise ValueError(f"unknown network builder {name!r}; known: {sorted(NETWORK_BUILDERS)}")
    args = dict(architecture.get("args") or {})
    try:
        return NETWORK_BUILDERS[name](**args)
    except TypeError as e:  # an argument this version's builder does not take
        raise ValueError(f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())}): {e}") from None
