"""MobileNetV2 (Sandler et al., 2018) as a classifier and as an SSD300 backbone, built on torchvision.

:func:`mobilenet_v2` is torchvision's (state dict key for key), arguments checked;
:class:`MobileNetV2SSDBackbone` cuts one into two feature taps. Weight files are read in ``modules/nets.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from torch import Tensor, nn
from torchvision.models import MobileNet_V2_Weights, MobileNetV2
from torchvision.models.mobilenetv2 import InvertedResidual

from ssd_lightning.models._loading import load_state_dict_strict
from ssd_lightning.models.backbones import SSDBackbone, register_backbone

__all__ = ["DEFAULT_INVERTED_RESIDUAL_SETTING", "MobileNetV2SSDBackbone", "load_mobilenet_v2_state_dict",
           "mobilenet_v2", "resolve_weights"]  # fmt: skip

log = logging.getLogger(__name__)

#: The paper's inverted residual table, one row per stage: expansion t, output channels c, repeats n,
#: stride s of the first block. Channels are multiplied by ``width_mult`` and rounded to ``round_nearest``.
DEFAULT_INVERTED_RESIDUAL_SETTING: list[list[int]] = [
    [1, 16, 1, 1],
    [6, 24, 2, 2],
    [6, 32, 3, 2],
    [6, 64, 4, 2],
    [6, 96, 3, 1],
    [6, 160, 3, 2],
    [6, 320, 1, 1],
]

_CLASSIFIER_KEYS = ("classifier.1.weight", "classifier.1.bias")


def _is_list(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _validate_setting(setting: object) -> list[list[int]]:
    """Check an inverted residual table and return it as a list of 4-int lists."""
    name = "inverted_residual_setting"
    if not _is_list(setting):
        raise ValueError(f"{name} must be a list of [t, c, n, s] rows, got {type(setting).__name__}")
    if not setting:
        raise ValueError(f"{name} must not be empty; give at least one [t, c, n, s] row")
    rows = [list(row) if _is_list(row) else row for row in setting]
    for i, row in enumerate(rows):
        ints = isinstance(row, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in row)
        if not ints or len(row) != 4:
            raise ValueError(f"{name}[{i}] must be a [t, c, n, s] list of 4 ints, got {row!r}")
        if min(row[:3]) < 1:
            raise ValueError(f"{name}[{i}] = {row}: expansion t, channels c and repeats n must be positive")
        if row[3] not in (1, 2):
            raise ValueError(f"{name}[{i}] = {row}: stride s must be 1 or 2, got {row[3]}")
    return rows


def resolve_weights(weights: str | MobileNet_V2_Weights | None) -> MobileNet_V2_Weights | None:
    """A torchvision weights name (``"IMAGENET1K_V1"``, ``"DEFAULT"``, ...) as its enum member."""
    if weights is None or isinstance(weights, MobileNet_V2_Weights):
        return weights
    try:
        return MobileNet_V2_Weights.verify(weights)
    except (KeyError, TypeError, ValueError):
        names = [w.name for w in MobileNet_V2_Weights] + ["DEFAULT"]
        raise ValueError(
            f"weights={weights!r} is not a MobileNetV2 weights name of torchvision; "
            f"expected one of {names} or None (use pretrained_path= for a local file)"
        ) from None


def load_mobilenet_v2_state_dict(
    model: MobileNetV2, state_dict: Mapping[str, Tensor], *, source: str = "state dict"
) -> None:
    """Load ``state_dict`` strictly (ValueError), but for a classifier of another class count (kept)."""
    own = model.state_dict()[_CLASSIFIER_KEYS[0]]
    head_w = state_dict.get(_CLASSIFIER_KEYS[0])
    skip: tuple[str, ...] = ()
    if head_w is not None and own.shape != head_w.shape and head_w.shape[1:] == own.shape[1:]:
        log.info(
            "%s has a %d-class classifier, the model %d classes: loading everything but the classifier",
            source, head_w.shape[0], own.shape[0],
        )  # fmt: skip
        skip = _CLASSIFIER_KEYS
    hint = "Check width_mult / inverted_residual_setting"
    load_state_dict_strict(model, state_dict, source=source, target="this MobileNetV2", hint=hint, skip=skip)


def mobilenet_v2(
    *,
    num_classes: int = 1000,
    width_mult: float = 1.0,
    inverted_residual_setting: Sequence[Sequence[int]] | None = None,
    round_nearest: int = 8,
    dropout: float = 0.2,
    weights: str | MobileNet_V2_Weights | None = None,
) -> MobileNetV2:
    """Torchvision's MobileNetV2, arguments checked: (N, 3, H, W) -> (N, num_classes) logits. ``width_mult``
    multiplies every layer's channels (the last never below 1280), rounded to ``round_nearest``;
    ``inverted_residual_setting``: ``[t, c, n, s]`` rows (``None``: the paper's); ``weights``: torchvision
    ImageNet weights name (width 1.0 and the default table only)."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if width_mult <= 0:
        raise ValueError(f"width_mult must be > 0, got {width_mult}")
    if round_nearest < 1:
        raise ValueError(f"round_nearest must be >= 1, got {round_nearest}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    setting = None if inverted_residual_setting is None else _validate_setting(inverted_residual_setting)
    resolved = resolve_weights(weights)
    default = (
        width_mult == 1.0 and round_nearest == 8 and setting in (None, DEFAULT_INVERTED_RESIDUAL_SETTING)
    )
    if resolved is not None and not default:
        raise ValueError(
            f"weights={resolved.name} exist only for width_mult=1.0, round_nearest=8 and the default "
            f"inverted_residual_setting (got width_mult={width_mult}, round_nearest={round_nearest})"
        )
    args = {
        "num_classes": int(num_classes),
        "width_mult": float(width_mult),
        "inverted_residual_setting": setting,
        "round_nearest": int(round_nearest),
        "dropout": float(dropout),
    }
    model = MobileNetV2(**args)
    if resolved is not None:
        state = resolved.get_state_dict(progress=True, check_hash=True)
        load_mobilenet_v2_state_dict(model, state, source=f"torchvision weights {resolved.name}")
    model.architecture = {"builder": "mobilenet_v2", "args": args}  # rebuilds it (models/registry.py)
    return model


class MobileNetV2SSDBackbone(nn.Module):
    """MobileNetV2 features as an SSD300 backbone with two taps at strides 8 and 16.

    The taps are the expansion layers (1×1 conv + BN + ReLU6) of ``features[7]`` (192 channels at 38×38 for
    300×300 and width 1.0) and ``features[14]`` (576 at 19×19), as torchvision's SSDLite taps; later layers
    are dropped. ``classifier``: cut this MobileNetV2 instead of building one (weights load before the cut).
    """

    def __init__(
        self,
        *,
        width_mult: float = 1.0,
        weights: str | MobileNet_V2_Weights | None = None,
        classifier: MobileNetV2 | None = None,
    ) -> None:
        super().__init__()
        net = classifier if classifier is not None else mobilenet_v2(width_mult=width_mult, weights=weights)
        features = net.features
        tap1, tap2 = features[7], features[14]
        if tap1.use_res_connect or tap2.use_res_connect or len(tap1.conv) != 4 or len(tap2.conv) != 4:
            raise ValueError("features[7] and features[14] must be expanding stride-2 blocks")
        self.stage1 = nn.Sequential(*features[:7], tap1.conv[0])
        self.stage2 = nn.Sequential(*tap1.conv[1:], *features[8:14], tap2.conv[0])
        self.out_channels: list[int] = [tap1.conv[0].out_channels, tap2.conv[0].out_channels]

    def forward(self, images: Tensor) -> list[Tensor]:
        """(N, 3, H, W) -> [(N, C1, ⌈H/8⌉, ⌈W/8⌉), (N, C2, ⌈H/16⌉, ⌈W/16⌉)]."""
        x1 = self.stage1(images)
        return [x1, self.stage2(x1)]

    def stages(self) -> list[list[nn.Module]]:
        """For ``model.freeze``: stem + first block, stride-4 blocks, stride-8 blocks + first tap, rest."""
        first = list(self.stage1)
        return [first[:2], first[2:4], first[4:], list(self.stage2)]


def zero_init_inverted_residuals(module: nn.Module) -> int:
    """Zero the last BatchNorm scale of every residual ``InvertedResidual`` (identity at start); how many."""
    norms = [b.conv[-1] for b in module.modules() if isinstance(b, InvertedResidual) and b.use_res_connect]
    for norm in norms:
        nn.init.zeros_(norm.weight)
    return len(norms)


register_backbone(
    "mobilenet_v2",
    SSDBackbone(
        build=MobileNetV2SSDBackbone,  # (weights=, width_mult=)
        level_channels=(-1, -1, 512, 256, 256, 256),  # levels 0-1 come from the backbone
        zero_init=zero_init_inverted_residuals,
        width=True,
    ),
)
