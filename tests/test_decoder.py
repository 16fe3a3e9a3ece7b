"""BoxCoder.decode: same detections as the reference per-image algorithm, and planted known answers."""

from __future__ import annotations

import pytest
import torch
from reference_ssd import ref_decode_as_dicts

from ssd_lightning.models import BoxCoder, dboxes300_coco
from ssd_lightning.models.boxes import box_iou

B = 8732


@pytest.fixture(scope="module")
def coder() -> BoxCoder:
    return BoxCoder(dboxes300_coco())


def _assert_same(ours: list[dict], ref: list[dict]) -> None:
    assert len(ours) == len(ref)
    for o, r in zip(ours, ref, strict=True):
        assert o["labels"].dtype == torch.int64
        assert o["scores"].shape == r["scores"].shape, (o["scores"].shape, r["scores"].shape)
        assert torch.equal(o["labels"], r["labels"])
        assert torch.equal(o["scores"], r["scores"])
        assert torch.equal(o["boxes"], r["boxes"])


def _random_outputs(n: int, c: int, seed: int, logit_scale: float = 1.0, quantum: float | None = None):
    g = torch.Generator().manual_seed(seed)
    locs = torch.randn(n, 4, B, generator=g)
    logits = torch.randn(n, c, B, generator=g) * logit_scale
    if quantum is not None:  # coarse logits: many exactly equal scores (ties)
        logits = (logits / quantum).round() * quantum
    return locs, logits


@pytest.mark.parametrize(
    ("n", "c", "nms_iou", "topk", "max_det", "quantum"),
    [
        (2, 6, 0.5, 200, 200, None),  # many candidates per class (> 200): the top-k cut matters
        (2, 5, 0.45, 30, 40, None),  # small per-class and per-image cuts
        (2, 4, 0.5, 200, 100, 0.5),  # ties everywhere: tie order and ties at the cuts
    ],
)
def test_equals_reference_on_random_outputs(coder, n, c, nms_iou, topk, max_det, quantum):
    locs, logits = _random_outputs(n, c, seed=c, quantum=quantum)
    ours = coder.decode(locs, logits, nms_iou=nms_iou, topk_per_class=topk, max_detections=max_det)
    ref = ref_decode_as_dicts(locs, logits, criteria=nms_iou, max_output=max_det, max_num=topk)
    _assert_same(ours, ref)
    assert all(len(o["scores"]) > 0 for o in ours)
    for o in ours:  # descending scores
        assert (o["scores"][1:] <= o["scores"][:-1]).all()


def test_equals_reference_with_sparse_confident_outputs(coder):
    # Trained-model-like: mostly background, a few clusters of overlapping confident boxes.
    g = torch.Generator().manual_seed(3)
    n, c = 3, 5
    locs = torch.randn(n, 4, B, generator=g) * 0.5
    logits = torch.zeros(n, c, B)
    logits[:, 0] = 6.0
    hot = torch.randint(0, B, (n, 400), generator=g)
    for i in range(n):
        logits[i, 1:, hot[i]] = torch.randn(c - 1, 400, generator=g) * 3 + 5
    _assert_same(coder.decode(locs, logits), ref_decode_as_dicts(locs, logits))


def _index(level_offset: int, fsize: int, size_set: int, row: int, col: int) -> int:
    """Default-box index: per level, per box size, per location (row-major)."""
    return level_offset + size_set * fsize * fsize + row * fsize + col


