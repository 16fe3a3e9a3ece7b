"""Exponential moving average of a network's weights, the torchvision classification recipe's way."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

__all__ = ["ExponentialMovingAverage"]


class ExponentialMovingAverage(AveragedModel):
    """``AveragedModel`` keeping ``ema = decay * ema + (1 - decay) * current`` for parameters and float
    buffers (integer ones copied); the first update after construction or :meth:`reset` copies the
    network. It never requires gradients, so DDP and the optimizer never see it.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        super().__init__(model, multi_avg_fn=self._average, use_buffers=True)
        self.module.requires_grad_(False)

    @torch.no_grad()
    def _average(self, averaged: list[Tensor], current: list[Tensor], num_averaged: Tensor | int) -> None:
        # AveragedModel groups tensors by device and dtype, so each call holds one dtype.
        if averaged and torch.is_floating_point(averaged[0]):
            for avg, cur in zip(averaged, current, strict=True):
                avg.lerp_(cur, 1.0 - self.decay)
        else:
            for avg, cur in zip(averaged, current, strict=True):
                avg.copy_(cur)

    def update_at_step(self, model: nn.Module, step: int, *, every_n_steps: int, warmup_steps: int) -> None:
        """Update once after optimizer ``step`` when ``step % every_n_steps == 0``; up to ``warmup_steps``
        the average restarts from the weights after every update, as torchvision's reference does."""
        if step == getattr(self, "_last_step", -1) or step % every_n_steps != 0:
            return
        self._last_step = step
        self.update_parameters(model)
        if step <= warmup_steps:
            self.reset()

    def reset(self) -> None:
        """Make the next update copy the network."""
        self.n_averaged.zero_()
