"""The shared optimisation rules: LR scaling, weight-decay groups, per-iteration schedules."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from ssd_lightning.optim import build_optimizer, build_scheduler, lr_factor, param_groups, scale_lr


@pytest.mark.parametrize(
    ("world_size", "batch_size", "expected"),
    [(1, 32, 2.6e-3), (8, 64, 2.6e-3 * 16), (2, 8, 2.6e-3 * 0.5), (4, 256, 2.6e-3 * 32)],
)
def test_linear_rule_is_the_reference_formula(world_size, batch_size, expected):
    lr = scale_lr(
        2.6e-3, rule="linear", world_size=world_size, batch_size=batch_size, reference_batch_size=32
    )
    assert lr == pytest.approx(expected)


def test_sqrt_and_none_rules():
    assert scale_lr(0.1, rule="sqrt", world_size=4, batch_size=32, reference_batch_size=32) == pytest.approx(
        0.2
    )
    assert scale_lr(0.1, rule="none", world_size=8, batch_size=256) == 0.1


def test_unknown_rule_and_bad_sizes_are_named():
    with pytest.raises(ValueError, match="lr_scaling.rule"):
        scale_lr(0.1, rule="quadratic", batch_size=32)
    with pytest.raises(ValueError, match="batch_size=0"):
        scale_lr(0.1, batch_size=0)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, bias=False)  # weight: decay
        self.bn = nn.BatchNorm2d(8)  # weight + bias: norm
        self.dw = nn.Conv2d(8, 8, 3, groups=8)  # weight: depthwise, bias: bias
        self.fc = nn.Linear(8, 2)  # weight: decay, bias: bias
        self.frozen = nn.Linear(2, 2)
        for p in self.frozen.parameters():
            p.requires_grad_(False)


def _ids(group):
    return {id(p) for p in group["params"]}


def test_no_decay_on_batchnorm_and_biases():
    net = _Tiny()
    groups = {g["name"]: g for g in param_groups(net, 5e-4)}
    assert _ids(groups["norm"]) == {id(net.bn.weight), id(net.bn.bias)}
    assert _ids(groups["bias"]) == {id(net.dw.bias), id(net.fc.bias)}
    assert _ids(groups["other"]) == {id(net.conv.weight), id(net.fc.weight)}
    # depthwise weights decay like any weight unless asked otherwise
    assert groups["depthwise"]["weight_decay"] == 5e-4 and _ids(groups["depthwise"]) == {id(net.dw.weight)}
    assert groups["norm"]["weight_decay"] == 0.0 and groups["bias"]["weight_decay"] == 0.0
    assert groups["other"]["weight_decay"] == 5e-4
    every = set().union(*(_ids(g) for g in groups.values()))
    assert id(net.frozen.weight) not in every  # frozen parameters are left out
    assert len(every) == 7


def test_depthwise_decay_option_and_optimizer():
    net = _Tiny()
    sgd = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.9, weight_decay=5e-4)
    opt = build_optimizer(sgd, net, lr=0.02, weight_decay=5e-4, depthwise_weight_decay=0.0)
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"norm": 0.0, "bias": 0.0, "depthwise": 0.0, "other": 5e-4}
    assert all(g["lr"] == 0.02 and g["momentum"] == 0.9 for g in opt.param_groups)


def test_warmup_then_multistep_known_values():
    kw = {
        "schedule": "multistep",
        "steps_per_epoch": 10,
        "total_steps": 100,
        "warmup_steps": 4,
        "milestones": (3, 6),
        "gamma": 0.1,
    }
    assert [lr_factor(s, **kw) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lr_factor(29, **kw) == 1.0
    assert lr_factor(30, **kw) == pytest.approx(0.1)
    assert lr_factor(60, **kw) == pytest.approx(0.01)


def test_step_and_cosine_known_values():
    step = {"schedule": "step", "steps_per_epoch": 5, "total_steps": 50, "gamma": 0.98, "step_size": 1}
    assert lr_factor(12, **step) == pytest.approx(0.98**2)
    cos = {"schedule": "cosine", "steps_per_epoch": 5, "total_steps": 50, "warmup_steps": 10}
    assert lr_factor(10, **cos) == 1.0
    assert lr_factor(30, **cos) == pytest.approx(0.5)
    assert lr_factor(50, **cos) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(30, min_factor=0.1, **cos) == pytest.approx(0.1 + 0.9 * 0.5)


def test_scheduler_steps_per_iteration_and_warmup_epochs():
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.4)
    sched = build_scheduler(opt, schedule="cosine", steps_per_epoch=4, max_epochs=3, warmup_epochs=0.5)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == pytest.approx([0.0, 0.2, 0.4])  # 2 warm-up iterations
    assert lrs[7] == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="scheduler.name"):
        lr_factor(0, schedule="poly", steps_per_epoch=1, total_steps=1)
