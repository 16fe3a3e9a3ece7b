"""LightningModule for SSD300: the NVIDIA recipe's training step, decoder in validation, run-time LR rule."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn

from ssd_lightning.errors import ConfigError
from ssd_lightning.io.weights import read_nvidia_state_dict
from ssd_lightning.models import BoxCoder, DecoderSettings, SSDLoss, dboxes300_coco, nvidia_state_dict
from ssd_lightning.modules.common import (
    BatchMean,
    check_num_classes,
    configure_recipe_optimizers,
    convert_sync_batchnorm,
    init_net_from_file,
    load_epoch_metric_states,
    restore_train_loader_state,
    save_epoch_metric_states,
)
from ssd_lightning.modules.freezing import freeze_backbone, keep_frozen_norms_in_eval


class SSDLitModule(pl.LightningModule):
    """Trains and evaluates an SSD300-family network.

    Args:
        net: module mapping images (N, 3, 300, 300) to ``(locs (N, 4, 8732), logits (N, C, 8732))``.
        optimizer: partial optimizer holding the base ``lr`` and ``weight_decay`` (applied to weights
            only; BatchNorm parameters and biases get none).
        lr_scaling: ``{"rule": "linear"|"sqrt"|"none", "reference_batch_size": 32}``; evaluated at run time.
        scheduler: ``{"name": "multistep", "milestones": [43, 54], "gamma": 0.1, "warmup_steps": 300}``
            or any schedule of :func:`ssd_lightning.optim.lr_factor`; stepped every iteration.
        decoder: overrides of :class:`~ssd_lightning.models.DecoderSettings` (``None`` values: the default).
        channels_last: run the network in NHWC memory format (the reference's GPU default).
        nvidia_checkpoint: a checkpoint from the NVIDIA reference to load into ``net`` (strict), e.g. to
            evaluate it.
        init_from: start ``fit`` from the weights of this file whose names and shapes match ``net``: an
            NVIDIA SSD300 checkpoint, a Lightning checkpoint of this project or a plain state dict. Class
            heads of another class count keep their initialisation; no optimizer or epoch state is taken;
            ignored when resuming from ``ckpt_path``
            (see :func:`ssd_lightning.io.weights.init_from_checkpoint`).
        trust_checkpoint: unpickle ``nvidia_checkpoint``/``init_from`` fully instead of
            ``torch.load(weights_only=True)``; this can run code from the file, so only for trusted files.
        freeze: ``"backbone"`` or the number of backbone stages (from the input) to keep fixed: no
            gradients, out of the optimizer, their BatchNorm layers in eval mode
            (:mod:`ssd_lightning.modules.freezing`); ``None``: everything trains.
        sync_batchnorm: convert BatchNorm to SyncBatchNorm when training on several GPU processes (in
            :meth:`configure_model`, the one place it is done; leave the Trainer's own flag off). Ignored
            with a warning on CPU.
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        optimizer: Callable[..., torch.optim.Optimizer],
        lr_scaling: Mapping | None = None,
        scheduler: Mapping | None = None,
        decoder: Mapping | None = None,
        channels_last: bool = False,
        nvidia_checkpoint: str | Path | None = None,
        init_from: str | Path | None = None,
        trust_checkpoint: bool = False,
        freeze: str | int | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__()
        # Plain values only: checkpoints stay loadable with torch.load(weights_only=True). The full
        # config is in the run's .hydra/ and in the loggers.
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer"])
        self.net = net
        self.optimizer_factory = optimizer
        if nvidia_checkpoint is not None and init_from is not None:
            raise ConfigError(
                "model.nvidia_checkpoint and model.init_from are both set: nvidia_checkpoint loads every "
                "weight strictly (to evaluate it), init_from what matches (to fine-tune); keep one"
            )
        if nvidia_checkpoint is not None:
            state = nvidia_state_dict(
                read_nvidia_state_dict(nvidia_checkpoint, trust_checkpoint=trust_checkpoint),
                backbone=getattr(net, "backbone_name", "resnet50"),
                num_classes=getattr(net, "num_classes", 81),
                source=f"nvidia_checkpoint={nvidia_checkpoint}",
            )
            self.net.load_state_dict(state, strict=True)
        if channels_last:
            self.net.to(memory_format=torch.channels_last)
        default_boxes = dboxes300_coco()
        self.loss_fn = SSDLoss(default_boxes)
        self.box_coder = BoxCoder(default_boxes)
        self.decoder_settings = DecoderSettings.from_mapping(decoder)
        self.hparams["decoder"] = dict(self.decoder_settings)  # the values used, defaults filled in
        self.channels_last = channels_last
        self.train_loss_epoch = BatchMean()  # train/loss_epoch: the mean over all ranks' batches
        self.frozen = freeze_backbone(self.net, freeze)

    def configure_model(self) -> None:
        self.net = convert_sync_batchnorm(self, self.net, self.hparams.sync_batchnorm)

    def train(self, mode: bool = True) -> SSDLitModule:
        super().train(mode)
        keep_frozen_norms_in_eval(self.frozen)
        return self

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.net(images)

    def on_fit_start(self) -> None:
        trust = self.hparams.trust_checkpoint
        init_net_from_file(self, self.net, self.hparams.init_from, trust_checkpoint=trust)

    def on_train_start(self) -> None:
        restore_train_loader_state(self.trainer)
        # Lightning never calls train() when fit starts, and restores each layer's mode after validation
        keep_frozen_norms_in_eval(self.frozen)

    def setup(self, stage: str) -> None:
        check_num_classes(self, getattr(self.net, "num_classes", None), "model.net.num_classes")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_epoch_metric_states(self, checkpoint, {"train_loss_epoch": self.train_loss_epoch})

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        load_epoch_metric_states(self, checkpoint, {"train_loss_epoch": self.train_loss_epoch})

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        locs, logits = self(batch["images"])
        # (N, 8732, 4) -> (N, 4, 8732): the loss works in the network's output layout
        gt_boxes = batch["boxes"].transpose(1, 2)
        loss = self.loss_fn(locs.float(), logits.float(), gt_boxes.float(), batch["labels"].long())
        # not prog_bar=True: Lightning would read it back to the host every step (a device sync); the
        # progress bar (callbacks.progress_bar) shows it when it redraws, LearningRateMonitor logs the LR.
        # The step value is this rank's; the epoch value the mean over all ranks, reduced at the epoch's
        # end only (sync_dist=True on a per-step value would all-reduce every step).
        self.log("train/loss_step", loss, on_step=True, on_epoch=False, batch_size=len(locs))
        self.train_loss_epoch.update(loss, len(locs))
        self.log("train/loss_epoch", self.train_loss_epoch, on_step=False, on_epoch=True)
        return loss

    def _detect(self, batch: dict[str, torch.Tensor]) -> list[dict]:
        """Decoded detections per image, boxes mapped to original-image pixels (ltrb)."""
        locs, logits = self(batch["images"])
        detections = self.box_coder.detect(locs, logits, batch["image_sizes"], self.decoder_settings)
        image_ids = batch["image_ids"].tolist()
        return [{"image_id": int(i), **det} for i, det in zip(image_ids, detections, strict=True)]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict:
        return {"detections": self._detect(batch)}

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict:
        return {"detections": self._detect(batch)}

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> list[dict]:
        return self._detect(batch)

    def configure_optimizers(self) -> dict:
        return configure_recipe_optimizers(
            self,
            self.net,
            optimizer=self.optimizer_factory,
            lr_scaling=self.hparams.lr_scaling,
            scheduler=self.hparams.scheduler,
        )
