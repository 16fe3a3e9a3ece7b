"""EndToEndSSD: decoding + NMS in the graph gives BoxCoder.decode's detections, in PyTorch and onnxruntime.

Two kinds of inputs: a real SSD300 (random ResNet-18 weights, 8732 default boxes) exported as one graph, and
hand-made boxes/scores (exact IoU = threshold, equal scores, a crowd of overlapping boxes) fed through a
box coder whose "offsets" are the ltrb boxes themselves, so the graph and the reference see the same boxes.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from ssd_lightning.inference.export import (
    END_TO_END_OUTPUTS,
    EndToEndSSD,
    detection_difference,
    export_end_to_end,
    read_metadata,
)
from ssd_lightning.models import BoxCoder, DefaultBoxes, dboxes300_coco, ssd300

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


def assert_same_detections(outputs, reference: list[dict[str, Tensor]], *, atol: float = 1e-4) -> None:
    """``outputs`` (boxes, scores, labels, num_detections) of the end-to-end model == ``reference`` (decode)
    per image: the same detections (boxes clipped to [0, 1]; boxes and scores within ``atol``), sorted by
    descending score, padding rows zero."""
    boxes, scores, labels, counts = (np.asarray(t) for t in outputs)
    assert counts.shape == (len(reference),)
    for i, ref in enumerate(reference):
        n = int(counts[i])
        assert n == len(ref["scores"]), f"image {i}: {n} detections, decode gives {len(ref['scores'])}"
        assert np.all(np.diff(scores[i, :n]) <= 0), "not sorted by descending score"
        difference = detection_difference(
            boxes[i, :n], scores[i, :n], labels[i, :n], ref["boxes"].clamp(0, 1), ref["scores"], ref["labels"]
        )
        assert difference <= atol, f"image {i}: detections differ by {difference}"
        assert not boxes[i, n:].any() and not scores[i, n:].any() and not labels[i, n:].any()
        assert boxes.min() >= 0 and boxes.max() <= 1


# ------------------------------------------------------------------------------------- a real SSD300
@pytest.fixture(scope="module")
def real_export(tmp_path_factory):
    torch.manual_seed(0)
    net = ssd300(backbone="resnet18", num_classes=5).eval()
    model = EndToEndSSD(net, BoxCoder(dboxes300_coco()), score_thresh=0.2, max_detections=100)
    path = export_end_to_end(
        model, tmp_path_factory.mktemp("e2e") / "model.onnx", metadata={"class_names": list("_abcd")}
    )
    return model, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("batch_size", [1, 3])
def test_onnxruntime_gives_the_decoders_detections_at_any_batch_size(real_export, batch_size):
    model, session = real_export
    assert [i.name for i in session.get_inputs()] == ["images"]
    assert [o.name for o in session.get_outputs()] == list(END_TO_END_OUTPUTS)
    images = torch.randn(batch_size, 3, 300, 300, generator=torch.Generator().manual_seed(batch_size))
    outputs = session.run(None, {"images": images.numpy()})
    assert [o.shape for o in outputs] == [(batch_size, 100, 4), (batch_size, 100), (batch_size, 100),
                                          (batch_size,)]  # fmt: skip
    assert outputs[2].dtype == np.int64 and outputs[3].dtype == np.int64
    with torch.no_grad():
        locs, logits = model.net(images)
    reference = model.box_coder.decode(locs, logits, **model.decoder_settings)
    counts = [len(r["scores"]) for r in reference]
    assert min(counts) > 20, counts  # the top-k cut and the NMS both had work to do
    assert_same_detections(outputs, reference)
    with torch.no_grad():  # the module itself, in PyTorch
        assert_same_detections(model(images), reference, atol=0)


def test_metadata_and_padding_when_fewer_candidates_than_max_detections(real_export, tmp_path):
    _, session = real_export
    meta = read_metadata(session.get_modelmeta().custom_metadata_map)
    assert meta == {"kind": "detector", "class_names": list("_abcd"), "image_size": 300,
                    "decoder": {"score_thresh": 0.2, "nms_iou": 0.5, "topk_per_class": 200,
                                "max_detections": 100}}  # fmt: skip
    # 4 classes x 3 candidates < max_detections = 20: the outputs are still padded to K = 20
    torch.manual_seed(1)
    net = ssd300(backbone="resnet18", num_classes=5).eval()
    model = EndToEndSSD(
        net, BoxCoder(dboxes300_coco()), score_thresh=0.0, topk_per_class=3, max_detections=20
    )
    images = torch.randn(2, 3, 300, 300)
    with torch.no_grad():
        outputs = model(images)
        locs, logits = net(images)
    assert outputs[0].shape == (2, 20, 4) and outputs[1].shape == (2, 20)
    assert_same_detections(outputs, model.box_coder.decode(locs, logits, **model.decoder_settings), atol=0)


# ------------------------------------------------------------------------- hand-made boxes and scores
class BoxesAsOffsets(BoxCoder):
    """A box coder whose ``locs`` (N, 4, B) are already ltrb boxes: tests choose the decoded boxes."""

    def decode_boxes(self, locs: Tensor) -> Tensor:
        return locs.float().permute(0, 2, 1)


class DecodeOnly(nn.Module):
    """``EndToEndSSD.decode`` as a module with inputs (locs, logits), to export it alone."""

    def __init__(self, model: EndToEndSSD) -> None:
        super().__init__()
        self.model = model

    def forward(self, locs: Tensor, logits: Tensor):
        return self.model.decode(locs, logits)


NUM_BOXES = 64  # DefaultBoxes below: one 4x4 map, 4 boxes per location
ULP = 2e-7  # onnxruntime's softmax may differ from torch's in the last bit; boxes are copied exactly


def _coder() -> BoxesAsOffsets:
    return BoxesAsOffsets(DefaultBoxes(300, [4], [75], [100, 150], [[2]]))


def _run_both(locs: Tensor, logits: Tensor, tmp_path, coder: BoxCoder | None = None, **settings):
    """(onnxruntime outputs, PyTorch module outputs, BoxCoder.decode reference) on the same inputs."""
    coder = coder or _coder()
    model = EndToEndSSD(nn.Identity(), coder, **settings)
    path = tmp_path / "decode.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            DecodeOnly(model), (locs, logits), str(path), input_names=["locs", "logits"],
            output_names=list(END_TO_END_OUTPUTS), opset_version=17, dynamo=False,
            dynamic_axes={name: {0: "batch"} for name in ("locs", "logits", *END_TO_END_OUTPUTS)},
        )  # fmt: skip
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    onnx_out = session.run(None, {"locs": locs.numpy(), "logits": logits.numpy()})
    with torch.no_grad():
        torch_out = model.decode(locs, logits)
    return onnx_out, torch_out, coder.decode(locs, logits, **model.decoder_settings)


def _inputs(boxes: list[list[float]], scores: list[list[float]]) -> tuple[Tensor, Tensor]:
    """One image: the given ltrb boxes (rest: far-apart tiny boxes) and per-box foreground scores.

    Logits are log(score) with background taking the rest, so softmax gives the scores back (up to
    rounding, the same rounding in every implementation for equal inputs).
    """
    locs = torch.zeros(1, 4, NUM_BOXES)
    for j in range(NUM_BOXES):  # filler boxes: disjoint, low score
        locs[0, :, j] = torch.tensor([j, 0.0, j + 0.01, 0.01]) / NUM_BOXES
    fg = torch.full((NUM_BOXES, len(scores[0])), 1e-3)
    fg[: len(boxes)] = torch.tensor(scores)
    locs[0, :, : len(boxes)] = torch.tensor(boxes).T
    probs = torch.cat([(1 - fg.sum(1, keepdim=True)).clamp(min=1e-3), fg], dim=1)
    return locs, probs.log().T.unsqueeze(0).contiguous()


def test_iou_exactly_at_the_threshold_suppresses_as_in_the_decoder(tmp_path):
    # IoU(a, b) = 0.125 / 0.25 = 0.5 exactly (suppressed: the decoder's rule is IoU >= nms_iou; ONNX's is
    # IoU > threshold); IoU(a, c) = 0.1245 / 0.25 < 0.5 (kept).
    a, b, c = [0, 0, 0.5, 0.5], [0, 0, 0.5, 0.25], [0, 0, 0.5, 0.249]
    locs, logits = _inputs([a, b, [0.6, 0.6, 1, 1], c], [[0.6], [0.5], [0.4], [0.3]])
    onnx_out, torch_out, reference = _run_both(locs, logits, tmp_path, score_thresh=0.05)
    kept = reference[0]["boxes"]
    for box, expected in ((a, True), (b, False), (c, True)):  # the reference's own behaviour, pinned
        assert (kept == torch.tensor(box)).all(dim=1).any() == expected, box
    assert_same_detections(onnx_out, reference, atol=ULP)
    assert_same_detections(torch_out, reference, atol=0)


def test_equal_scores_resolve_as_in_the_decoder(tmp_path):
    # five identical boxes with the same score: the decoder keeps the one with the largest box index;
    # topk_per_class=2 cuts inside a tie of three disjoint boxes (the later two are taken), and
    # max_detections=3 cuts inside a tie across classes (the later class first).
    same = [0.1, 0.1, 0.3, 0.3]
    boxes = [same] * 5 + [[0.5, 0.0, 0.6, 0.1], [0.7, 0.0, 0.8, 0.1], [0.9, 0.0, 1.0, 0.1]]
    scores = [[0.5, 0.0]] * 5 + [[0.25, 0.25]] * 3
    locs, logits = _inputs(boxes, scores)
    probs = torch.softmax(logits, dim=1)
    assert probs[0, 1, 0] == probs[0, 1, 4] and probs[0, 2, 5] == probs[0, 1, 7]  # real ties
    settings = {"score_thresh": 0.1, "topk_per_class": 2, "max_detections": 3}
    onnx_out, torch_out, reference = _run_both(locs, logits, tmp_path, **settings)
    assert len(reference[0]["scores"]) == 3
    assert_same_detections(onnx_out, reference, atol=ULP)
    # the exact rows, in order (the tie order is part of the contract)
    np.testing.assert_array_equal(onnx_out[2][0], reference[0]["labels"].numpy())
    np.testing.assert_array_equal(onnx_out[0][0], reference[0]["boxes"].numpy())


def test_score_equal_to_the_threshold_is_dropped(tmp_path):
    logits = torch.zeros(1, 4, NUM_BOXES)  # 4 equal logits: every score is exactly 0.25
    locs, _ = _inputs([[0, 0, 0.2, 0.2]], [[0.1, 0.1, 0.1]])
    onnx_out, torch_out, reference = _run_both(locs, logits, tmp_path, score_thresh=0.25)
    assert len(reference[0]["scores"]) == 0 and onnx_out[3].tolist() == [0] and int(torch_out[3]) == 0
    onnx_out, _, reference = _run_both(locs, logits, tmp_path, score_thresh=0.2499)
    assert len(reference[0]["scores"]) == 3 * NUM_BOXES  # all tied, none overlapping
    assert_same_detections(onnx_out, reference, atol=ULP)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_crowd_of_overlapping_boxes(tmp_path, seed):
    """64 jittered boxes around a few spots, 3 classes, batch of 2: long suppression chains."""
    gen = torch.Generator().manual_seed(seed)
    centre = (
        torch.rand(2, 1, 2, generator=gen) * 0.4 + 0.3 + 0.1 * torch.randn(2, NUM_BOXES, 2, generator=gen)
    )
    size = 0.3 * torch.exp(0.3 * torch.randn(2, NUM_BOXES, 2, generator=gen))
    locs = torch.cat([centre - size / 2, centre + size / 2], dim=2).permute(0, 2, 1).contiguous()
    logits = 3 * torch.randn(2, 4, NUM_BOXES, generator=gen)
    onnx_out, torch_out, reference = _run_both(locs, logits, tmp_path, score_thresh=0.05, topk_per_class=40,
                                               max_detections=25)  # fmt: skip
    counts = [len(r["scores"]) for r in reference]
    assert all(4 <= c < 40 for c in counts), counts  # NMS removed most of the 3 x 40 candidates
    assert_same_detections(onnx_out, reference, atol=ULP)
    assert_same_detections(torch_out, reference, atol=0)


def test_saturated_scores_thousands_of_ties(tmp_path):
    """SSD300's 8732 default boxes (zero offsets: both runtimes compute the same boxes) with logits 0 or
    -200: every score is exactly 1, 1/2, 1/3 ... so the top-k cut, the NMS order and the final cut all fall
    inside ties, which the graph must break as the decoder does (an untrained net looks like this)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.where(torch.rand(2, 5, 8732, generator=gen) < 0.3, 0.0, -200.0)
    locs = torch.zeros(2, 4, 8732)
    onnx_out, torch_out, reference = _run_both(locs, logits, tmp_path, coder=BoxCoder(dboxes300_coco()))
    scores = torch.cat([r["scores"] for r in reference])
    assert len(scores) == 400 and (scores == 1).sum() > 300  # ties all the way
    assert_same_detections(onnx_out, reference, atol=ULP)
    assert_same_detections(torch_out, reference, atol=0)
    for i, ref in enumerate(reference):  # row for row, not only as sets
        np.testing.assert_array_equal(onnx_out[2][i], ref["labels"].numpy())
        np.testing.assert_allclose(onnx_out[0][i], ref["boxes"].clamp(0, 1).numpy(), rtol=0, atol=ULP)


