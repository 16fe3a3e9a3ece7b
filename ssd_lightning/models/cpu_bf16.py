"""bf16 on CPUs: whether this CPU runs it fast, and strided depthwise convolutions kept in float32 under it.

:func:`cpu_has_native_bf16` is the one rule of training (``cpu_bf16=auto``) and predict (``dtype=auto``).
oneDNN's bf16 stride-2 depthwise convolutions are 2-6x slower than float32 (about 10 % of an
SSD300-MobileNetV2 step, docs/benchmarks.md); the swap changes the layers' class only, not checkpoints.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["Float32Conv2d", "cpu_has_native_bf16", "run_strided_depthwise_in_float32"]


class Float32Conv2d(nn.Conv2d):
    """:class:`torch.nn.Conv2d` run outside autocast, in its weight's dtype (float32 under AMP)."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Conv2d's own argument name)
        with torch.autocast(device_type=input.device.type, enabled=False):
            return super().forward(input.to(self.weight.dtype))


def run_strided_depthwise_in_float32(net: nn.Module) -> int:
    """Make every strided depthwise ``nn.Conv2d`` of ``net`` a :class:`Float32Conv2d`; returns how many."""
    convs = [m for m in net.modules() if type(m) is nn.Conv2d]
    layers = [c for c in convs if c.groups == c.in_channels > 1 and max(c.stride) > 1]
    for layer in layers:
        layer.__class__ = Float32Conv2d
    return len(layers)


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has native bf16 convolution kernels here (AVX-512 and up, SVE); without them (AVX2)
    bf16 ran 10-15x slower. Agrees with torch's private ``_is_mkldnn_bf16_supported`` (tests compare)."""
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "SVE"))