def test_planted_boxes_known_survivors(coder):
    d = coder.default_boxes.ltrb
    a = _index(0, 38, 0, 10, 10)  # 38x38 map, size 0.07 at (row 10, col 10)
    b = _index(0, 38, 2, 10, 10)  # same place, aspect ratio 2 (0.099 x 0.0495)
    c = _index(0, 38, 0, 10, 11)  # next column, size 0.07
    far = _index(0, 38, 0, 30, 30)
    iou = box_iou(d[[a]], d[[b, c, far]])[0]
    assert 0.5 < iou[0] < 0.55 and 0.4 < iou[1] < 0.5 and iou[2] == 0  # the overlaps the test relies on

    locs = torch.zeros(1, 4, B)  # decoded boxes = default boxes
    logits = torch.zeros(1, 3, B)
    logits[0, 0] = 12.0  # background everywhere: every score ~6e-6, far below 0.05
    for box, cls, z in ((a, 1, 10.0), (b, 1, 9.0), (c, 1, 8.0), (far, 1, 7.0), (b, 2, 9.5)):
        logits[0, 0, box] = 0.0
        logits[0, cls, box] = z
    (det,) = coder.decode(locs, logits)
    # Scores: a 0.9999, c 0.9993, far 0.9982; box b splits its mass: class 1 0.38, class 2 0.62.
    # Class 1: a kept, b suppressed by a (IoU 0.547 >= 0.5), c kept (0.448), far kept. Class 2: b kept.
    assert det["labels"].tolist() == [1, 1, 1, 2]
    torch.testing.assert_close(det["boxes"], d[[a, c, far, b]], rtol=0, atol=1e-7)
    assert (det["scores"][1:] < det["scores"][:-1]).all()
    # With a looser NMS threshold b survives in class 1 too.
    (det,) = coder.decode(locs, logits, nms_iou=0.55)
    assert sorted(zip(det["labels"].tolist(), det["boxes"][:, 0].tolist(), strict=True)) == sorted(
        zip([1, 1, 1, 1, 2], d[[a, b, c, far, b], 0].tolist(), strict=True)
    )
    # max_detections keeps the best.
    (det,) = coder.decode(locs, logits, max_detections=2)
    torch.testing.assert_close(det["boxes"], d[[a, c]], rtol=0, atol=1e-7)


def test_score_threshold_is_strict(coder):
    logits = torch.zeros(1, 4, B)  # all four classes equal: every score is exactly 0.25
    (det,) = coder.decode(torch.zeros(1, 4, B), logits, score_thresh=0.25)
    assert det["scores"].numel() == 0
    (det,) = coder.decode(torch.zeros(1, 4, B), logits, score_thresh=0.2499, topk_per_class=3)
    # 3 candidates per class, all with score 0.25: ties go to the larger box index (B-1, B-2, B-3) and,
    # across classes, to the larger class; NMS between different boxes of the 1x1 map suppresses some.
    assert (det["scores"] == 0.25).all()
    assert det["labels"].tolist() == sorted(det["labels"].tolist(), reverse=True)


def test_all_background_gives_empty_detections(coder):
    logits = torch.zeros(2, 3, B)
    logits[:, 0] = 20.0
    dets = coder.decode(torch.zeros(2, 4, B), logits)
    assert len(dets) == 2
    for det in dets:
        assert det["boxes"].shape == (0, 4) and det["scores"].shape == (0,) and det["labels"].shape == (0,)
        assert det["labels"].dtype == torch.int64


def test_one_image_empty_other_not(coder):
    locs, logits = _random_outputs(2, 3, seed=5)
    logits[1, 0] = 30.0
    dets = coder.decode(locs, logits)
    assert dets[0]["scores"].numel() > 0 and dets[1]["scores"].numel() == 0
    _assert_same(dets, ref_decode_as_dicts(locs, logits))


def test_degenerate_boxes_take_the_dense_path(coder):
    # Huge negative size offsets make zero-area boxes, where the reference's IoU is NaN (0 / 0): such a
    # pair counts as overlapping (NaN is not < threshold). Same answer as the reference.
    locs, logits = _random_outputs(1, 3, seed=7)
    locs[0, 2:, ::3] = -1000.0
    _assert_same(coder.decode(locs, logits), ref_decode_as_dicts(locs, logits))


def test_input_shape_errors(coder):
    with pytest.raises(ValueError, match="locs must have shape"):
        coder.decode(torch.zeros(1, 4, 100), torch.zeros(1, 3, 100))
    with pytest.raises(ValueError, match="logits must have shape"):
        coder.decode(torch.zeros(1, 4, B), torch.zeros(2, 3, B))


def test_nms_long_suppression_chain():
    # Boxes sliding right by 0.3 of their width: neighbours overlap with IoU 0.7 / 1.3 = 0.54, boxes
    # two apart 0.4 / 1.6 = 0.25. Greedy in order keeps 0, drops 1 (by 0), keeps 2 (1 is gone), ...
    from ssd_lightning.models.boxes import _batched_greedy_nms

    k = 50
    left = torch.arange(k, dtype=torch.float32) * 0.03
    boxes = torch.stack([left, torch.zeros(k), left + 0.1, torch.full((k,), 0.5)], dim=1)
    rows = torch.stack([boxes, boxes.flip(0)])  # second row: processed right to left
    keep = _batched_greedy_nms(rows, torch.ones(2, k, dtype=torch.bool), 0.5)
    expected = torch.arange(k) % 2 == 0
    assert torch.equal(keep, torch.stack([expected, expected]))
