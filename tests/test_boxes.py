"""Default boxes and the BoxCoder encoder: known answers and equality with the reference."""

from __future__ import annotations

import math

import pytest
import torch
from reference_ssd import RefEncoder, ref_dboxes300_coco
from torchvision.models.detection.anchor_utils import DefaultBoxGenerator

from ssd_lightning.models import BoxCoder, DefaultBoxes, dboxes300_coco
from ssd_lightning.models.boxes import match_boxes
from tests.helpers import encode_images


def test_dboxes300_count_dtype_and_first_boxes():
    d = dboxes300_coco()
    assert len(d) == 8732 and d.cxcywh.shape == (8732, 4) and d.ltrb.shape == (8732, 4)
    assert d.cxcywh.dtype == torch.float32 and d.ltrb.dtype == torch.float32
    assert (d.scale_xy, d.scale_wh) == (0.1, 0.2)
    fk = 300 / 8
    # Box 0: first location of the 38x38 map, size 21/300; box 1: the next column.
    torch.testing.assert_close(d.cxcywh[0], torch.tensor([0.5 / fk, 0.5 / fk, 0.07, 0.07]))
    torch.testing.assert_close(d.cxcywh[1], torch.tensor([1.5 / fk, 0.5 / fk, 0.07, 0.07]))
    # Box 38: second row. Box 1444: the sqrt(s1 * s2) size at the first location.
    torch.testing.assert_close(d.cxcywh[38], torch.tensor([0.5 / fk, 1.5 / fk, 0.07, 0.07]))
    s = math.sqrt(0.07 * 0.15)
    torch.testing.assert_close(d.cxcywh[1444], torch.tensor([0.5 / fk, 0.5 / fk, s, s]))
    # Box 2*1444: aspect ratio 2 -> (w, h) = (s*sqrt2, s/sqrt2), then box 3*1444 the transpose.
    w, h = 0.07 * math.sqrt(2), 0.07 / math.sqrt(2)
    torch.testing.assert_close(d.cxcywh[2 * 1444, 2:], torch.tensor([w, h]))
    torch.testing.assert_close(d.cxcywh[3 * 1444, 2:], torch.tensor([h, w]))
    # The last box: the 1x1 map, aspect ratio 2 transposed, clamped to 1.
    assert d.cxcywh[-1, 3].item() == 1.0
    assert d.cxcywh.min() >= 0 and d.cxcywh.max() <= 1
    torch.testing.assert_close(d.ltrb[:, :2], d.cxcywh[:, :2] - d.cxcywh[:, 2:] / 2)


def test_dboxes300_bitwise_equal_to_reference_construction():
    d, ref = dboxes300_coco(), ref_dboxes300_coco()
    assert torch.equal(d.cxcywh, ref("xywh"))
    assert torch.equal(d.ltrb, ref("ltrb"))


def test_dboxes300_same_set_as_torchvision_default_box_generator():
    gen = DefaultBoxGenerator(
        [[2], [2, 3], [2, 3], [2, 3], [2], [2]],
        scales=[0.07, 0.15, 0.33, 0.51, 0.69, 0.87, 1.05],
        steps=[8, 16, 32, 64, 100, 300],
    )
    tv = gen._grid_default_boxes([[s, s] for s in (38, 19, 10, 5, 3, 1)], [300, 300]).clamp(0, 1)
    ours = dboxes300_coco().cxcywh

    def canonical(boxes: torch.Tensor) -> list[tuple[float, ...]]:
        return sorted(tuple(round(v, 5) for v in row) for row in boxes.tolist())

    assert len(tv) == 8732
    assert canonical(ours) == canonical(tv)


def test_default_boxes_rejects_inconsistent_arguments():
    with pytest.raises(ValueError, match="scales"):
        DefaultBoxes(300, [38, 19], [8, 16], [21, 45], [[2], [2]])
    with pytest.raises(ValueError, match="one entry per feature map"):
        DefaultBoxes(300, [38, 19], [8], [21, 45, 99], [[2], [2]])


