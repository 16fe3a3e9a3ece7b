"""Optimisation rules shared by every LightningModule: LR scaling, parameter groups, LR schedules."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from itertools import pairwise

import torch
from torch import nn

from ssd_lightning import compat
from ssd_lightning.errors import ConfigError

LR_SCALING_RULES = ("linear", "sqrt", "none")
EMA_DECAY_SCALINGS = ("torchvision", "none")
SCHEDULES = ("multistep", "step", "cosine", "constant")


def scale_lr(
    base_lr: float,
    *,
    rule: str = "linear",
    world_size: int = 1,
    batch_size: int,
    reference_batch_size: int = 32,
) -> float:
    """``base_lr`` times ``world_size * batch_size / reference_batch_size`` (``linear``, the NVIDIA SSD300
    rule; ``batch_size`` per device, the reference's ``--bs``), its square root (``sqrt``) or 1 (``none``)."""
    if rule not in LR_SCALING_RULES:
        raise ConfigError(f"lr_scaling.rule must be one of {LR_SCALING_RULES}, got {rule!r}")
    if batch_size <= 0 or world_size <= 0 or reference_batch_size <= 0:
        raise ValueError(
            "lr scaling needs positive sizes, got "
            f"batch_size={batch_size}, world_size={world_size}, reference_batch_size={reference_batch_size}"
        )
    ratio = world_size * batch_size / reference_batch_size
    return base_lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1}[rule]


def scale_ema_decay(
    decay: float,
    *,
    scaling: str = "torchvision",
    world_size: int = 1,
    batch_size: int,
    every_n_steps: int = 1,
    epochs: int,
) -> float:
    """The decay per EMA update: ``torchvision`` multiplies ``1 - decay`` by ``world_size * batch_size *
    every_n_steps / epochs`` (capped at 1; its reference's ``--model-ema-decay``); ``none``: as given."""
    if scaling not in EMA_DECAY_SCALINGS:
        raise ConfigError(f"ema_decay_scaling must be one of {EMA_DECAY_SCALINGS}, got {scaling!r}")
    if scaling == "none":
        return decay
    if min(world_size, batch_size, every_n_steps, epochs) <= 0:
        raise ValueError(
            "EMA decay scaling needs positive sizes, got "
            f"world_size={world_size}, batch_size={batch_size}, every_n_steps={every_n_steps}, "
            f"epochs={epochs}"
        )
    return 1.0 - min(1.0, (1.0 - decay) * world_size * batch_size * every_n_steps / epochs)


def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    norm_weight_decay: float | None = 0.0,
    bias_weight_decay: float | None = 0.0,
    depthwise_weight_decay: float | None = None,
) -> list[dict]:
    """Weight-decay groups ``norm`` (normalisation layers), ``bias``, ``depthwise`` (depthwise-convolution
    weights), ``other``; empty ones dropped, frozen parameters left out; ``None``: ``weight_decay``."""
    norm_types = (compat.norm_base_class(), nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)
    decays = {
        "norm": weight_decay if norm_weight_decay is None else norm_weight_decay,
        "bias": weight_decay if bias_weight_decay is None else bias_weight_decay,
        "depthwise": weight_decay if depthwise_weight_decay is None else depthwise_weight_decay,
        "other": weight_decay,
    }
    buckets: dict[str, list[nn.Parameter]] = {k: [] for k in decays}
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            depthwise = isinstance(module, nn.Conv2d) and module.groups == module.in_channels > 1
            if isinstance(module, norm_types):
                buckets["norm"].append(param)
            else:
                buckets["bias" if name == "bias" else "depthwise" if depthwise else "other"].append(param)
    return [
        {"params": params, "weight_decay": decays[kind], "name": kind}
        for kind, params in buckets.items()
        if params
    ]


def build_optimizer(
    optimizer: Callable[..., torch.optim.Optimizer],
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    **group_decays: float | None,
) -> torch.optim.Optimizer:
    """The (partial) optimizer on :func:`param_groups` of ``model`` (``group_decays``: its keywords)."""
    return optimizer(param_groups(model, weight_decay, **group_decays), lr=lr)


