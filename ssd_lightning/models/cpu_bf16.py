"""bf16 on CPUs: whether this CPU runs it fast, and strided depthwise convolutions kept in float32 under it.

:func:`cpu_has_native_bf16` is the one rule training (``cpu_bf16=auto``) and predict (``dtype=auto``)
use to choose bf16 or float32.

On CPUs, oneDNN's bfloat16 kernels for stride-2 depthwise convolutions (MobileNetV2 has four) are much
slower than its float32 ones, backward above all: 2-6x for one layer, about 10 % of a whole SSD300-MobileNetV2
training step (docs/benchmarks.md). The swap changes the class of the layers only: parameters, state_dict
keys and checkpoints stay as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["Float32Conv2d", "cpu_has_native_bf16", "run_strided_depthwise_in_float32"]


class Float32Conv2d(nn.Conv2d):
    """:class:`torch.nn.Conv2d` that runs outside autocast, in its weight's dtype (float32 under mixed
    precision, so the output is float32 there)."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Conv2d's own argument name)
        with torch.autocast(device_type=input.device.type, enabled=False):
            return super().forward(input.to(self.weight.dtype))


def run_strided_depthwise_in_float32(net: nn.Module) -> int:
    """Make every strided depthwise ``nn.Conv2d`` of ``net`` a :class:`Float32Conv2d` (in place); returns
    how many (0 for networks without them, e.g. ResNets)."""
    layers = [
        m
        for m in net.modules()
        if type(m) is nn.Conv2d and m.groups == m.in_channels > 1 and max(m.stride) > 1
    ]
    for layer in layers:
        layer.__class__ = Float32Conv2d
    return len(layers)


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 convolutions on this CPU with its own kernels: AVX-512 and up on x86 (AVX512 /
    AVX512-BF16 / AMX), SVE on Arm.

    Without them (AVX2-only CPUs) bf16 autocast measured 10-15x slower than float32. On x86 this public
    capability agrees with torch's private ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` (tests compare).
    """
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "SVE"))
