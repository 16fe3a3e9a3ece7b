"""Pieces every LightningModule here shares: the recipe's optimizer + per-iteration LR schedule."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn
from torchmetrics import Metric

from ssd_lightning import compat
from ssd_lightning.errors import ConfigError
from ssd_lightning.io.model_record import MODEL_KEY, make_model_record
from ssd_lightning.io.weights import init_from_checkpoint
from ssd_lightning.models import IMAGENET_MEAN, IMAGENET_STD
from ssd_lightning.models.cpu_bf16 import run_strided_depthwise_in_float32
from ssd_lightning.optim import build_optimizer, build_scheduler, partial_kwarg, scale_lr

log = logging.getLogger(__name__)


class BatchMean(Metric):
    """Mean of per-batch values weighted by their batch sizes, over the epoch and over all DDP ranks.

    For epoch metrics such as ``train/loss_epoch``: ``update`` only adds on the device (no host sync, no
    collective); ranks are reduced once, in ``compute`` at the end of the epoch, whereas
    ``self.log(..., on_step=True, sync_dist=True)`` all-reduces every step. The states of an unfinished
    epoch go into checkpoints through :func:`save_epoch_metric_states` (torchmetrics leaves them out), so
    a resumed epoch averages all its batches.
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, batch_size: int) -> None:
        self.total += value.detach().float() * batch_size
        self.count += batch_size

    def compute(self) -> torch.Tensor:
        return self.total / self.count


def per_device_batch_size(
    trainer: pl.Trainer, rule: str = "LR scaling", switch_off: str = "model.lr_scaling.rule=none"
) -> int:
    """The per-device training batch size (the reference's ``--bs``), read from the datamodule. ``rule``
    needs it and ``switch_off`` turns that rule off: both name the way out in the error."""
    datamodule = getattr(trainer, "datamodule", None)
    batch_size = getattr(datamodule, "batch_size", None)
    if batch_size is None:
        raise ConfigError(
            f"{rule} needs the per-device batch size: the datamodule must expose `batch_size` "
            f"(or set {switch_off})"
        )
    return int(batch_size)


def steps_per_epoch(trainer: pl.Trainer) -> int:
    """Optimizer steps in one training epoch, as Lightning will run them."""
    total = trainer.estimated_stepping_batches  # also sets up the train dataloader, so its length is known
    batches = trainer.num_training_batches
    if math.isfinite(batches):
        return max(1, math.ceil(batches / trainer.accumulate_grad_batches))
    if trainer.max_epochs is not None and trainer.max_epochs > 0 and math.isfinite(total):
        return max(1, int(total) // trainer.max_epochs)
    raise ValueError("the per-iteration LR schedule needs a training dataloader with a length")


def restore_train_loader_state(trainer: pl.Trainer) -> None:
    """Restore resumable training loaders to their mid-epoch position (call in ``on_train_start``).

    Lightning restores loader states only when it first sets up the train dataloader after loading the
    checkpoint; :func:`steps_per_epoch` (``estimated_stepping_batches``) sets it up earlier, during
    ``configure_optimizers``, so the states would silently be dropped and a resumed epoch would restart its
    data from the first batch.
    """
    compat.load_pending_loader_states(trainer)


EPOCH_METRIC_STATES = "epoch_metric_states"  # the checkpoint's key


def save_epoch_metric_states(
    module: pl.LightningModule, checkpoint: dict, metrics: Mapping[str, Metric]
) -> None:
    """Put the states of epoch metrics (``train/loss_epoch``) into ``checkpoint`` when it is written in the
    middle of an epoch (call in ``on_save_checkpoint``; Lightning calls it on every rank).

    torchmetrics states are not part of the ``state_dict``, so a run resumed mid-epoch would average only
    the batches after the resume. Every state of ``metrics`` must be a sum (``dist_reduce_fx="sum"``:
    :class:`BatchMean`, micro-averaged accuracy); they are summed over the DDP ranks here (one all-reduce,
    only for a mid-epoch checkpoint) and :func:`load_epoch_metric_states` gives the sum to rank 0, zeros
    to the others, so the epoch's end reduces them to the uninterrupted run's value at any world size.
    Written at an epoch's end (``ModelCheckpoint``), the states are the finished epoch's: nothing is saved.
    """
    trainer = module.trainer
    progress = trainer.fit_loop.epoch_progress.current
    if trainer.state.fn != "fit" or progress.started == progress.processed:  # Lightning's "epoch unfinished"
        return
    names, values = [], []
    for name, metric in metrics.items():
        for key, value in metric.metric_state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{name}.{key}: only tensor (sum) states can be checkpointed, got {type(value)}"
                )
            names.append((name, key, value.dtype, value.shape))
            values.append(value.detach().reshape(-1).double())  # exact for counts below 2**53
    if not values:
        return
    flat = torch.cat(values)
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for (name, key, dtype, shape), part in zip(
        names, flat.cpu().split([v.numel() for v in values]), strict=True
    ):
        states.setdefault(name, {})[key] = part.reshape(shape).to(dtype)
    checkpoint[EPOCH_METRIC_STATES] = states


