"""Independent re-implementation of the NVIDIA SSD300 v1.1 reference pieces (tests and benchmarks only).

Follows NVIDIA DeepLearningExamples PyTorch/Detection/SSD (ssd/model.py, ssd/utils.py,
ssd/entrypoints.py): the same module structure and names (so state dicts have the reference keys), the
same tensor operations in the same order, and the same per-image, per-class Python loop for decoding.
Nothing here is imported by the library.

One deliberate difference: the reference sorts with ``Tensor.sort()``, which on CPU is not stable for
more than 16 elements, so its order among equal scores is implementation-defined. Here every sort is
``stable=True``, which fixes that order to what the reference's algorithm means on tie-free data and
is the tie rule ``BoxCoder.decode`` documents.
"""

from __future__ import annotations

import itertools
from math import sqrt

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet

# --------------------------------------------------------------------------- model (ssd/model.py)


class RefResNet(nn.Module):
    """Reference ``ResNet`` feature extractor: children[:7] of a torchvision ResNet, conv4 stride 1."""

    _channels = {
        "resnet18": [256, 512, 512, 256, 256, 128],
        "resnet34": [256, 512, 512, 256, 256, 256],
        "resnet50": [1024, 512, 512, 256, 256, 256],
        "resnet101": [1024, 512, 512, 256, 256, 256],
        "resnet152": [1024, 512, 512, 256, 256, 256],
    }

    def __init__(self, backbone: str = "resnet50") -> None:
        super().__init__()
        net = getattr(resnet, backbone)(weights=None)
        self.out_channels = list(self._channels[backbone])
        self.feature_extractor = nn.Sequential(*list(net.children())[:7])
        block = self.feature_extractor[-1][0]
        block.conv1.stride = (1, 1)
        block.conv2.stride = (1, 1)
        block.downsample[0].stride = (1, 1)

    def forward(self, x):
        return self.feature_extractor(x)


class RefSSD300(nn.Module):
    """Reference ``SSD300`` (label_num made a parameter; the reference hard-codes 81)."""

    def __init__(self, backbone: RefResNet, label_num: int = 81) -> None:
        super().__init__()
        self.feature_extractor = backbone
        self.label_num = label_num
        channels = backbone.out_channels
        blocks = []
        mids = [256, 256, 128, 128, 128]
        for i, (cin, cout, mid) in enumerate(zip(channels[:-1], channels[1:], mids, strict=True)):
            conv3 = (
                nn.Conv2d(mid, cout, kernel_size=3, padding=1, stride=2, bias=False)
                if i < 3
                else nn.Conv2d(mid, cout, kernel_size=3, bias=False)
            )
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(cin, mid, kernel_size=1, bias=False),
                    nn.BatchNorm2d(mid),
                    nn.ReLU(inplace=True),
                    conv3,
                    nn.BatchNorm2d(cout),
                    nn.ReLU(inplace=True),
                )
            )
        self.additional_blocks = nn.ModuleList(blocks)
        self.num_defaults = [4, 6, 6, 6, 4, 4]
        self.loc = nn.ModuleList(
            nn.Conv2d(oc, nd * 4, kernel_size=3, padding=1)
            for nd, oc in zip(self.num_defaults, channels, strict=True)
        )
        self.conf = nn.ModuleList(
            nn.Conv2d(oc, nd * label_num, kernel_size=3, padding=1)
            for nd, oc in zip(self.num_defaults, channels, strict=False)
        )
        for layer in [*self.additional_blocks, *self.loc, *self.conf]:
            for p in layer.parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)

    def forward(self, x):
        x = self.feature_extractor(x)
        feeds = [x]
        for block in self.additional_blocks:
            x = block(x)
            feeds.append(x)
        locs, confs = [], []
        for s, lh, ch in zip(feeds, self.loc, self.conf, strict=False):
            locs.append(lh(s).reshape(s.size(0), 4, -1))
            confs.append(ch(s).reshape(s.size(0), self.label_num, -1))
        return torch.cat(locs, 2).contiguous(), torch.cat(confs, 2).contiguous()


