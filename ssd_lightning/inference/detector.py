"""One detector: a trained SSD300 (Lightning checkpoint, NVIDIA weights) or an end-to-end ONNX export.

:meth:`Detector.detect` maps preprocessed images to detections in original pixels, with the decode of
validation (:meth:`ssd_lightning.models.BoxCoder.detect`) or the exported graph.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.errors import ConfigError
from ssd_lightning.inference.onnx_format import END_TO_END_OUTPUTS, METADATA_KEYS, read_metadata
from ssd_lightning.io.model_record import model_weights, read_model_record
from ssd_lightning.io.run_config import update_moved_targets
from ssd_lightning.io.weights import CheckpointReadError, read_checkpoint, read_nvidia_state_dict
from ssd_lightning.models import (
    BoxCoder,
    DecoderSettings,
    build_network,
    dboxes300_coco,
    nvidia_state_dict,
    ssd300,
)
from ssd_lightning.models.boxes import scale_to_pixels
from ssd_lightning.models.cpu_bf16 import cpu_has_native_bf16, run_strided_depthwise_in_float32

__all__ = [
    "Detector",
    "detector_from_onnx",
    "load_detector",
    "load_nvidia_checkpoint",
    "open_onnx",
    "resolve_dtype",
]

log = logging.getLogger(__name__)


def load_nvidia_checkpoint(
    path_or_dict: str | os.PathLike | Mapping[str, object],
    *,
    backbone: str = "resnet50",
    num_classes: int = 81,
    trust_checkpoint: bool = False,
) -> dict[str, Tensor]:
    """An NVIDIA SSD300 checkpoint (file or loaded; ``main.py --save``, torch.hub) as a state dict that
    ``ssd300(backbone=..., num_classes=...).load_state_dict(..., strict=True)`` takes; ValueError when it is
    not a checkpoint dict or does not fit (and :func:`~ssd_lightning.io.weights.read_checkpoint`'s errors)."""
    is_file = isinstance(path_or_dict, (str, os.PathLike))
    source = f"nvidia_checkpoint={path_or_dict}" if is_file else "checkpoint"
    state = read_nvidia_state_dict(path_or_dict, trust_checkpoint=trust_checkpoint)
    return nvidia_state_dict(state, backbone=backbone, num_classes=num_classes, source=source)


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: str | int, device: str | torch.device) -> tuple[str, str]:
    """``(fp32 | bf16 | fp16, why)`` for ``dtype`` (``auto``, ``32``/``fp32``, ``bf16``, ``16``/``fp16``)
    on ``device``. ``auto`` is what training validates with: fp16 on CUDA, bf16 on CPUs with native bf16
    kernels (train.py's rule), else fp32."""
    name = {"32": "fp32", "16": "fp16"}.get(str(dtype), str(dtype))
    if name not in ("auto", "fp32", *_AUTOCAST):
        raise ConfigError(f"dtype={dtype}: expected auto, 32 (fp32), bf16 or 16 (fp16)")
    if name != "auto":
        return name, "asked for"
    if torch.device(device).type == "cuda":
        return "fp16", "auto: CUDA"
    if cpu_has_native_bf16():
        return "bf16", "auto: this CPU has native bf16 kernels"
    capability = torch.backends.cpu.get_cpu_capability()
    return "fp32", f"auto: this CPU has no native bf16 kernels ({capability}), where bf16 is 10-15x slower"


