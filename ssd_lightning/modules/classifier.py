"""LightningModule for image classification (MobileNetV2 recipe): label smoothing, top-1/top-5, EMA."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from ssd_lightning.error_analysis import top_confusions
from ssd_lightning.errors import ConfigError
from ssd_lightning.modules.base import RecipeModule, per_device_batch_size, steps_per_epoch, total_epochs
from ssd_lightning.optim import EMA_DECAY_SCALINGS, scale_ema_decay
from ssd_lightning.visualize import log_picture, plot_confusion_matrix

__all__ = ["ClassifierLitModule", "infer_num_classes"]

log = logging.getLogger(__name__)


def infer_num_classes(net: nn.Module) -> int:
    """``net.num_classes`` if set, else ``out_features`` of the last ``nn.Linear`` (torchvision heads)."""
    value = getattr(net, "num_classes", None)
    if isinstance(value, int):
        return value
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("cannot infer the number of classes of `net` (no nn.Linear); pass num_classes=")
    return linears[-1].out_features


def _eval_metrics(num_classes: int) -> nn.ModuleDict:
    """acc1, acc5 (top-k = min(5, num_classes)), mean loss: micro-averaged, DDP-synced on compute()."""
    return nn.ModuleDict(
        {
            "acc1": MulticlassAccuracy(num_classes=num_classes, top_k=1, average="micro"),
            "acc5": MulticlassAccuracy(num_classes=num_classes, top_k=min(5, num_classes), average="micro"),
            "loss": MeanMetric(),
        }
    )


class ClassifierLitModule(RecipeModule):
    """Trains and evaluates an image classifier on ``{"images": (N, 3, H, W), "labels": (N,) int64}``.

    Logged: ``train/loss_step`` (label-smoothed CE), ``train/*_epoch``; ``val/loss`` (plain CE), ``val/acc1``,
    ``val/acc5``, ``val/acc1_best`` (kept in checkpoints), ``_ema`` variants, ``test/*``.

    Args (the others: :class:`~ssd_lightning.modules.base.RecipeModule`, ``configs/model/mobilenetv2.yaml``):
        norm_weight_decay, bias_weight_decay, depthwise_weight_decay: ``None``: the optimizer's.
        ema_decay: scaled by :func:`ssd_lightning.optim.scale_ema_decay` per ``ema_decay_scaling``.
        num_classes: output size of ``net``; ``None``: its last ``nn.Linear``'s.
        confusion_matrix: after each validation, draw ``net``'s row-normalised confusion matrix to
            ``<run dir>/analysis/epoch_<e>/classification_confusion.png`` and log the top confusions.
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Mapping | None = None,
        lr_scaling: Mapping | None = None,
        label_smoothing: float = 0.0,
        norm_weight_decay: float | None = 0.0,
        bias_weight_decay: float | None = 0.0,
        depthwise_weight_decay: float | None = None,
        ema_decay: float | None = None,
        ema_every_n_steps: int = 1,
        ema_decay_scaling: str = "torchvision",
        sync_batchnorm: bool = False,
        channels_last: bool = False,
        num_classes: int | None = None,
        init_from: str | None = None,
        trust_checkpoint: bool = False,
        confusion_matrix: bool = False,
    ) -> None:
        super().__init__(net, optimizer)  # the other arguments reach it as hparams
        if not 0.0 <= label_smoothing < 1.0:
            raise ConfigError(f"model.label_smoothing must be in [0, 1), got {label_smoothing}")
        if ema_decay_scaling not in EMA_DECAY_SCALINGS:
            raise ConfigError(
                f"model.ema_decay_scaling must be one of {EMA_DECAY_SCALINGS}, got {ema_decay_scaling!r}"
            )
        self.num_classes = int(num_classes) if num_classes is not None else infer_num_classes(net)
        if self.num_classes < 2:
            raise ConfigError(f"a classifier needs model.net.num_classes >= 2, got {self.num_classes}")

        self.train_acc1 = MulticlassAccuracy(num_classes=self.num_classes, top_k=1, average="micro")
        stages = ["val", "test"] + (["val_ema", "test_ema"] if self.ema is not None else [])
        self.eval_metrics = nn.ModuleDict({stage: _eval_metrics(self.num_classes) for stage in stages})
        # validate_args=False: no label-range check, which would read the device every batch
        self.val_confusion = None
        if confusion_matrix:
            self.val_confusion = MulticlassConfusionMatrix(num_classes=self.num_classes, validate_args=False)
        # Best validation top-1 and its epoch: buffers, so checkpoints carry them across a resume.
        self.register_buffer("acc1_best", torch.tensor(0.0))
        self.register_buffer("acc1_best_epoch", torch.tensor(-1, dtype=torch.long))
        self.register_buffer("acc1_ema_best", torch.tensor(0.0))

    def epoch_metrics(self) -> dict[str, Metric]:
        return {**super().epoch_metrics(), "train_acc1": self.train_acc1}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        self.save_model_record(checkpoint, kind="classifier", weights="net.")

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        labels = batch["labels"].long()
        logits = self(batch["images"]).float()
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.train_acc1(logits, labels)
        self.log_train_loss(loss, len(labels))
        self.log("train/acc1", self.train_acc1, on_step=True, on_epoch=True, batch_size=len(labels))
        return loss

    def _eval_step(self, batch: dict[str, Tensor], stage: str) -> None:
        """Shared by validation and test: update the metrics of ``net`` (and of the EMA weights)."""
        labels = batch["labels"].long()
        nets = [(stage, self.net)] + ([(f"{stage}_ema", self.ema.module)] if self.ema is not None else [])
        for key, net in nets:
            logits = self(batch["images"], net).float()
            metrics = self.eval_metrics[key]
            metrics["acc1"].update(logits, labels)
            metrics["acc5"].update(logits, labels)
            metrics["loss"].update(F.cross_entropy(logits, labels, reduction="none"))
            if key == "val" and self.val_confusion is not None:
                self.val_confusion.update(logits, labels)

    def _log_eval(self, stage: str) -> dict[str, Tensor]:
        values = {}
        for key in [stage, f"{stage}_ema"] if self.ema is not None else [stage]:
            suffix = key[len(stage) :]
            for name, metric in self.eval_metrics[key].items():
                values[f"{stage}/{name}{suffix}"] = metric.compute()  # all-reduced across ranks
                metric.reset()
        # Already equal on every rank; sync_dist only spares Lightning's DDP warning (one all-reduce).
        self.log_dict(values, sync_dist=True)
        return values

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        values = self._log_eval("val")
        if self.trainer.state.fn == TrainerFn.FITTING and not self.trainer.sanity_checking:
            acc1 = values["val/acc1"].to(self.acc1_best)
            if acc1 > self.acc1_best:
                self.acc1_best.copy_(acc1)
                self.acc1_best_epoch.fill_(self.current_epoch)
            if "val/acc1_ema" in values:
                self.acc1_ema_best.copy_(torch.maximum(self.acc1_ema_best, values["val/acc1_ema"].to(acc1)))
        best = {"val/acc1_best": self.acc1_best.clone()}
        if self.ema is not None:
            best["val/acc1_ema_best"] = self.acc1_ema_best.clone()
        self.log_dict(best, prog_bar=True, sync_dist=True)
        if self.val_confusion is not None:
            matrix = self.val_confusion.compute()  # summed over ranks: every rank takes part
            self.val_confusion.reset()
            if not self.trainer.sanity_checking and self.trainer.is_global_zero:
                self._report_confusion(matrix)

    def _report_confusion(self, matrix: Tensor) -> None:
        """Rank 0: the picture in the run directory (and TensorBoard) and the top confusions."""
        counts = matrix.detach().to("cpu", torch.int64).numpy()
        names = getattr(self.trainer.datamodule, "class_names", None)
        names = [str(n) for n in names] if names is not None and len(names) == len(counts) else None
        labels = names or [str(i) for i in range(len(counts))]
        epoch = self.current_epoch
        top = top_confusions(counts, 3, include_background=True)
        text = ", ".join(f"{labels[t]} -> {labels[p]} ({n})" for t, p, n in top) or "none"
        log.info(f"Epoch {epoch}: top confusions (true -> predicted): {text}")
        try:
            run_dir = Path(self.trainer.default_root_dir)
            out = run_dir / "analysis" / f"epoch_{epoch}" / "classification_confusion.png"
            title = f"{run_dir.name}: epoch {epoch}, {int(counts.sum())} validation images; row shares"
            path = plot_confusion_matrix(counts, labels, out, title=title)
            log_picture(self.loggers, "analysis/classification_confusion", path, self.global_step)
        except Exception as e:  # a picture must never end a training run
            rank_zero_warn(f"could not draw the confusion matrix: {type(e).__name__}: {e}")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def weight_decay_groups(self) -> dict[str, float | None]:
        return {f"{k}_weight_decay": self.hparams[f"{k}_weight_decay"] for k in ("norm", "bias", "depthwise")}

    def ema_decay_per_update(self) -> float:
        hp, trainer = self.hparams, self.trainer
        batch_size = 1
        if hp.ema_decay_scaling != "none":
            batch_size = per_device_batch_size(trainer, "EMA decay scaling", "model.ema_decay_scaling=none")
        decay = scale_ema_decay(
            hp.ema_decay,
            scaling=hp.ema_decay_scaling,
            world_size=trainer.world_size,
            batch_size=batch_size,
            every_n_steps=hp.ema_every_n_steps,
            epochs=total_epochs(trainer, steps_per_epoch(trainer)),
        )
        rank_zero_info(
            f"EMA: decay {decay:.6g} per update (model.ema_decay={hp.ema_decay}, "
            f"ema_decay_scaling={hp.ema_decay_scaling})"
        )
        return decay
