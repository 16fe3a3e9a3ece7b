"""SSD multibox loss of NVIDIA SSD300 v1.1: Smooth-L1 on positives + CE with hard negative mining."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssd_lightning.models.boxes import DefaultBoxes

__all__ = ["SSDLoss"]


class SSDLoss(nn.Module):
    """The reference ``Loss`` in float32 (also under autocast): per image, Smooth-L1 on the positives' encoded
    offsets plus cross-entropy on the positives and the ``neg_pos_ratio * num_pos`` hardest negatives, over
    the number of positives (0 without); then the batch mean."""

    def __init__(self, default_boxes: DefaultBoxes, neg_pos_ratio: int = 3) -> None:
        super().__init__()
        self.scale_xy = 1.0 / default_boxes.scale_xy
        self.scale_wh = 1.0 / default_boxes.scale_wh
        self.neg_pos_ratio = neg_pos_ratio
        # (1, 4, B) (cx, cy, w, h); a buffer so it follows .to(device) but is not saved in checkpoints.
        self.register_buffer("dboxes", default_boxes.cxcywh.t().unsqueeze(0).contiguous(), persistent=False)

    def forward(self, locs: Tensor, logits: Tensor, gt_boxes_cxcywh: Tensor, gt_labels: Tensor) -> Tensor:
        """``locs``, ``logits``, matched ``gt_boxes_cxcywh`` (N, 4, B) (transpose the batches' (N, B, 4)) and
        ``gt_labels`` (N, B) (0 = background) -> scalar float32 loss."""
        num_boxes = self.dboxes.shape[-1]
        n = locs.shape[0]
        for name, t, shape in (
            ("locs", locs, (n, 4, num_boxes)),
            ("gt_boxes_cxcywh", gt_boxes_cxcywh, (n, 4, num_boxes)),
            ("gt_labels", gt_labels, (n, num_boxes)),
        ):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if logits.ndim != 3 or logits.shape[0] != n or logits.shape[2] != num_boxes:
            raise ValueError(f"logits must have shape ({n}, C, {num_boxes}), got {tuple(logits.shape)}")

        with torch.autocast(device_type=locs.device.type, enabled=False):
            locs, logits, gt_boxes_cxcywh = locs.float(), logits.float(), gt_boxes_cxcywh.float()
            gt_labels = gt_labels.long()
            positive = gt_labels > 0  # (N, B)
            num_pos = positive.sum(dim=1)  # (N,)

            d = self.dboxes
            gxy = self.scale_xy * (gt_boxes_cxcywh[:, :2, :] - d[:, :2, :]) / d[:, 2:, :]
            gwh = self.scale_wh * (gt_boxes_cxcywh[:, 2:, :] / d[:, 2:, :]).log()
            targets = torch.cat((gxy, gwh), dim=1)
            sl1 = F.smooth_l1_loss(locs, targets, reduction="none").sum(dim=1)  # (N, B)
            loc_loss = torch.where(positive, sl1, torch.zeros_like(sl1)).sum(dim=1)

            ce = F.cross_entropy(logits, gt_labels, reduction="none")  # (N, B)
            with torch.no_grad():
                # Hard negatives: the num_neg largest CE among negatives (positives rank as 0).
                neg_ce = ce.detach().masked_fill(positive, 0.0)
                num_neg = torch.clamp(self.neg_pos_ratio * num_pos, max=num_boxes)  # (N,)
                # rank of every box among its image's CE values (0 = largest), computed on the device: a
                # topk would need max(num_neg) on the host, a device sync every step
                rank = neg_ce.argsort(dim=1, descending=True).argsort(dim=1)  # (N, B)
                selected = rank < num_neg[:, None]
            conf_loss = torch.where(positive | selected, ce, torch.zeros_like(ce)).sum(dim=1)

            per_image = (loc_loss + conf_loss) * (num_pos > 0).float() / num_pos.float().clamp(min=1e-6)
            return per_image.mean(dim=0)