# A tiny box set for hand-computed answers: a 2x2 map; sizes 0.5 (quadrants) and sqrt(0.5*0.75).
#   0: [0, 0, .5, .5]   1: [.5, 0, 1, .5]   2: [0, .5, .5, 1]   3: [.5, .5, 1, 1]
#   4..7: the same centres, side 0.6124
@pytest.fixture
def tiny_coder() -> BoxCoder:
    return BoxCoder(DefaultBoxes(fig_size=4, feat_size=[2], steps=[2], scales=[2, 3], aspect_ratios=[[]]))


def test_tiny_boxes_layout(tiny_coder):
    ltrb = tiny_coder.default_boxes.ltrb
    torch.testing.assert_close(
        ltrb[:4], torch.tensor([[0, 0, 0.5, 0.5], [0.5, 0, 1, 0.5], [0, 0.5, 0.5, 1], [0.5, 0.5, 1, 1]])
    )
    torch.testing.assert_close(ltrb[4, 2] - ltrb[4, 0], torch.tensor(math.sqrt(0.5 * 0.75)))


def test_encode_gt_equal_to_default_box(tiny_coder):
    # IoU 1 with box 0 and 0.25 / 0.375 = 0.667 with box 4 (which contains it): both matched.
    boxes, labels = tiny_coder.encode(torch.tensor([[0.0, 0.0, 0.5, 0.5]]), torch.tensor([3]))
    assert labels.tolist() == [3, 0, 0, 0, 3, 0, 0, 0]
    assert labels.dtype == torch.int64 and boxes.dtype == torch.float32
    torch.testing.assert_close(boxes[0], torch.tensor([0.25, 0.25, 0.5, 0.5]))
    torch.testing.assert_close(boxes[4], torch.tensor([0.25, 0.25, 0.5, 0.5]))
    # Unmatched default boxes carry themselves, as (cx, cy, w, h).
    torch.testing.assert_close(boxes[[1, 2, 3, 5, 6, 7]], tiny_coder.default_boxes.cxcywh[[1, 2, 3, 5, 6, 7]])


def test_encode_forces_gt_below_threshold_onto_best_box(tiny_coder):
    # IoU 0.04 / 0.25 = 0.16 with box 3 (best), 0.107 with box 7: below 0.5, but forced onto box 3.
    boxes, labels = tiny_coder.encode(torch.tensor([[0.6, 0.6, 0.8, 0.8]]), torch.tensor([2]))
    assert labels.tolist() == [0, 0, 0, 2, 0, 0, 0, 0]
    torch.testing.assert_close(boxes[3], torch.tensor([0.7, 0.7, 0.2, 0.2]))


def test_encode_two_gts_compete(tiny_coder):
    # gt1 = box 0 exactly; gt2 = [0, 0, .6, .6]: IoU(gt2, box0) = .694, IoU(gt2, box4) = .727 > .667.
    gts = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.6, 0.6]])
    _, labels = tiny_coder.encode(gts, torch.tensor([1, 2]))
    assert labels.tolist() == [1, 0, 0, 0, 2, 0, 0, 0]
    # gt2 = [0, 0, .55, .55] has box 0 as its best box too (.826 vs .807): both are forced onto box 0 and
    # the later ground truth wins it (reference behaviour); box 4 prefers gt2 (.807 > .667).
    gts = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.55, 0.55]])
    boxes, labels = tiny_coder.encode(gts, torch.tensor([1, 2]))
    assert labels.tolist() == [2, 0, 0, 0, 2, 0, 0, 0]
    torch.testing.assert_close(boxes[0], torch.tensor([0.275, 0.275, 0.55, 0.55]))


def test_encode_threshold_is_strict(tiny_coder):
    # IoU(gt, box 4) = 0.667: matched at threshold 0.6, not at 0.7 (box 0 stays matched: IoU 1).
    gt, lab = torch.tensor([[0.0, 0.0, 0.5, 0.5]]), torch.tensor([1])
    assert tiny_coder.encode(gt, lab, iou_threshold=0.6)[1][4] == 1
    assert tiny_coder.encode(gt, lab, iou_threshold=0.7)[1][4] == 0


