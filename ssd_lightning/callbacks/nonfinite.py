"""Non-finite losses: counted on the device, read at the logging interval, fatal if they persist."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pytorch_lightning as pl
import torch

from ssd_lightning.errors import NonFiniteLossError

log = logging.getLogger(__name__)

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard(pl.Callback):
    """Stops a run that trains on NaN/inf, without a host-device sync per step.

    Non-finite losses are counted on the device and NaN/inf gradients zeroed (``zero_nonfinite_grads``).
    Every ``check_every_n_steps`` (default: ``log_every_n_steps``) and epoch end the counters are read and
    logged; ``patience`` consecutive bad losses raise :class:`NonFiniteLossError` before NaN is saved.
    """

    def __init__(
        self, patience: int = 10, check_every_n_steps: int | None = None, zero_nonfinite_grads: bool = True
    ) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.patience, self.check_every_n_steps = patience, check_every_n_steps
        self.zero_nonfinite_grads = zero_nonfinite_grads
        self._counters: torch.Tensor | None = None
        self._reported_losses = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        # device counters: consecutive bad losses, bad losses, skipped steps, index of the first bad batch
        self._counters = torch.tensor([0, 0, 0, -1], dtype=torch.long, device=device)
        self._step_skipped = torch.zeros((), dtype=torch.bool, device=device)
        self._reported_losses = 0

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        bad = ~torch.isfinite(torch.nn.utils.get_total_norm(grads, foreach=True))
        self._step_skipped = bad
        if self.zero_nonfinite_grads and getattr(trainer.precision_plugin, "scaler", None) is None:
            for grad in grads:
                grad.masked_fill_(bad, 0.0)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        c = self._counters  # set by on_fit_start
        if isinstance(loss, torch.Tensor):
            bad = ~torch.isfinite(loss.detach()).all().to(c.device)
            c[0] = torch.where(bad, c[0] + 1, 0)
            c[1] += bad.long()
            # a Python int is a kernel argument, not a host-to-device copy
            c[3] = torch.where((c[3] < 0) & bad, trainer.fit_loop.total_batch_idx, c[3])
        c[2] += self._step_skipped.long().to(c.device)
        self._step_skipped = torch.zeros_like(self._step_skipped)
        every = self.check_every_n_steps or trainer.log_every_n_steps or 1
        if (batch_idx + 1) % every == 0:
            self._check(trainer, pl_module, log_metrics=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # runs before ModelCheckpoint's epoch-end save (Lightning orders checkpoint callbacks last)
        self._check(trainer, pl_module, log_metrics=False)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, log_metrics: bool) -> None:
        consecutive, losses, skipped, first = self._counters.tolist()  # the one host sync
        if log_metrics:
            metrics = {"train/nonfinite_losses": float(losses), "train/nonfinite_grad_steps": float(skipped)}
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        where = _batch_name(first, trainer.num_training_batches)
        if losses > self._reported_losses:
            log.warning(
                f"non-finite loss on {losses - self._reported_losses} step(s) since the last check "
                f"(first at {where}; {consecutive} in a row now)"
            )
            self._reported_losses = losses
        if trainer.strategy.reduce_boolean_decision(consecutive >= self.patience, all=False):
            raise NonFiniteLossError(
                f"the training loss was NaN/inf for {max(consecutive, self.patience)}+ consecutive steps "
                f"(first at {where}; {losses} non-finite losses, {skipped} steps with NaN/inf gradients "
                f"in total). Stopped before saving NaN weights. Try a lower model.optimizer.lr or "
                f"more model.scheduler.warmup_steps, precision=fp32, and check that batch's data; "
                f"resume from an earlier checkpoint with ckpt_path=..."
            )


def _batch_name(index: int, batches_per_epoch: int | float) -> str:
    """``"epoch E, batch B"`` of Lightning's 0-based batch index across epochs."""
    if index < 0:  # this rank saw none; another rank's losses stopped the run
        return "another rank"
    if isinstance(batches_per_epoch, int) and batches_per_epoch > 0:
        return f"epoch {index // batches_per_epoch}, batch {index % batches_per_epoch}"
    return f"training batch {index}"