class RefLoss(nn.Module):
    """Reference ``Loss`` (sort-based hard negative mining, mask products)."""

    def __init__(self, dboxes: RefDefaultBoxes) -> None:
        super().__init__()
        self.scale_xy = 1.0 / dboxes.scale_xy
        self.scale_wh = 1.0 / dboxes.scale_wh
        self.sl1_loss = nn.SmoothL1Loss(reduction="none")
        self.dboxes = nn.Parameter(dboxes(order="xywh").transpose(0, 1).unsqueeze(dim=0), requires_grad=False)
        self.con_loss = nn.CrossEntropyLoss(reduction="none")

    def _loc_vec(self, loc):
        gxy = (
            self.scale_xy
            * (loc[:, :2, :] - self.dboxes[:, :2, :])
            / self.dboxes[
                :,
                2:,
            ]
        )
        gwh = self.scale_wh * (loc[:, 2:, :] / self.dboxes[:, 2:, :]).log()
        return torch.cat((gxy, gwh), dim=1).contiguous()

    def forward(self, ploc, plabel, gloc, glabel):
        mask = glabel > 0
        pos_num = mask.sum(dim=1)
        vec_gd = self._loc_vec(gloc)
        sl1 = self.sl1_loss(ploc, vec_gd).sum(dim=1)
        sl1 = (mask.float() * sl1).sum(dim=1)
        con = self.con_loss(plabel, glabel)
        con_neg = con.clone()
        con_neg[mask] = 0
        _, con_idx = con_neg.sort(dim=1, descending=True)
        _, con_rank = con_idx.sort(dim=1)
        neg_num = torch.clamp(3 * pos_num, max=mask.size(1)).unsqueeze(-1)
        neg_mask = con_rank < neg_num
        closs = (con * ((mask + neg_mask).float())).sum(dim=1)
        total_loss = sl1 + closs
        num_mask = (pos_num > 0).float()
        pos_num = pos_num.float().clamp(min=1e-6)
        return (total_loss * num_mask / pos_num).mean(dim=0)


# --------------------------------------------------------------------------- boxes (ssd/utils.py)


def ref_calc_iou_tensor(box1, box2):
    n, m = box1.size(0), box2.size(0)
    be1 = box1.unsqueeze(1).expand(-1, m, -1)
    be2 = box2.unsqueeze(0).expand(n, -1, -1)
    lt = torch.max(be1[:, :, :2], be2[:, :, :2])
    rb = torch.min(be1[:, :, 2:], be2[:, :, 2:])
    delta = rb - lt
    delta[delta < 0] = 0
    intersect = delta[:, :, 0] * delta[:, :, 1]
    delta1 = be1[:, :, 2:] - be1[:, :, :2]
    area1 = delta1[:, :, 0] * delta1[:, :, 1]
    delta2 = be2[:, :, 2:] - be2[:, :, :2]
    area2 = delta2[:, :, 0] * delta2[:, :, 1]
    return intersect / (area1 + area2 - intersect)


