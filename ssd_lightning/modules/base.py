"""RecipeModule: the run lifecycle both LightningModules share, written once.

Weight-decay groups, run-time LR rule and schedule, EMA, SyncBatchNorm, CPU-bf16 depthwise, ``init_from``,
mid-epoch metric states and the model record; the subclasses add the task (steps, metrics, decoding).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.accelerators import CPUAccelerator
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn
from torchmetrics import Metric

from ssd_lightning import compat, optim
from ssd_lightning.errors import ConfigError
from ssd_lightning.io.model_record import FORMAT_VERSION, MODEL_KEY
from ssd_lightning.io.weights import init_from_checkpoint
from ssd_lightning.models import IMAGENET_MEAN, IMAGENET_STD
from ssd_lightning.models.cpu_bf16 import run_strided_depthwise_in_float32
from ssd_lightning.modules.ema import ExponentialMovingAverage

log = logging.getLogger(__name__)

EPOCH_METRIC_STATES = "epoch_metric_states"  # the checkpoint's key


class BatchMean(Metric):
    """Batch-size-weighted mean over the epoch and all DDP ranks: ``update`` adds on the device, ranks are
    reduced once in ``compute`` (``self.log(..., sync_dist=True)`` would all-reduce every step)."""

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
    """The datamodule's per-device batch (the reference's ``--bs``); ``rule``, ``switch_off``: the error's."""
    batch_size = getattr(getattr(trainer, "datamodule", None), "batch_size", None)
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