@dataclass
class Detector:
    """A network (images -> ``(locs (N, 4, 8732), logits (N, C, 8732))``) or an onnxruntime ``session`` of
    an end-to-end export, with its ``categories`` (``[0]`` = background) and decoder ``settings``. ``dtype``
    ``bf16``/``fp16``: autocast in channels_last, as training validates (strided depthwise convolutions
    stay fp32 on a CPU)."""

    categories: CategoryMap
    settings: DecoderSettings = field(default_factory=DecoderSettings)
    net: nn.Module | None = None
    session: Any = None
    source: str = ""
    image_size: int = 300
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if (self.net is None) == (self.session is None):
            raise ValueError("a Detector runs either a net or an onnxruntime session")
        self.box_coder = BoxCoder(dboxes300_coco())
        if self.net is not None and self.dtype in _AUTOCAST:
            self.net.to(memory_format=torch.channels_last)
            if self.device.type == "cpu":
                run_strided_depthwise_in_float32(self.net)

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.categories.names

    @property
    def category_ids(self) -> tuple[int, ...]:
        return self.categories.category_ids

    @property
    def runs_on(self) -> str:
        return f"onnxruntime {self.session.get_providers()[0]}" if self.session else str(self.device)

    @torch.inference_mode()
    def detect(self, images: Tensor, sizes: Sequence[tuple[int, int]]) -> list[dict[str, Tensor]]:
        """``images`` (N, 3, S, S) from :func:`~ssd_lightning.inference.predict.preprocess`, ``sizes`` their
        original ``(height, width)`` -> per image ``boxes`` (k, 4) ltrb in original pixels (not clipped, as
        in validation; an ONNX export's clipped), ``scores`` (k,), ``labels`` (k,) in 1..C-1, best first."""
        if self.session is None:
            images = images.to(self.device)
            if self.dtype in _AUTOCAST:
                with torch.autocast(self.device.type, dtype=_AUTOCAST[self.dtype]):
                    locs, logits = self.net(images.contiguous(memory_format=torch.channels_last))
                locs, logits = locs.float(), logits.float()
            else:
                locs, logits = self.net(images)
            return self.box_coder.detect(locs, logits, sizes, self.settings)
        *outputs, counts = self.session.run(
            list(END_TO_END_OUTPUTS), {"images": images.float().cpu().numpy()}
        )
        keys = END_TO_END_OUTPUTS[:3]
        detections = [
            {key: torch.from_numpy(value[i, : int(n)]) for key, value in zip(keys, outputs, strict=True)}
            for i, n in enumerate(counts)
        ]
        return scale_to_pixels(detections, sizes)


def _numbered(num_classes: int) -> CategoryMap:
    return CategoryMap.from_names([f"class_{k}" for k in range(1, num_classes)])


def _load_run_config(config_path: Path):
    """The run's composed config (unresolved), ``paths`` set from ``.hydra/hydra.yaml`` (the ``hydra:``
    resolver knows nothing of that run here; the keys read use no project resolver)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config_path)
    update_moved_targets(cfg)
    hydra_file = config_path.parent / "hydra.yaml"
    runtime = OmegaConf.load(hydra_file).hydra.runtime if hydra_file.is_file() else None
    if "paths" in cfg:
        if runtime is not None and "cwd" in runtime:
            cfg.paths.root_dir = runtime.cwd
        cfg.paths.output_dir = str(config_path.parent.parent)
    return cfg


def _categories_from_run(cfg, num_classes: int) -> CategoryMap:
    """Names and category ids from the run's annotation file; ``class_<k>`` if it is not readable."""
    from omegaconf import OmegaConf

    root = OmegaConf.select(cfg, "data.root", throw_on_resolution_failure=False)
    candidates = []
    for split in ("val", "train"):
        if value := OmegaConf.select(cfg, f"data.{split}_annotations", throw_on_resolution_failure=False):
            candidates.append(Path(str(value)))
        elif root:
            candidates.append(Path(str(root)) / f"annotations/instances_{split}2017.json")
    for path in filter(Path.is_file, candidates):
        try:
            cmap = CategoryMap.from_coco(path)
        except (ValueError, OSError) as e:
            log.warning("could not read class names from %s: %s", path, e)
            continue
        if cmap.num_classes == num_classes:
            return cmap
        log.warning(
            "%s has %d classes but the network %d; not using its names", path, cmap.num_classes, num_classes
        )
    log.warning(
        "no annotation file of the run found (looked at %s); classes are named class_<k>",
        ", ".join(map(str, candidates)) or "nothing: the run config has no data.root",
    )
    return _numbered(num_classes)