class RefDefaultBoxes:
    def __init__(self, fig_size, feat_size, steps, scales, aspect_ratios, scale_xy=0.1, scale_wh=0.2):
        self.scale_xy = scale_xy
        self.scale_wh = scale_wh
        fk = fig_size / np.array(steps)
        boxes = []
        for idx, sfeat in enumerate(feat_size):
            sk1 = scales[idx] / fig_size
            sk2 = scales[idx + 1] / fig_size
            sk3 = sqrt(sk1 * sk2)
            all_sizes = [(sk1, sk1), (sk3, sk3)]
            for alpha in aspect_ratios[idx]:
                w, h = sk1 * sqrt(alpha), sk1 / sqrt(alpha)
                all_sizes.append((w, h))
                all_sizes.append((h, w))
            for w, h in all_sizes:
                for i, j in itertools.product(range(sfeat), repeat=2):
                    boxes.append(((j + 0.5) / fk[idx], (i + 0.5) / fk[idx], w, h))
        self.dboxes = torch.tensor(boxes, dtype=torch.float)
        self.dboxes.clamp_(min=0, max=1)
        self.dboxes_ltrb = self.dboxes.clone()
        self.dboxes_ltrb[:, 0] = self.dboxes[:, 0] - 0.5 * self.dboxes[:, 2]
        self.dboxes_ltrb[:, 1] = self.dboxes[:, 1] - 0.5 * self.dboxes[:, 3]
        self.dboxes_ltrb[:, 2] = self.dboxes[:, 0] + 0.5 * self.dboxes[:, 2]
        self.dboxes_ltrb[:, 3] = self.dboxes[:, 1] + 0.5 * self.dboxes[:, 3]

    def __call__(self, order="ltrb"):
        return self.dboxes_ltrb if order == "ltrb" else self.dboxes


def ref_dboxes300_coco() -> RefDefaultBoxes:
    return RefDefaultBoxes(
        300,
        [38, 19, 10, 5, 3, 1],
        [8, 16, 32, 64, 100, 300],
        [21, 45, 99, 153, 207, 261, 315],
        [[2], [2, 3], [2, 3], [2, 3], [2], [2]],
    )