def test_detection_difference_matches_detections_in_any_order():
    boxes = np.array([[0, 0, 1, 1], [0.2, 0.2, 0.4, 0.4], [0.5, 0.5, 0.9, 0.9]])
    scores, labels = np.array([0.9, 0.9, 0.3]), np.array([1, 1, 2])
    order = [1, 2, 0]
    assert detection_difference(boxes, scores, labels, boxes[order], scores[order], labels[order]) == 0
    moved = boxes.copy()
    moved[2, 3] += 0.01
    assert detection_difference(moved, scores, labels, boxes, scores, labels) == pytest.approx(0.01)
    assert detection_difference(boxes, scores, [1, 2, 2], boxes, scores, labels) == np.inf
    assert detection_difference(boxes[:2], scores[:2], labels[:2], boxes, scores, labels) == np.inf
    assert detection_difference(np.zeros((0, 4)), [], [], np.zeros((0, 4)), [], []) == 0


def test_bad_settings_are_refused():
    net, coder = nn.Identity(), BoxCoder(dboxes300_coco())
    with pytest.raises(ValueError, match="nms_iou must be in"):
        EndToEndSSD(net, coder, nms_iou=0.0)
    with pytest.raises(ValueError, match="max_detections must be >= 1"):
        EndToEndSSD(net, coder, max_detections=0)
    with pytest.raises(ValueError, match="score_thresh"):
        EndToEndSSD(net, coder, score_thresh=1.0)
    with pytest.raises(ValueError, match="opset must be >= 11"):
        export_end_to_end(EndToEndSSD(net, coder), "unused.onnx", opset=10)