def load_epoch_metric_states(
    module: pl.LightningModule, checkpoint: Mapping, metrics: Mapping[str, Metric]
) -> None:
    """Restore what :func:`save_epoch_metric_states` saved (call in ``on_load_checkpoint``): the sums on
    rank 0, zeros on the other ranks. Checkpoints without them (end of an epoch, older files) change
    nothing."""
    saved = checkpoint.get(EPOCH_METRIC_STATES) or {}
    for name, metric in metrics.items():
        for key, value in (saved.get(name) or {}).items():
            current = getattr(metric, key)
            value = value.to(device=current.device, dtype=current.dtype).reshape(current.shape)
            setattr(metric, key, value if module.global_rank == 0 else torch.zeros_like(current))


def total_epochs(trainer: pl.Trainer, epoch_steps: int) -> int:
    """Epochs the schedule spans: ``trainer.max_epochs``, or what ``trainer.max_steps`` amounts to."""
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        return trainer.max_epochs
    return max(1, math.ceil(trainer.estimated_stepping_batches / epoch_steps))


def describe_lr(
    base_lr: float, lr: float, rule: str, world_size: int, step_batch: int, accumulate: int, reference: int
) -> str:
    """The log line stating the LR a run uses and how the scaling rule got there."""
    if rule == "none":
        return f"LR {lr:.6g} (model.lr_scaling.rule=none: the base LR as given)"
    per_device = step_batch // accumulate
    return (
        f"LR {lr:.6g} = base {base_lr:.6g} x {rule} rule of the global batch {world_size * step_batch} "
        f"({world_size} device(s) x {per_device} per device x {accumulate} accumulated) / {reference}"
    )


def convert_sync_batchnorm(module: pl.LightningModule, net: nn.Module, enabled: bool) -> nn.Module:
    """``net`` with SyncBatchNorm layers when ``enabled`` and training on more than one GPU process (call in
    ``configure_model``, before the optimizer is built; parameters are the same tensors). On CPU it warns
    and returns ``net`` unchanged: torch's SyncBatchNorm runs on GPU modules only."""
    trainer = module.trainer
    if not enabled or trainer.world_size <= 1 or isinstance(net, nn.SyncBatchNorm) or _has_sync_bn(net):
        return net
    if isinstance(trainer.accelerator, CPUAccelerator):
        rank_zero_warn("sync_batchnorm=True is ignored on CPU: torch's SyncBatchNorm needs GPU modules")
        return net
    return nn.SyncBatchNorm.convert_sync_batchnorm(net)


def float32_strided_depthwise_on_cpu(module: pl.LightningModule, *nets: nn.Module | None) -> None:
    """On CPU with bf16-mixed precision, run ``nets``' strided depthwise convolutions in float32 (call in
    ``configure_model``): oneDNN's bf16 kernels for them are the slow part of a MobileNetV2 step there
    (:mod:`ssd_lightning.models.cpu_bf16`). Anywhere else nothing changes."""
    trainer = module.trainer
    bf16_mixed = getattr(trainer, "precision", None) == "bf16-mixed"
    if not isinstance(trainer.accelerator, CPUAccelerator) or not bf16_mixed:
        return
    changed = sum(run_strided_depthwise_in_float32(net) for net in nets if net is not None)
    if changed:
        log.info("CPU bf16: %d strided depthwise convolutions run in float32 (faster there)", changed)


def _has_sync_bn(net: nn.Module) -> bool:
    return any(isinstance(m, nn.SyncBatchNorm) for m in net.modules())