class RefEncoder:
    """Reference ``Encoder``: encode, scale_back_batch and the per-image, per-class decode loop."""

    def __init__(self, dboxes: RefDefaultBoxes) -> None:
        self.dboxes = dboxes(order="ltrb")
        self.dboxes_xywh = dboxes(order="xywh").unsqueeze(dim=0)
        self.nboxes = self.dboxes.size(0)
        self.scale_xy = dboxes.scale_xy
        self.scale_wh = dboxes.scale_wh

    def encode(self, bboxes_in, labels_in, criteria=0.5):
        ious = ref_calc_iou_tensor(bboxes_in, self.dboxes)
        best_dbox_ious, best_dbox_idx = ious.max(dim=0)
        best_bbox_ious, best_bbox_idx = ious.max(dim=1)
        best_dbox_ious.index_fill_(0, best_bbox_idx, 2.0)
        idx = torch.arange(0, best_bbox_idx.size(0), dtype=torch.int64)
        best_dbox_idx[best_bbox_idx[idx]] = idx
        masks = best_dbox_ious > criteria
        labels_out = torch.zeros(self.nboxes, dtype=torch.long)
        labels_out[masks] = labels_in[best_dbox_idx[masks]]
        bboxes_out = self.dboxes.clone()
        bboxes_out[masks, :] = bboxes_in[best_dbox_idx[masks], :]
        x = 0.5 * (bboxes_out[:, 0] + bboxes_out[:, 2])
        y = 0.5 * (bboxes_out[:, 1] + bboxes_out[:, 3])
        w = -bboxes_out[:, 0] + bboxes_out[:, 2]
        h = -bboxes_out[:, 1] + bboxes_out[:, 3]
        bboxes_out[:, 0], bboxes_out[:, 1], bboxes_out[:, 2], bboxes_out[:, 3] = x, y, w, h
        return bboxes_out, labels_out

    def scale_back_batch(self, bboxes_in, scores_in):
        bboxes_in = bboxes_in.clone().permute(0, 2, 1)  # the reference works in place on its input
        scores_in = scores_in.permute(0, 2, 1)
        bboxes_in[:, :, :2] = self.scale_xy * bboxes_in[:, :, :2]
        bboxes_in[:, :, 2:] = self.scale_wh * bboxes_in[:, :, 2:]
        bboxes_in[:, :, :2] = bboxes_in[:, :, :2] * self.dboxes_xywh[:, :, 2:] + self.dboxes_xywh[:, :, :2]
        bboxes_in[:, :, 2:] = bboxes_in[:, :, 2:].exp() * self.dboxes_xywh[:, :, 2:]
        l = bboxes_in[:, :, 0] - 0.5 * bboxes_in[:, :, 2]  # noqa: E741
        t = bboxes_in[:, :, 1] - 0.5 * bboxes_in[:, :, 3]
        r = bboxes_in[:, :, 0] + 0.5 * bboxes_in[:, :, 2]
        b = bboxes_in[:, :, 1] + 0.5 * bboxes_in[:, :, 3]
        bboxes_in[:, :, 0], bboxes_in[:, :, 1], bboxes_in[:, :, 2], bboxes_in[:, :, 3] = l, t, r, b
        return bboxes_in, F.softmax(scores_in, dim=-1)

    def decode_batch(self, bboxes_in, scores_in, criteria=0.45, max_output=200, max_num=200):
        bboxes, probs = self.scale_back_batch(bboxes_in, scores_in)
        return [
            self.decode_single(bbox.squeeze(0), prob.squeeze(0), criteria, max_output, max_num)
            for bbox, prob in zip(bboxes.split(1, 0), probs.split(1, 0), strict=False)
        ]

    def decode_single(self, bboxes_in, scores_in, criteria, max_output, max_num=200):
        """Returns (boxes ltrb, labels, scores) in ascending score order, as the reference."""
        bboxes_out, scores_out, labels_out = [], [], []
        for i, score in enumerate(scores_in.split(1, 1)):
            if i == 0:
                continue
            score = score.squeeze(1)
            mask = score > 0.05
            bboxes, score = bboxes_in[mask, :], score[mask]
            if score.size(0) == 0:
                continue
            _, score_idx_sorted = score.sort(dim=0, stable=True)
            score_idx_sorted = score_idx_sorted[-max_num:]
            candidates = []
            while score_idx_sorted.numel() > 0:
                idx = score_idx_sorted[-1].item()
                bboxes_sorted = bboxes[score_idx_sorted, :]
                bboxes_idx = bboxes[idx, :].unsqueeze(dim=0)
                iou_sorted = ref_calc_iou_tensor(bboxes_sorted, bboxes_idx).squeeze()
                score_idx_sorted = score_idx_sorted[iou_sorted < criteria]
                candidates.append(idx)
            bboxes_out.append(bboxes[candidates, :])
            scores_out.append(score[candidates])
            labels_out.extend([i] * len(candidates))
        if not bboxes_out:
            return [torch.tensor([]) for _ in range(3)]
        bboxes_out = torch.cat(bboxes_out, dim=0)
        labels_out = torch.tensor(labels_out, dtype=torch.long)
        scores_out = torch.cat(scores_out, dim=0)
        _, max_ids = scores_out.sort(dim=0, stable=True)
        max_ids = max_ids[-max_output:]
        return bboxes_out[max_ids, :], labels_out[max_ids], scores_out[max_ids]


def ref_decode_as_dicts(locs, logits, criteria=0.5, max_output=200, max_num=200) -> list[dict]:
    """Reference decode, reordered to descending score and returned in ``BoxCoder.decode``'s format."""
    encoder = RefEncoder(ref_dboxes300_coco())
    out = []
    for boxes, labels, scores in encoder.decode_batch(locs, logits, criteria, max_output, max_num):
        if scores.numel() == 0:
            out.append(
                {
                    "boxes": torch.zeros(0, 4),
                    "scores": torch.zeros(0),
                    "labels": torch.zeros(0, dtype=torch.long),
                }
            )
        else:
            out.append({"boxes": boxes.flip(0), "scores": scores.flip(0), "labels": labels.flip(0)})
    return out


# --------------------------------------------------------------------------- checkpoints (entrypoints.py)


def ref_unwrap_distributed(state_dict: dict) -> dict:
    """Reference ``unwrap_distributed``: drops every ``module.1.`` and ``module.`` substring."""
    return {k.replace("module.1.", "").replace("module.", ""): v for k, v in state_dict.items()}