def partial_kwarg(optimizer: Callable, key: str, default: float | None = None) -> float | None:
    """Read a keyword (``lr``, ``weight_decay``) stored in a ``functools.partial`` optimizer from config."""
    return optimizer.keywords.get(key, default) if isinstance(optimizer, functools.partial) else default


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    """An integer that is not a bool (what a config's count, seed or epoch must be)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def increasing_epochs(value: object) -> bool:
    """A non-string iterable of strictly increasing non-negative integers (milestones, evaluation epochs)."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        return False
    items = list(value)
    return all(is_int(v) and v >= 0 for v in items) and all(a < b for a, b in pairwise(items))


def check_optimizer_args(lr: object, weight_decay: object, *, key: str = "model.optimizer") -> None:
    """:class:`ConfigError` unless ``lr`` and ``weight_decay`` are each ``None`` or a number >= 0."""
    if lr is not None and not (_is_number(lr) and lr >= 0):
        raise ConfigError(f"{key}.lr={lr!r}: must be a number >= 0 (the base LR before scaling)")
    if weight_decay is not None and not (_is_number(weight_decay) and weight_decay >= 0):
        raise ConfigError(f"{key}.weight_decay={weight_decay!r}: must be a number >= 0")


def check_scheduler_args(scheduler: Mapping, *, key: str = "model.scheduler") -> None:
    """:class:`ConfigError` for a bad ``warmup_steps``, ``gamma`` or ``milestones`` (``None``: unchecked)."""
    warmup, gamma, milestones = (scheduler.get(k) for k in ("warmup_steps", "gamma", "milestones"))
    if warmup is not None and not (is_int(warmup) and warmup >= 0):
        raise ConfigError(f"{key}.warmup_steps={warmup!r}: must be an integer >= 0 (optimizer steps)")
    if gamma is not None and not (_is_number(gamma) and 0 < gamma <= 1):
        raise ConfigError(f"{key}.gamma={gamma!r}: must be in (0, 1] (the LR factor per decay)")
    if milestones is not None and not increasing_epochs(milestones):
        listed = isinstance(milestones, Iterable) and not isinstance(milestones, str)
        shown = list(milestones) if listed else milestones
        raise ConfigError(f"{key}.milestones={shown!r}: must be strictly increasing non-negative epochs")


def lr_factor(
    step: int,
    *,
    schedule: str,
    steps_per_epoch: int,
    total_steps: int,
    warmup_steps: int = 0,
    milestones: Iterable[int] = (),
    gamma: float = 0.1,
    step_size: int = 1,
    min_factor: float = 0.0,
) -> float:
    """Multiplier of the peak LR at 0-based optimizer ``step``: warm-up ``step / warmup_steps`` (LR 0 first,
    as the reference), then ``multistep`` (× ``gamma`` at each of ``milestones``), ``step`` (× ``gamma``
    every ``step_size`` epochs), ``cosine`` (to ``min_factor`` at ``total_steps``) or ``constant``."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"scheduler.name must be one of {SCHEDULES}, got {schedule!r}")
    warm = step / warmup_steps if warmup_steps > 0 and step < warmup_steps else 1.0
    epoch = step // max(1, steps_per_epoch)
    if schedule == "multistep":
        decay = gamma ** sum(1 for m in milestones if epoch >= m)
    elif schedule == "step":
        decay = gamma ** (epoch // max(1, step_size))
    elif schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, max(0.0, (step - warmup_steps) / span))
        decay = min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))
    else:
        decay = 1.0
    return warm * decay


def warmup_iterations(steps_per_epoch: int, warmup_steps: int = 0, warmup_epochs: float = 0.0) -> int:
    """The LR warm-up in optimizer steps: ``warmup_steps`` plus ``warmup_epochs`` (fractional) epochs."""
    return int(warmup_steps or 0) + round(float(warmup_epochs or 0.0) * steps_per_epoch)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    steps_per_epoch: int,
    max_epochs: int,
    warmup_steps: int = 0,
    warmup_epochs: float = 0.0,
    milestones: Iterable[int] = (),
    schedule: str,
    gamma: float = 0.1,
    step_size: int = 1,
    min_factor: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-iteration ``LambdaLR`` of :func:`lr_factor`; ``warmup_epochs`` adds to ``warmup_steps``."""
    fn = functools.partial(
        lr_factor,
        schedule=schedule,
        steps_per_epoch=steps_per_epoch,
        total_steps=steps_per_epoch * max_epochs,
        warmup_steps=warmup_iterations(steps_per_epoch, warmup_steps, warmup_epochs),
        milestones=tuple(milestones),
        gamma=gamma,
        step_size=step_size,
        min_factor=min_factor,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