def _from_checkpoint(
    ckpt: Path, run_config: str | os.PathLike | None, trust_checkpoint: bool
) -> tuple[nn.Module, CategoryMap, Mapping, int]:
    """(network with weights, categories, saved decoder settings, input size) from the checkpoint's model
    record, or (no record, or ``run_config`` given) from the run's config."""
    checkpoint = read_checkpoint(ckpt, trust_checkpoint=trust_checkpoint, what="ckpt_path")
    source = f"ckpt_path={ckpt}"
    record = read_model_record(checkpoint, source=source)
    if record is not None and run_config is None:
        if record["kind"] != "detector":
            raise CheckpointReadError(
                f"{source} is a {record['kind']} ({record['architecture']['builder']}), not a detector: "
                "predict.py and scripts/export_onnx.py take it as it is"
            )
        net = build_network(record["architecture"])
        _load_weights(net, checkpoint, record["weights"], ckpt)
        classes = CategoryMap(tuple(record["classes"]["category_ids"]), tuple(record["classes"]["names"]))
        return net, classes, record.get("decoder") or {}, int(record["input"]["image_size"])
    config_path = Path(run_config or ckpt.resolve().parents[1] / ".hydra/config.yaml")  # <run>/checkpoints/x
    if not config_path.is_file():
        raise CheckpointReadError(
            f"{source} records no model (written by an ssd_lightning before checkpoints did, or by another "
            f"project) and {config_path} is not there to rebuild it from: keep the checkpoint inside its run "
            "directory (<run>/checkpoints/*.ckpt) or pass run_config=<run>/.hydra/config.yaml"
        )
    import hydra

    cfg = _load_run_config(config_path)
    net_cfg = cfg.model.net.copy()
    if "weights_backbone" in net_cfg:
        net_cfg.weights_backbone = None  # the checkpoint has every weight; never download
    net = hydra.utils.instantiate(net_cfg)
    hparams = checkpoint.get("hyper_parameters") or {}
    # before model records: the run kept an EMA that is its weights when ema_decay is set and use_ema true
    with_ema = hparams.get("ema_decay") is not None and hparams.get("use_ema", True)
    _load_weights(net, checkpoint, "ema.module." if with_ema else "net.", ckpt)
    if getattr(net, "num_classes", None) is None:
        raise ValueError(f"{config_path}: model.net builds a network without `num_classes`; not an SSD300")
    return net, _categories_from_run(cfg, int(net.num_classes)), hparams.get("decoder") or {}, 300


def _load_weights(net: nn.Module, checkpoint: Mapping[str, Any], prefix: str, ckpt: Path) -> None:
    net.load_state_dict(model_weights(checkpoint, prefix, source=f"ckpt_path={ckpt}"), strict=True)
    if prefix != "net.":
        log.info("%s: the EMA weights (model.ema_decay with model.use_ema=true)", ckpt)


def open_onnx(path: Path, device: str | torch.device) -> tuple[Any, dict[str, Any]]:
    """An onnxruntime session of this project's export (``auto``: on CUDA when this onnxruntime has it) and
    its metadata (``kind`` defaults to detector)."""
    import onnxruntime as ort

    if not path.is_file():
        raise FileNotFoundError(f"onnx={path} does not exist")
    available, device = ort.get_available_providers(), str(device)
    if device.startswith("cuda") and "CUDAExecutionProvider" not in available:
        raise ValueError(
            f"device={device}: this onnxruntime has no CUDAExecutionProvider (it has "
            f"{', '.join(available)}); install onnxruntime-gpu or use device=cpu"
        )
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cpu" or (device == "auto" and "CUDAExecutionProvider" not in available):
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), providers=providers)
    meta = read_metadata(session.get_modelmeta().custom_metadata_map)
    meta.setdefault("kind", "detector")
    return session, meta


