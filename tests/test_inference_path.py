"""One inference path: decoder defaults in one place, one strict-loader message, one COCO rounding,
predict without Lightning, models importing nothing of the package outside models/."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch
import yaml

from ssd_lightning.evaluation import coco_array_to_results, to_coco_array
from ssd_lightning.models import BoxCoder, DecoderSettings, dboxes300_coco
from ssd_lightning.models._loading import check_state_dict, load_state_dict_strict
from tests.helpers import REPO_ROOT, run_script


def test_predict_imports_no_lightning():
    code = "import ssd_lightning.inference.predict, sys; assert 'pytorch_lightning' not in sys.modules"
    result = run_script("-c", code)
    assert result.returncode == 0, result.stderr[-2000:]


def test_models_import_nothing_of_the_package_outside_models():
    for path in sorted((REPO_ROOT / "ssd_lightning" / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("ssd_lightning"):
                    assert name.startswith("ssd_lightning.models"), f"{path.name} imports {name}"


def test_decoder_defaults_are_written_once():
    settings = DecoderSettings()
    assert dict(settings) == {
        "score_thresh": 0.05,
        "nms_iou": 0.5,
        "topk_per_class": 200,
        "max_detections": 200,
    }
    # the configs declare the keys and leave the values to DecoderSettings
    model = yaml.safe_load((REPO_ROOT / "configs" / "model" / "ssd300.yaml").read_text())
    predict = yaml.safe_load((REPO_ROOT / "configs" / "predict.yaml").read_text())
    assert model["decoder"] == predict["decoder"] == dict.fromkeys(settings)
    assert DecoderSettings.from_mapping(model["decoder"]) == settings
    saved = {"score_thresh": 0.2, "max_detections": 30}
    merged = DecoderSettings.from_mapping(
        {"max_detections": None, "nms_iou": 0.4}, base=DecoderSettings.from_mapping(saved)
    )
    assert merged == {"score_thresh": 0.2, "nms_iou": 0.4, "topk_per_class": 200, "max_detections": 30}
    with pytest.raises(ValueError, match=r"unknown decoder setting 'iou'"):
        DecoderSettings.from_mapping({"iou": 0.4})
    with pytest.raises(ValueError, match="max_detections must be >= 1"):
        DecoderSettings(max_detections=0)


def test_box_coder_detect_is_decode_in_pixels():
    coder = BoxCoder(dboxes300_coco())
    generator = torch.Generator().manual_seed(0)
    locs, logits = (
        torch.randn(2, 4, 8732, generator=generator),
        3 * torch.randn(2, 4, 8732, generator=generator),
    )
    settings = DecoderSettings(max_detections=20)
    got = coder.detect(locs, logits, torch.tensor([[200, 400], [50, 60]]), settings)
    want = coder.decode(locs, logits, **settings)
    for det, ref, (h, w) in zip(got, want, [(200, 400), (50, 60)], strict=True):
        assert len(det["scores"]) == 20
        assert torch.equal(det["boxes"], ref["boxes"] * torch.tensor([w, h, w, h], dtype=torch.float32))
        assert torch.equal(det["scores"], ref["scores"]) and torch.equal(det["labels"], ref["labels"])


def test_one_strict_loader_message():
    expected = {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)}
    state = {"a": torch.zeros(2), "b": torch.zeros(4), "d": torch.zeros(1)}
    with pytest.raises(ValueError) as error:
        check_state_dict(expected, state, source="x.pt", target="net(k=1)", hint="Check k")
    assert str(error.value) == (
        "x.pt does not fit net(k=1): missing (1): ['c']; unexpected (1): ['d']; "
        "shape mismatch (1): ['b: checkpoint (4,) vs model (3,)']. Check k"
    )
    check_state_dict(expected, dict(expected), source="x.pt", target="net")  # fits: no error
    model = torch.nn.Linear(2, 3)
    source = {"weight": torch.ones(3, 2), "bias": torch.ones(5)}
    load_state_dict_strict(model, source, source="s", target="t", skip=("bias",))  # bias left as is
    assert torch.equal(model.weight, torch.ones(3, 2)) and not torch.equal(model.bias, torch.ones(3))


def test_one_coco_rounding():
    class Categories:
        def label_to_category_id(self, labels):
            return labels + 10

    boxes = np.array([[1.23456, 2.0, 11.98765, 7.5]])
    array = to_coco_array([3], [boxes], [np.array([0.1234567])], [np.array([1])], Categories())
    assert coco_array_to_results(array) == [
        {"image_id": 3, "category_id": 11, "bbox": [1.235, 2.0, 10.753, 5.5], "score": 0.12346}
    ]
