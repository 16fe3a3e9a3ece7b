"""SSDLoss: a hand-computed case and equality with the reference loss."""

from __future__ import annotations

import math

import pytest
import torch
from reference_ssd import RefLoss, ref_dboxes300_coco

from ssd_lightning.models import DefaultBoxes, SSDLoss, dboxes300_coco


def _tiny_dboxes() -> DefaultBoxes:
    return DefaultBoxes(fig_size=4, feat_size=[2], steps=[2], scales=[2, 3], aspect_ratios=[[]])  # 8 boxes


def test_hand_computed_loss():
    d = _tiny_dboxes()
    loss_fn = SSDLoss(d)
    gt_boxes = d.cxcywh.t().unsqueeze(0).repeat(2, 1, 1)  # every box matched to itself: targets 0
    gt_labels = torch.zeros(2, 8, dtype=torch.int64)
    gt_labels[0, 0] = 1  # image 0: one positive; image 1: none
    locs = torch.full((2, 4, 8), 7.0)  # non-positives' offsets must not count
    locs[0, :, 0] = torch.tensor([0.5, -2.0, 0.0, 0.0])  # smooth-L1: 0.5 * 0.25 + (2 - 0.5) = 1.625
    logits = torch.zeros(2, 2, 8)  # CE = log 2 everywhere; 1 positive + 3 hard negatives
    expected = (1.625 + 4 * math.log(2)) / 1 / 2  # image 1 contributes 0 to the mean over 2
    torch.testing.assert_close(loss_fn(locs, logits, gt_boxes, gt_labels), torch.tensor(expected))


def test_hard_negatives_are_the_largest_ce():
    d = _tiny_dboxes()
    gt_boxes = d.cxcywh.t().unsqueeze(0)
    gt_labels = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0]])
    logits = torch.zeros(1, 2, 8)
    logits[0, 1, 1:] = torch.tensor([5.0, -5.0, 4.0, -4.0, 3.0, 1.0, 0.0])  # CE of negatives rises with it
    ce = torch.nn.functional.softplus(logits[0, 1])  # CE for label 0 with logits (0, z)
    expected = math.log(2) + ce[[1, 3, 5]].sum()  # positive (z=0) + the 3 largest negatives (5, 4, 3)
    loss = SSDLoss(d)(torch.zeros(1, 4, 8), logits, gt_boxes, gt_labels)
    torch.testing.assert_close(loss, expected)


def test_equals_reference_loss_on_random_inputs():
    torch.manual_seed(0)
    n, c, b = 3, 7, 8732
    ours, ref = SSDLoss(dboxes300_coco()), RefLoss(ref_dboxes300_coco())
    dboxes = dboxes300_coco().cxcywh.t()
    labels = torch.randint(1, c, (n, b)) * (torch.rand(n, b) < 0.02)
    labels[2] = 0  # an image without positives
    labels[1, :4000] = torch.randint(1, c, (4000,))  # 3 * positives > B: the clamp of negatives
    gt = dboxes.unsqueeze(0).repeat(n, 1, 1)
    pos = labels > 0
    xy, wh = torch.rand(n, 2, b) * 0.8 + 0.1, torch.rand(n, 2, b) * 0.5 + 0.02
    gt = torch.where(pos[:, None], torch.cat([xy, wh], 1), gt)
    locs = torch.randn(n, 4, b, requires_grad=True)
    logits = torch.randn(n, c, b, requires_grad=True)
    got = ours(locs, logits, gt, labels)
    want = ref(locs, logits, gt, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g_ours = torch.autograd.grad(got, (locs, logits))
    g_ref = torch.autograd.grad(want, (locs, logits))
    for a, r in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    # One layout: the batches' (N, B, 4) must be transposed by the caller, not guessed from the shape.
    with pytest.raises(ValueError, match=r"gt_boxes_cxcywh must have shape \(3, 4, 8732\)"):
        ours(locs, logits, gt.transpose(1, 2), labels)


def test_float32_under_bf16_autocast():
    torch.manual_seed(1)
    d = dboxes300_coco()
    loss_fn = SSDLoss(d)
    labels = torch.randint(1, 5, (2, 8732)) * (torch.rand(2, 8732) < 0.01)
    gt = d.cxcywh.t().unsqueeze(0).repeat(2, 1, 1)
    locs, logits = torch.randn(2, 4, 8732).bfloat16(), torch.randn(2, 5, 8732).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(locs, logits, gt, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_fn(locs.float(), logits.float(), gt, labels))


def test_shape_errors():
    loss_fn = SSDLoss(_tiny_dboxes())
    with pytest.raises(ValueError, match="gt_labels must have shape"):
        loss_fn(torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 4, 8), torch.zeros(1, 7).long())
    with pytest.raises(ValueError, match="logits must have shape"):
        loss_fn(torch.zeros(1, 4, 8), torch.zeros(1, 2, 9), torch.zeros(1, 4, 8), torch.zeros(1, 8).long())