class RecipeModule(pl.LightningModule):
    """What a training run does besides its task; the subclass's ``__init__`` arguments (plain values) become
    ``hparams``, of which these are read here:

    Args:
        optimizer: partial optimizer holding the base ``lr`` and ``weight_decay``.
        lr_scaling: ``{"rule": "linear"|"sqrt"|"none", "reference_batch_size": int}``.
        scheduler: ``{"name", "warmup_steps"/"warmup_epochs"}`` plus that schedule's keys
            (:func:`ssd_lightning.optim.lr_factor`), stepped every iteration; ``None``: constant LR.
        init_from: start ``fit`` from this file's weights that match ``net`` by name and shape.
        trust_checkpoint: unpickle weight files fully (can run code from the file).
        ema_decay: an EMA of ``net`` (``None``: off), updated every ``ema_every_n_steps`` optimizer steps.
        sync_batchnorm: SyncBatchNorm on several GPU processes (leave the Trainer's flag off); not on CPU.
    """

    num_classes: int | None

    def __init__(self, net: nn.Module, optimizer: Callable[..., torch.optim.Optimizer]) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer"])
        hp = self.hparams
        if hp.ema_every_n_steps < 1:
            raise ConfigError(f"model.ema_every_n_steps must be >= 1, got {hp.ema_every_n_steps}")
        # here, not when the optimizer is built: a bad value fails before any data is prepared
        optim.check_optimizer_args(*(optim.partial_kwarg(optimizer, k) for k in ("lr", "weight_decay")))
        optim.check_scheduler_args(hp.scheduler or {})
        self.net = net
        self.optimizer_factory = optimizer
        self.channels_last = hp.channels_last
        if hp.channels_last:
            self.net.to(memory_format=torch.channels_last)
        self.ema = ExponentialMovingAverage(net, hp.ema_decay) if hp.ema_decay is not None else None
        self.warmup_steps = 0  # the LR warm-up in optimizer steps, known once the optimizer is built
        self.train_loss_epoch = BatchMean()  # train/loss_epoch: the mean over all ranks' batches

    def forward(self, images: torch.Tensor, net: nn.Module | None = None):
        """``net`` (default: the trained ``self.net``) on ``images``, in the module's memory format."""
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return (self.net if net is None else net)(images)

    def log_train_loss(self, loss: torch.Tensor, batch_size: int) -> None:
        """``train/loss_step`` (this rank), ``train/loss_epoch`` (all ranks); no prog_bar: a sync a step."""
        self.log("train/loss_step", loss, on_step=True, on_epoch=False, batch_size=batch_size)
        self.train_loss_epoch.update(loss, batch_size)
        self.log("train/loss_epoch", self.train_loss_epoch, on_step=False, on_epoch=True)

    def epoch_metrics(self) -> dict[str, Metric]:
        """The training epoch metrics whose mid-epoch states checkpoints carry (tensor sums only)."""
        return {"train_loss_epoch": self.train_loss_epoch}

    def configure_model(self) -> None:
        """SyncBatchNorm if asked for; under CPU bf16, strided depthwise convolutions in float32."""
        trainer = self.trainer
        on_cpu = isinstance(trainer.accelerator, CPUAccelerator)
        has_sync_bn = any(isinstance(m, nn.SyncBatchNorm) for m in self.net.modules())
        wants_sync_bn = self.hparams.sync_batchnorm and trainer.world_size > 1 and not has_sync_bn
        if wants_sync_bn and on_cpu:
            rank_zero_warn("sync_batchnorm=True is ignored on CPU: torch's SyncBatchNorm needs GPU modules")
        elif wants_sync_bn:
            self.net = nn.SyncBatchNorm.convert_sync_batchnorm(self.net)
        if on_cpu and getattr(trainer, "precision", None) == "bf16-mixed":
            nets = [self.net] + ([self.ema.module] if self.ema is not None else [])
            if changed := sum(run_strided_depthwise_in_float32(net) for net in nets):
                log.info("CPU bf16: %d strided depthwise convolutions run in float32 (faster there)", changed)

    def setup(self, stage: str) -> None:
        """Fail early, naming the config key, when the network's class count does not fit the data."""
        data_classes = getattr(getattr(self.trainer, "datamodule", None), "num_classes", None)
        if self.num_classes is None or data_classes is None or int(data_classes) == int(self.num_classes):
            return
        raise ConfigError(
            f"model.net.num_classes={self.num_classes} but the data has {data_classes} classes "
            f"(including background for detection); set model.net.num_classes={data_classes}"
        )

    def on_fit_start(self) -> None:
        """``model.init_from`` on every rank before the sanity check (and the EMA); not when resuming."""
        path, ckpt = self.hparams.init_from, self.trainer.ckpt_path
        if path is None:
            return
        if ckpt:
            if self.trainer.is_global_zero:
                log.info("model.init_from=%s not applied: resuming from %s, whose weights win", path, ckpt)
            return
        trust = self.hparams.trust_checkpoint
        init_from_checkpoint(self.net, path, trust_checkpoint=trust, log_summary=self.trainer.is_global_zero)
        if self.ema is not None:  # the average starts from the loaded weights, not the random ones
            self.ema.module.load_state_dict(self.net.state_dict())
            self.ema.reset()

    def on_train_start(self) -> None:
        """Restore the train loaders' mid-epoch position: Lightning would skip it, since
        :func:`steps_per_epoch` set up the train dataloader before the checkpoint was loaded."""
        compat.load_pending_loader_states(self.trainer)

    def weight_decay_groups(self) -> dict[str, float | None]:
        """Weight decay of normalisation parameters, biases, depthwise weights (``build_optimizer``'s)."""
        return {}

    def ema_decay_per_update(self) -> float:
        """The EMA decay this run applies per update (the classifier scales torchvision's)."""
        return self.ema.decay

    def configure_optimizers(self) -> dict:
        """Weight-decay groups, the LR scaled to the global batch, and a per-iteration schedule."""
        trainer, hp, factory = self.trainer, self.hparams, self.optimizer_factory
        base = optim.partial_kwarg(factory, "lr")
        if base is None:
            raise ConfigError("model.optimizer.lr must be set (the base LR before scaling)")
        lr_scaling = dict(hp.lr_scaling or {"rule": "none"})
        rule = lr_scaling.get("rule", "linear")
        accumulate = int(trainer.accumulate_grad_batches)
        # the batch of one optimizer step: per device x devices x accumulated batches
        batch = per_device_batch_size(trainer) * accumulate if rule != "none" else 1
        ref, world = int(lr_scaling.get("reference_batch_size", 32)), trainer.world_size
        lr = optim.scale_lr(base, rule=rule, world_size=world, batch_size=batch, reference_batch_size=ref)
        if trainer.is_global_zero:
            log.info("%s", describe_lr(base, lr, rule, world, batch, accumulate, ref))
        wd = optim.partial_kwarg(factory, "weight_decay", 0.0) or 0.0
        opt = optim.build_optimizer(factory, self.net, lr=lr, weight_decay=wd, **self.weight_decay_groups())
        if self.ema is not None:
            self.ema.decay = self.ema_decay_per_update()
        if not hp.scheduler:
            return {"optimizer": opt}
        scheduler = dict(hp.scheduler)
        schedule = scheduler.pop("name", "constant")
        epoch_steps = steps_per_epoch(trainer)
        warmup = {k: scheduler.pop(k, 0) for k in ("warmup_steps", "warmup_epochs")}
        self.warmup_steps = optim.warmup_iterations(epoch_steps, **warmup)
        if trainer.is_global_zero:
            log.info(
                "LR schedule %s over %d optimizer steps per epoch, warm-up %d optimizer steps",
                schedule, epoch_steps, self.warmup_steps,
            )  # fmt: skip
        lr_scheduler = optim.build_scheduler(
            opt,
            schedule=schedule,
            steps_per_epoch=epoch_steps,
            max_epochs=total_epochs(trainer, epoch_steps),
            warmup_steps=self.warmup_steps,
            **scheduler,
        )
        per_step = {"scheduler": lr_scheduler, "interval": "step", "frequency": 1}
        return {"optimizer": opt, "lr_scheduler": per_step}

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.ema is not None:
            self.ema.update_at_step(
                self.net,
                self.trainer.global_step,  # optimizer steps done; unchanged on accumulation micro-batches
                every_n_steps=self.hparams.ema_every_n_steps,
                warmup_steps=self.warmup_steps,
            )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Mid-epoch checkpoints carry the epoch metrics' states (sums), summed over the ranks here; loading
        gives the sum to rank 0 and zeros to the others, so the epoch ends as if uninterrupted."""
        trainer = self.trainer
        progress = trainer.fit_loop.epoch_progress.current
        if trainer.state.fn != "fit" or progress.started == progress.processed:  # "epoch unfinished"
            return
        names, values = [], []
        for name, metric in self.epoch_metrics().items():
            for key, value in metric.metric_state.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"{name}.{key}: only tensor (sum) states can be checkpointed, got {type(value)}"
                    )
                names.append((name, key, value.dtype, value.shape))
                values.append(value.detach().reshape(-1).double())  # exact for counts below 2**53
        flat = torch.cat(values)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        states: dict[str, dict[str, torch.Tensor]] = {}
        parts = flat.cpu().split([v.numel() for v in values])
        for (name, key, dtype, shape), part in zip(names, parts, strict=True):
            states.setdefault(name, {})[key] = part.reshape(shape).to(dtype)
        checkpoint[EPOCH_METRIC_STATES] = states

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restore the epoch metrics' states: the sums on rank 0, zeros on the other ranks."""
        saved = checkpoint.get(EPOCH_METRIC_STATES) or {}
        for name, metric in self.epoch_metrics().items():
            for key, value in (saved.get(name) or {}).items():
                current = getattr(metric, key)
                value = value.to(device=current.device, dtype=current.dtype).reshape(current.shape)
                setattr(metric, key, value if self.global_rank == 0 else torch.zeros_like(current))

    def save_model_record(
        self, checkpoint: dict, *, kind: str, weights: str, decoder: Mapping | None = None
    ) -> None:
        """Put the :mod:`~ssd_lightning.io.model_record` into ``checkpoint`` (if ``net.architecture``)."""
        architecture = getattr(self.net, "architecture", None)
        if architecture is None:
            return
        trainer = self.trainer
        datamodule = getattr(trainer, "datamodule", None)
        num_classes = int(architecture["args"]["num_classes"])
        detector = kind == "detector"
        names, ids = list(getattr(datamodule, "class_names", None) or []), None
        if detector:
            categories = getattr(datamodule, "category_map", None)
            if categories is None or categories.num_classes != num_classes:
                names = ["background", *(f"class_{k}" for k in range(1, num_classes))]
                ids = range(1, num_classes)
            else:
                names, ids = categories.names, categories.category_ids
        elif len(names) != num_classes:
            names = [f"class_{k}" for k in range(num_classes)]
        group = trainer.optimizers[0].param_groups[0] if trainer.optimizers else None
        batch = getattr(datamodule, "batch_size", None)
        training = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "precision": str(trainer.precision),
            "lr": group.get("initial_lr", group["lr"]) if group else None,  # scaled: the schedule's peak
            "global_batch_size": (
                None if batch is None else trainer.world_size * int(batch) * trainer.accumulate_grad_batches
            ),
        }
        resize = None if detector else getattr(datamodule, "val_resize", None)
        checkpoint[MODEL_KEY] = {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "architecture": {"builder": str(architecture["builder"]), "args": dict(architecture["args"])},
            "weights": weights,
            "classes": {
                "names": [str(n) for n in names],
                "category_ids": None if ids is None else [int(i) for i in ids],
            },
            "input": {
                "image_size": int(getattr(datamodule, "image_size", 300 if detector else 224)),
                "resize": None if resize is None else int(resize),
                "mean": list(IMAGENET_MEAN),
                "std": list(IMAGENET_STD),
            },
            **({} if decoder is None else {"decoder": dict(decoder)}),
            "training": training,
        }