def configure_recipe_optimizers(
    module: pl.LightningModule,
    net: nn.Module,
    *,
    optimizer: Callable[..., torch.optim.Optimizer],
    lr_scaling: Mapping | None,
    scheduler: Mapping | None,
    norm_weight_decay: float | None = 0.0,
    bias_weight_decay: float | None = 0.0,
    depthwise_weight_decay: float | None = None,
) -> dict:
    """Optimizer on weight-decay groups with the LR scaled at run time, plus a per-iteration schedule.

    The LR rule is evaluated here, from ``trainer.world_size`` and the datamodule's per-device batch, so
    ``trainer.devices=...``/``trainer.num_nodes=...`` overrides are honoured without touching the config.
    """
    trainer = module.trainer
    base_lr = partial_kwarg(optimizer, "lr")
    if base_lr is None:
        raise ConfigError("model.optimizer.lr must be set (the base LR before scaling)")
    lr_scaling = dict(lr_scaling or {"rule": "none"})
    rule = lr_scaling.get("rule", "linear")
    accumulate = int(trainer.accumulate_grad_batches)
    # the batch of one optimizer step: per device x devices x accumulated batches
    step_batch = per_device_batch_size(trainer) * accumulate if rule != "none" else 1
    reference_batch_size = int(lr_scaling.get("reference_batch_size", 32))
    lr = scale_lr(
        base_lr,
        rule=rule,
        world_size=trainer.world_size,
        batch_size=step_batch,
        reference_batch_size=reference_batch_size,
    )
    if trainer.is_global_zero:
        log.info(
            "%s",
            describe_lr(base_lr, lr, rule, trainer.world_size, step_batch, accumulate, reference_batch_size),
        )
    opt = build_optimizer(
        optimizer,
        net,
        lr=lr,
        weight_decay=partial_kwarg(optimizer, "weight_decay", 0.0) or 0.0,
        norm_weight_decay=norm_weight_decay,
        bias_weight_decay=bias_weight_decay,
        depthwise_weight_decay=depthwise_weight_decay,
    )
    if not scheduler:
        return {"optimizer": opt}
    scheduler = dict(scheduler)
    schedule = scheduler.pop("name", "constant")
    epoch_steps = steps_per_epoch(trainer)
    if trainer.is_global_zero:
        log.info(
            "LR schedule %s over %d optimizer steps per epoch, warm-up %s optimizer steps",
            schedule,
            epoch_steps,
            int(scheduler.get("warmup_steps", 0) or 0)
            + epoch_steps * int(scheduler.get("warmup_epochs", 0) or 0),
        )
    lr_scheduler = build_scheduler(
        opt,
        schedule=schedule,
        steps_per_epoch=epoch_steps,
        max_epochs=total_epochs(trainer, epoch_steps),
        **scheduler,
    )
    return {"optimizer": opt, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step", "frequency": 1}}


def check_num_classes(module: pl.LightningModule, net_num_classes: int | None, key: str) -> None:
    """Fail early, naming the config key, when the network's class count doesn't fit the data."""
    datamodule = getattr(module.trainer, "datamodule", None)
    data_classes = getattr(datamodule, "num_classes", None)
    if net_num_classes is None or data_classes is None or int(data_classes) == int(net_num_classes):
        return
    raise ConfigError(
        f"{key}={net_num_classes} but the data has {data_classes} classes "
        f"(including background for detection); set {key}={data_classes}"
    )


def init_net_from_file(
    module: pl.LightningModule, net: nn.Module, path: str | os.PathLike | None, *, trust_checkpoint: bool
) -> bool:
    """``model.init_from`` (call in ``on_fit_start``): load the file's weights that match ``net``.

    Skipped when the fit resumes from a checkpoint (``ckpt_path``, or one Lightning found itself): the
    checkpoint's weights, optimizer and position win, and the file need not exist any more. Runs after
    the network is on its device and wrapped, before the sanity check and the first step; every rank
    reads the file. Returns whether weights were loaded.
    """
    if path is None:
        return False
    resumed_from = module.trainer.ckpt_path
    if resumed_from:
        if module.trainer.is_global_zero:
            log.info(
                "model.init_from=%s not applied: resuming from %s, whose weights win",
                path,
                resumed_from,
            )
        return False
    init_from_checkpoint(
        net,
        path,
        trust_checkpoint=trust_checkpoint,
        what="model.init_from",
        log_summary=module.trainer.is_global_zero,
    )
    return True


def save_model_record(
    module: pl.LightningModule,
    checkpoint: dict,
    *,
    kind: str,
    net: nn.Module,
    weights: str,
    decoder: Mapping | None = None,
) -> None:
    """Put the record that rebuilds and names the model (:mod:`ssd_lightning.io.model_record`) into
    ``checkpoint`` (call in ``on_save_checkpoint``). Class names, category ids and the input size come from
    the trainer's datamodule (``category_map``, ``class_names``, ``image_size``, ``val_resize``); without
    one, classes are named ``class_<k>``. A network without ``architecture`` (not built by
    :data:`ssd_lightning.models.NETWORK_BUILDERS`) gets no record: its checkpoints need their run config."""
    architecture = getattr(net, "architecture", None)
    if architecture is None:
        return
    trainer = module.trainer
    datamodule = getattr(trainer, "datamodule", None)
    num_classes = int(architecture["args"]["num_classes"])
    detector = kind == "detector"
    if detector:
        categories = getattr(datamodule, "category_map", None)
        if categories is None or categories.num_classes != num_classes:
            names, ids = ["background", *(f"class_{k}" for k in range(1, num_classes))], range(1, num_classes)
        else:
            names, ids = categories.names, categories.category_ids
    else:
        names = list(getattr(datamodule, "class_names", None) or [])
        if len(names) != num_classes:
            names = [f"class_{k}" for k in range(num_classes)]
        ids = None
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    lr = optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"]) if optimizer else None
    batch = getattr(datamodule, "batch_size", None)
    training = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "precision": str(trainer.precision),
        "lr": lr,  # after the scaling rule: the peak LR of the schedule
        "global_batch_size": (
            None if batch is None else trainer.world_size * int(batch) * trainer.accumulate_grad_batches
        ),
    }
    checkpoint[MODEL_KEY] = make_model_record(
        kind=kind,
        architecture=architecture,
        weights=weights,
        class_names=names,
        category_ids=ids,
        image_size=getattr(datamodule, "image_size", 300 if detector else 224),
        resize=None if detector else getattr(datamodule, "val_resize", None),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        decoder=decoder,
        training=training,
    )
