"""LightningModule for SSD300: the NVIDIA recipe's training step, decoder in validation, run-time LR rule."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from ssd_lightning.errors import ConfigError
from ssd_lightning.io.weights import read_nvidia_state_dict
from ssd_lightning.models import BoxCoder, DecoderSettings, SSDLoss, dboxes300_coco, nvidia_state_dict
from ssd_lightning.modules.base import RecipeModule
from ssd_lightning.modules.freezing import freeze_backbone, frozen_modules, keep_frozen_norms_in_eval


class SSDLitModule(RecipeModule):
    """Trains and evaluates an SSD300-family network.

    Args (the others: :class:`~ssd_lightning.modules.base.RecipeModule`, ``configs/model/ssd300.yaml``):
        decoder: overrides of :class:`~ssd_lightning.models.DecoderSettings` (``None`` values: the default).
        nvidia_checkpoint: a checkpoint from the NVIDIA reference to load into ``net`` (strict).
        init_from: also an NVIDIA SSD300 checkpoint.
        freeze: ``"backbone"`` or the number of backbone stages (from the input) kept fixed: no gradients,
            out of the optimizer, their BatchNorm layers in eval mode; ``None``: everything trains.
        ema_decay: both weight sets are validated (the second under ``"detections_secondary"``) and saved.
        use_ema: the EMA weights are the run's (``val/*``, test, predict, checkpoints' model), the raw ones
            the second set (``val_raw/*``); ``False``: the other way round (``val_ema/*``).
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
        ema_decay: float | None = None,
        ema_every_n_steps: int = 1,
        use_ema: bool = True,
        sync_batchnorm: bool = False,
    ) -> None:
        if nvidia_checkpoint is not None and init_from is not None:
            raise ConfigError(
                "model.nvidia_checkpoint and model.init_from are both set: nvidia_checkpoint loads every "
                "weight strictly (to evaluate it), init_from what matches (to fine-tune); keep one"
            )
        if nvidia_checkpoint is not None:  # before the EMA copies the network
            state = nvidia_state_dict(
                read_nvidia_state_dict(nvidia_checkpoint, trust_checkpoint=trust_checkpoint),
                backbone=net.backbone_name,  # an SSD300 built by ssd300()
                num_classes=net.num_classes,
                source=f"nvidia_checkpoint={nvidia_checkpoint}",
            )
            net.load_state_dict(state, strict=True)
        super().__init__(net, optimizer)  # the other arguments reach it as hparams
        self.num_classes = getattr(net, "num_classes", None)
        default_boxes = dboxes300_coco()
        self.loss_fn = SSDLoss(default_boxes)
        self.box_coder = BoxCoder(default_boxes)
        self.decoder_settings = DecoderSettings.from_mapping(decoder)
        self.hparams["decoder"] = dict(self.decoder_settings)  # the values used, defaults filled in
        self.frozen = freeze_backbone(self.net, freeze)

    @property
    def inference_net(self) -> nn.Module:
        """The run's weights: the EMA copy with ``ema_decay`` and ``use_ema``, else ``net``."""
        return self.ema.module if self.ema is not None and self.hparams.use_ema else self.net

    def configure_model(self) -> None:
        super().configure_model()
        self.frozen = frozen_modules(self.net, self.hparams.freeze)  # the converted layers, if any

    def train(self, mode: bool = True) -> SSDLitModule:
        super().train(mode)
        keep_frozen_norms_in_eval(self.frozen)
        return self

    def on_train_start(self) -> None:
        super().on_train_start()
        # Lightning never calls train() when fit starts, and restores each layer's mode after validation
        keep_frozen_norms_in_eval(self.frozen)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        weights = "ema.module." if self.inference_net is not self.net else "net."
        self.save_model_record(checkpoint, kind="detector", weights=weights, decoder=self.decoder_settings)

    @property
    def validation_output_keys(self) -> tuple[str, ...]:
        """What :meth:`validation_step` returns: the run's detections, and the second set's with EMA."""
        return ("detections", "detections_secondary") if self.ema is not None else ("detections",)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        reconcile_ema_weights(checkpoint.get("state_dict", {}), has_ema=self.ema is not None)
        super().on_load_checkpoint(checkpoint)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        locs, logits = self(batch["images"])
        # (N, 8732, 4) -> (N, 4, 8732): the loss works in the network's output layout
        gt_boxes = batch["boxes"].transpose(1, 2)
        loss = self.loss_fn(locs, logits, gt_boxes, batch["labels"])  # in float32, whatever the autocast
        self.log_train_loss(loss, len(locs))
        return loss

    def _detect(self, batch: dict[str, torch.Tensor], net: nn.Module | None = None) -> list[dict]:
        """Detections per image of ``net`` (default: the run's weights), ltrb boxes in image pixels."""
        locs, logits = self(batch["images"], self.inference_net if net is None else net)
        detections = self.box_coder.detect(locs, logits, batch["image_sizes"], self.decoder_settings)
        ids = batch["image_ids"].tolist()
        return [{"image_id": int(i), **d} for i, d in zip(ids, detections, strict=True)]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict:
        outputs = {"detections": self._detect(batch)}
        if self.ema is not None:
            second = self.net if self.hparams.use_ema else self.ema.module
            outputs["detections_secondary"] = self._detect(batch, second)
        return outputs

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict:
        return {"detections": self._detect(batch)}

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> list[dict]:
        return self._detect(batch)


def reconcile_ema_weights(state: dict, *, has_ema: bool) -> None:
    """Fit a checkpoint's ``state_dict`` to a module with or without EMA, in place: the average starts from
    the file's weights when it has none; EMA weights without EMA in the module are an error."""
    has_saved_ema = any(k.startswith("ema.") for k in state)
    if has_ema and not has_saved_ema:
        for key in [k for k in state if k.startswith("net.")]:
            state[f"ema.module.{key[len('net.') :]}"] = state[key].clone()
        state["ema.n_averaged"] = torch.tensor(0, dtype=torch.long)
    elif has_saved_ema and not has_ema:
        raise ConfigError(
            "the checkpoint holds EMA weights beside the raw ones (its run set model.ema_decay): set "
            "model.ema_decay to evaluate or continue it (model.use_ema=false makes the raw weights the run's)"
        )