def test_encode_no_boxes_gives_background(tiny_coder):
    boxes, labels = tiny_coder.encode(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))
    assert labels.tolist() == [0] * 8
    torch.testing.assert_close(boxes, tiny_coder.default_boxes.cxcywh)


def test_encode_equals_reference_on_random_boxes():
    coder, ref = BoxCoder(dboxes300_coco()), RefEncoder(ref_dboxes300_coco())
    g = torch.Generator().manual_seed(0)
    for m in (1, 3, 17):
        xy = torch.rand(m, 2, generator=g) * 0.7
        wh = torch.rand(m, 2, generator=g) * 0.3 + 0.01
        gt = torch.cat([xy, xy + wh], dim=1)
        labels = torch.randint(1, 81, (m,), generator=g)
        b, lab = coder.encode(gt, labels)
        rb, rlab = ref.encode(gt.clone(), labels)
        assert torch.equal(lab, rlab)
        assert torch.equal(b, rb)
        assert (lab > 0).sum() >= m  # every ground truth got at least its forced box


@pytest.mark.parametrize(("last_wins_ties", "expected"), [(False, [0, -1, 2, 1]), (True, [-1, 0, 2, 2])])
def test_match_boxes_tie_rules(last_wins_ties, expected):
    # g0 (top half): IoU .5 with boxes 0 and 1, forced onto the first or the last of them; g1 = g2 (bottom
    # half) both forced onto box 2 (IoU 1): the later wins in both rules; box 3: IoU .909 with g1 and g2.
    defaults = torch.tensor([[0, 0, 0.5, 0.5], [0.5, 0, 1, 0.5], [0, 0.5, 1, 1], [0, 0.45, 1, 1]])
    gts = torch.tensor([[[0, 0, 1, 0.5], [0, 0.5, 1, 1], [0, 0.5, 1, 1]]] * 2)  # two images
    gt_index, positive, best_iou = match_boxes(gts, defaults, last_wins_ties=last_wins_ties)
    assert torch.where(positive, gt_index, -1).tolist() == [expected] * 2
    assert best_iou.tolist() == [[0.5, 1.0, 1.0]] * 2


def test_encode_per_image_and_input_checks(tiny_coder):
    gts = [torch.tensor([[0.0, 0.0, 0.5, 0.5]]), torch.tensor([[0.6, 0.6, 0.8, 0.8]])]
    boxes, labels = encode_images(tiny_coder, gts, [torch.tensor([3]), torch.tensor([2])])
    assert boxes.shape == (2, 4, 8) and labels.tolist() == [
        [3, 0, 0, 0, 3, 0, 0, 0],
        [0, 0, 0, 2, 0, 0, 0, 0],
    ]
    with pytest.raises(ValueError, match="labels must have shape"):
        tiny_coder.encode(torch.zeros(2, 4), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"boxes_ltrb must have shape \(M, 4\)"):
        tiny_coder.encode(torch.zeros(2, 5), torch.zeros(2, dtype=torch.int64))


def test_decode_boxes_inverts_encoding_offsets():
    coder = BoxCoder(dboxes300_coco())
    d = coder.default_boxes
    # Zero offsets decode to the default boxes themselves.
    torch.testing.assert_close(coder.decode_boxes(torch.zeros(1, 4, 8732))[0], d.ltrb)
    # Offsets of a known box: xy = (g - d) / d_wh / 0.1, wh = log(g / d) / 0.2.
    g = torch.tensor([0.4, 0.5, 0.2, 0.3])
    i = 5000
    off = torch.cat(
        [(g[:2] - d.cxcywh[i, :2]) / d.cxcywh[i, 2:] / 0.1, torch.log(g[2:] / d.cxcywh[i, 2:]) / 0.2]
    )
    locs = torch.zeros(1, 4, 8732)
    locs[0, :, i] = off
    torch.testing.assert_close(coder.decode_boxes(locs)[0, i], torch.tensor([0.3, 0.35, 0.5, 0.65]))
