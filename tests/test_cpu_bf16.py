"""Strided depthwise convolutions in float32 under CPU bf16 autocast (ssd_lightning.models.cpu_bf16)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from ssd_lightning.data.synthetic import SyntheticDetectionDataModule
from ssd_lightning.models import ssd300
from ssd_lightning.models.cpu_bf16 import Float32Conv2d, run_strided_depthwise_in_float32
from ssd_lightning.models.mobilenetv2 import mobilenet_v2
from ssd_lightning.modules.ssd import SSDLitModule
from tests.helpers import quiet_trainer


def _strided_depthwise(net: nn.Module) -> list[str]:
    return [
        name
        for name, m in net.named_modules()
        if isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1 and max(m.stride) > 1
    ]


def test_swaps_exactly_the_strided_depthwise_layers_and_keeps_the_weights():
    torch.manual_seed(0)
    net = ssd300(backbone="mobilenet_v2", num_classes=5, width_mult=0.5)
    names = _strided_depthwise(net)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    # SSD's MobileNetV2 keeps the stride-2 blocks 2, 4 and 7 (block 14's depthwise is cut off)
    assert run_strided_depthwise_in_float32(net) == len(names) == 3
    swapped = [n for n, m in net.named_modules() if isinstance(m, Float32Conv2d)]
    assert swapped == names
    after = net.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert run_strided_depthwise_in_float32(net) == 0  # idempotent
    assert run_strided_depthwise_in_float32(mobilenet_v2(num_classes=4)) == 4
    assert run_strided_depthwise_in_float32(ssd300(backbone="resnet18", num_classes=5)) == 0


def test_under_cpu_autocast_the_swapped_layers_compute_in_float32():
    """Inside bf16 autocast a swapped layer returns float32 equal to the float32 convolution of its input;
    the network's outputs stay within bf16 rounding of the unswapped network's."""
    torch.manual_seed(0)
    net = ssd300(backbone="mobilenet_v2", num_classes=5, width_mult=0.5).eval()
    x = torch.randn(2, 3, 300, 300)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_locs, ref_logits = net(x)
    run_strided_depthwise_in_float32(net)
    seen = []

    def record(module, inputs, output):
        with torch.autocast("cpu", enabled=False):  # the hook runs inside the caller's autocast
            expected = torch.nn.functional.conv2d(
                inputs[0].float(), module.weight, module.bias, module.stride, module.padding, module.dilation,
                module.groups,
            )  # fmt: skip
        seen.append((output.dtype, torch.equal(output, expected)))

    for m in net.modules():
        if isinstance(m, Float32Conv2d):
            m.register_forward_hook(record)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        locs, logits = net(x)
    assert seen == [(torch.float32, True)] * 3
    assert not torch.equal(locs, ref_locs)  # the layers did change precision
    torch.testing.assert_close(locs.float(), ref_locs.float(), atol=0.15, rtol=0.05)
    torch.testing.assert_close(logits.float(), ref_logits.float(), atol=0.15, rtol=0.05)


@pytest.mark.parametrize(("precision", "expected"), [("bf16-mixed", 3), ("32-true", 0)])
def test_the_lightning_module_swaps_on_cpu_bf16_only(precision, expected, tmp_path):
    """Through Trainer.fit: bf16-mixed on CPU swaps (the EMA copy too), 32-true leaves the network alone."""
    torch.manual_seed(0)
    module = SSDLitModule(
        ssd300(backbone="mobilenet_v2", num_classes=5, width_mult=0.5),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        lr_scaling={"rule": "none"},
        scheduler={"name": "cosine", "warmup_steps": 1},
        ema_decay=0.9,
    )
    data = SyntheticDetectionDataModule(batch_size=2, num_classes=5, steps_per_epoch=2)
    trainer = quiet_trainer(tmp_path, precision=precision, max_epochs=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    for net in (module.net, module.ema.module):
        assert sum(isinstance(m, Float32Conv2d) for m in net.modules()) == expected
    assert torch.isfinite(torch.stack([p.detach().sum() for p in module.net.parameters()])).all()