def detector_from_onnx(session: Any, meta: Mapping, path: Path, decoder: Mapping | None) -> Detector:
    """A :class:`Detector` running an end-to-end export (:func:`open_onnx`)."""
    outputs = tuple(o.name for o in session.get_outputs())
    if outputs != END_TO_END_OUTPUTS:
        raise ValueError(
            f"onnx={path} has outputs {', '.join(outputs)}, not {', '.join(END_TO_END_OUTPUTS)}: predict.py "
            "runs end-to-end exports; write one with `python scripts/export_onnx.py ckpt_path=... "
            "end_to_end=true`"
        )
    if missing := set(METADATA_KEYS) - set(meta):
        raise ValueError(
            f"onnx={path} lacks the metadata {sorted(missing)} that scripts/export_onnx.py end_to_end=true "
            "writes (class names, decoder settings); re-export it with that script"
        )
    settings = DecoderSettings.from_mapping(meta["decoder"])
    for key, value in dict(decoder or {}).items():
        if value is not None and settings.get(key) != value:
            raise ValueError(
                f"decoder.{key}={value}: the decoder of {path} is part of its graph ({key}="
                f"{settings.get(key)}); re-export with `scripts/export_onnx.py ... end_to_end=true "
                f"decoder.{key}={value}`"
            )
    categories = CategoryMap(tuple(meta["category_ids"]), tuple(meta["class_names"]))
    return Detector(
        categories, settings, session=session, source=str(path), image_size=int(meta["image_size"])
    )


def load_detector(
    ckpt_path: str | os.PathLike | None = None,
    *,
    nvidia_checkpoint: str | os.PathLike | None = None,
    onnx: str | os.PathLike | None = None,
    run_config: str | os.PathLike | None = None,
    backbone: str = "resnet50",
    num_classes: int = 81,
    decoder: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    trust_checkpoint: bool = False,
    dtype: str | int = "fp32",
) -> Detector:
    """A :class:`Detector` from exactly one source, ``eval()`` on ``device`` (``auto``: CUDA when there).

    * ``ckpt_path``: an ``SSDLitModule`` checkpoint, rebuilt from its model record; without one (or with
      ``run_config``) from the run's config (default ``<run>/.hydra/config.yaml``), names from the run's
      annotation file if still there (else ``class_<k>``), decoder from ``hyper_parameters``.
    * ``nvidia_checkpoint``: ``ssd300(backbone, num_classes)`` with NVIDIA's weights (COCO names at 81).
    * ``onnx``: an end-to-end export run with onnxruntime; names, ids and decoder from its metadata.

    ``decoder`` overrides the decoder settings (``None`` ignored; ONNX: ValueError unless the same).
    ``trust_checkpoint=True`` unpickles fully (can run code) instead of ``weights_only``.
    """
    if sum(x is not None for x in (ckpt_path, nvidia_checkpoint, onnx)) != 1:
        raise ValueError(
            "give exactly one of ckpt_path=<Lightning .ckpt>, nvidia_checkpoint=<NVIDIA .pt> or onnx=<.onnx>"
        )
    if onnx is not None:
        session, meta = open_onnx(Path(onnx), device)
        if meta["kind"] != "detector":
            raise ValueError(f"onnx={onnx} is a {meta['kind']} export, not a detector")
        return detector_from_onnx(session, meta, Path(onnx), decoder)
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if nvidia_checkpoint is not None:
        net = ssd300(backbone=backbone, num_classes=num_classes)
        kwargs = {"backbone": backbone, "num_classes": num_classes, "trust_checkpoint": trust_checkpoint}
        net.load_state_dict(load_nvidia_checkpoint(nvidia_checkpoint, **kwargs))
        coco = CategoryMap.coco()
        categories = coco if num_classes == coco.num_classes else _numbered(num_classes)
        saved, image_size = {}, 300
    else:
        net, categories, saved, image_size = _from_checkpoint(Path(ckpt_path), run_config, trust_checkpoint)
    settings = DecoderSettings.from_mapping(decoder, base=DecoderSettings.from_mapping(saved))
    source = str(ckpt_path if nvidia_checkpoint is None else nvidia_checkpoint)
    net, dtype = net.eval().to(device), resolve_dtype(dtype, device)[0]
    return Detector(categories, settings, net, source=source, image_size=image_size, dtype=dtype)
