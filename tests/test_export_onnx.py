"""ONNX export: onnxruntime gives PyTorch's outputs at any batch size, and the same decoded detections."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssd_lightning.inference.export import export_network
from ssd_lightning.models import BoxCoder, dboxes300_coco, ssd300
from tests.helpers import REPO_ROOT, compose_config, run_script

EXPORT_ONNX = REPO_ROOT / "scripts" / "export_onnx.py"

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    net = ssd300(backbone="resnet18", num_classes=5).eval()
    path = export_network(net, tmp_path_factory.mktemp("onnx") / "model.onnx")
    return net, path


@pytest.mark.parametrize("batch_size", [1, 3])
def test_onnxruntime_matches_pytorch_and_decodes_the_same(exported, batch_size):
    net, path = exported
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    assert [o.name for o in session.get_outputs()] == ["locs", "logits"]
    images = torch.randn(batch_size, 3, 300, 300, generator=torch.Generator().manual_seed(batch_size))
    with torch.no_grad():
        locs, logits = net(images)
    ort_locs, ort_logits = session.run(["locs", "logits"], {"images": images.numpy()})
    assert ort_locs.shape == (batch_size, 4, 8732) and ort_logits.shape == (batch_size, 5, 8732)
    assert np.abs(ort_locs - locs.numpy()).max() <= 1e-4
    assert np.abs(ort_logits - logits.numpy()).max() <= 1e-4
    coder = BoxCoder(dboxes300_coco())
    ours = coder.decode(locs, logits, max_detections=50)
    theirs = coder.decode(torch.from_numpy(ort_locs), torch.from_numpy(ort_logits), max_detections=50)
    for a, b in zip(ours, theirs, strict=True):
        assert len(a["scores"]) > 0
        assert torch.equal(a["labels"], b["labels"])
        torch.testing.assert_close(a["boxes"], b["boxes"], atol=1e-4, rtol=0)
        torch.testing.assert_close(a["scores"], b["scores"], atol=1e-5, rtol=0)


def test_cli_exports_a_run_checkpoint(tmp_path):
    """export_onnx.py with a Lightning checkpoint next to its run config (the layout train.py writes)."""
    from omegaconf import OmegaConf, open_dict

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    cfg = compose_config(["experiment=demo", "model.net.backbone=resnet18", f"data.root={tmp_path / 'none'}"])
    with open_dict(cfg):
        del cfg["hydra"]
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    net = ssd300(backbone="resnet18", num_classes=5)
    torch.save(
        {"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}},
        run / "checkpoints" / "last.ckpt",
    )
    result = run_script(
        EXPORT_ONNX, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"output={tmp_path / 'm.onnx'}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "m.onnx").is_file()
    assert "class_1, class_2, class_3, class_4" in result.stdout  # no annotation file: class_<k>
    diff = float(result.stdout.split("max |diff| = ")[1].split()[0])
    assert diff <= 1e-4
    bad = run_script(EXPORT_ONNX, "ckpt=x")
    assert bad.returncode == 2 and "ckpt_path" in bad.stderr


def test_cli_end_to_end_export_checks_itself_against_the_decoder(tmp_path):
    """end_to_end=true with a decoder override: the script's own check (onnxruntime vs BoxCoder.decode)."""
    torch.manual_seed(1)
    net = ssd300(backbone="resnet18", num_classes=5)
    checkpoint = tmp_path / "nvidia.pt"  # the NVIDIA layout needs no run directory
    torch.save({"model": net.state_dict()}, checkpoint)
    output = tmp_path / "e2e.onnx"
    result = run_script(
        EXPORT_ONNX,
        f"nvidia_checkpoint={checkpoint}",
        "backbone=resnet18",
        "num_classes=5",
        "end_to_end=true",
        "decoder.max_detections=40",
        f"output={output}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'max_detections': 40" in result.stdout
    diff = float(result.stdout.split("same detections, max |diff| = ")[1].split()[0])
    assert diff <= 1e-4
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].shape[1:] == [40, 4]
    for args, message in (
        (["decoder.max_detections=40"], "end_to_end=true exports only"),
        (["end_to_end=true", "decoder.iou=0.4"], "unknown decoder key(s) ['iou']"),
    ):
        bad = run_script(EXPORT_ONNX, f"nvidia_checkpoint={checkpoint}", *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr[-2000:]
