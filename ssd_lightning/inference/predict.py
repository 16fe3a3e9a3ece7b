"""Run a trained SSD300 on arbitrary images: load a checkpoint, preprocess, detect, write pictures + JSON.

Used by the root ``predict.py`` (``python predict.py ckpt_path=... input=... output=...``) and by
``scripts/export_onnx.py`` (:func:`load_detector`). An end-to-end ONNX export (``scripts/export_onnx.py
end_to_end=true``) runs through the same preprocessing and output code with :func:`load_onnx_detector`.

Preprocessing (:func:`preprocess`) is the validation transform of the datamodules, done with PIL and
torch instead of DALI: RGB, resize to 300×300 without keeping the aspect ratio (no letterbox), bilinear
(Pillow's antialiased resampling, as the NVIDIA reference's PIL validation path), then
``(pixel - 255 * mean) / (255 * std)`` with the ImageNet mean/std, NCHW float32. DALI's resize filter
differs from Pillow's in the last bits, so inputs match the DALI validation pipeline to about one grey
level, not bit for bit. EXIF orientation is applied, as DALI's decoder does. Detections come back in
pixels of the original image (ltrb), as ``SSDLitModule.validation_step`` returns them.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor, nn

from ssd_lightning.io.weights import read_checkpoint
from ssd_lightning.models import BoxCoder, dboxes300_coco, load_nvidia_checkpoint, ssd300

__all__ = [
    "COCO_CATEGORY_IDS",
    "COCO_CLASS_NAMES",
    "IMAGE_EXTENSIONS",
    "Detector",
    "OnnxDetector",
    "collect_inputs",
    "load_detector",
    "load_onnx_detector",
    "predict_images",
    "preprocess",
]

log = logging.getLogger(__name__)

# The 80 COCO detection categories, label k (1..80) at index k, "background" at 0: the order of the
# `categories` list in instances_val2017.json (= ascending category id), which is the NVIDIA reference's
# label order. The one place in the package that lists them.
COCO_CLASS_NAMES: tuple[str, ...] = (
    "background",
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard",
    "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase",
    "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
# COCO category id of label k at index k - 1 (ids 1..90 with gaps).
COCO_CATEGORY_IDS: tuple[int, ...] = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 27, 28, 31, 32,
    33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59,
    60, 61, 62, 63, 64, 65, 67, 70, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 84, 85, 86, 87, 88, 89, 90,
)  # fmt: skip

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
IMAGENET_MEAN_255 = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD_255 = (0.229 * 255, 0.224 * 255, 0.225 * 255)
DEFAULT_DECODER = {"score_thresh": 0.05, "nms_iou": 0.5, "topk_per_class": 200, "max_detections": 200}


@dataclass
class Detector:
    """A network with what is needed to turn its outputs into named detections.

    Attributes:
        net: maps (N, 3, 300, 300) float32 normalised images to ``(locs (N, 4, 8732), logits (N, C, 8732))``.
        class_names: name of label ``k`` at index ``k`` (``[0]`` = background); ``len == C``.
        category_ids: dataset category id of label ``k`` at index ``k - 1`` (for the COCO results).
        decoder: keyword arguments of :meth:`BoxCoder.decode`.
        source: where the weights came from (for messages).
    """

    net: nn.Module
    class_names: tuple[str, ...]
    category_ids: tuple[int, ...]
    decoder: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_DECODER))
    source: str = ""
    image_size: int = 300

    def __post_init__(self) -> None:
        self.box_coder = BoxCoder(dboxes300_coco())

    @torch.inference_mode()
    def detect(self, images: Tensor, sizes: Sequence[tuple[int, int]]) -> list[dict[str, Tensor]]:
        """Detections per image, boxes in original pixels.

        Args:
            images: (N, 3, 300, 300) float32 from :func:`preprocess`.
            sizes: original ``(height, width)`` of each image.

        Returns:
            per image ``boxes`` (k, 4) float32 ltrb in original-image pixels (not clipped, exactly as
            ``SSDLitModule.validation_step``), ``scores`` (k,), ``labels`` (k,) int64 in 1..C-1.
        """
        device = next(self.net.parameters()).device
        locs, logits = self.net(images.to(device))
        detections = self.box_coder.decode(locs.float(), logits.float(), **self.decoder)
        out = []
        for det, (height, width) in zip(detections, sizes, strict=True):
            scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=device)
            out.append({"boxes": det["boxes"] * scale, "scores": det["scores"], "labels": det["labels"]})
        return out


@dataclass
class OnnxDetector:
    """An end-to-end ONNX export (decoding and NMS in the graph) run with onnxruntime.

    Same interface as :class:`Detector` (``detect``, ``class_names``, ``category_ids``, ``decoder``,
    ``source``, ``image_size``), so :func:`predict_images` runs either. Built by :func:`load_onnx_detector`.
    """

    session: Any  # onnxruntime.InferenceSession
    class_names: tuple[str, ...]
    category_ids: tuple[int, ...]
    decoder: dict[str, Any]
    source: str = ""
    image_size: int = 300

    def detect(self, images: Tensor, sizes: Sequence[tuple[int, int]]) -> list[dict[str, Tensor]]:
        """As :meth:`Detector.detect`, except that boxes are clipped to the image (the graph clips them)."""
        boxes, scores, labels, counts = self.session.run(
            ["boxes", "scores", "labels", "num_detections"], {"images": images.float().cpu().numpy()}
        )
        out = []
        for i, (height, width) in enumerate(sizes):
            n = int(counts[i])
            scale = torch.tensor([width, height, width, height], dtype=torch.float32)
            out.append(
                {
                    "boxes": torch.from_numpy(boxes[i, :n]) * scale,
                    "scores": torch.from_numpy(scores[i, :n]),
                    "labels": torch.from_numpy(labels[i, :n]),
                }
            )
        return out


# ------------------------------------------------------------------------------------------ loading
def _run_config_path(ckpt_path: Path) -> Path:
    """``<run>/checkpoints/<name>.ckpt`` -> ``<run>/.hydra/config.yaml``."""
    return ckpt_path.resolve().parent.parent / ".hydra" / "config.yaml"


def _load_run_config(config_path: Path):
    """The run's composed config, with the ``${hydra:...}`` paths filled in from ``.hydra/hydra.yaml``."""
    from omegaconf import OmegaConf

    from ssd_lightning.cli.resolvers import register_resolvers

    register_resolvers()
    cfg = OmegaConf.load(config_path)
    hydra_file = config_path.parent / "hydra.yaml"
    runtime = OmegaConf.load(hydra_file).hydra.runtime if hydra_file.is_file() else None
    if "paths" in cfg:
        # outside the training process the `hydra:` resolver knows nothing about that run
        if runtime is not None and "cwd" in runtime:
            cfg.paths.root_dir = runtime.cwd
        cfg.paths.output_dir = str(config_path.parent.parent)
    return cfg


def _class_names_from_run(cfg, num_classes: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Names and category ids from the run's annotation file; ``class_<k>`` if it is not readable."""
    from omegaconf import OmegaConf

    from ssd_lightning.data.categories import CategoryMap

    candidates = []
    for key, default_rel in (
        ("val_annotations", "annotations/instances_val2017.json"),
        ("train_annotations", "annotations/instances_train2017.json"),
    ):
        value = OmegaConf.select(cfg, f"data.{key}", throw_on_resolution_failure=False)
        root = OmegaConf.select(cfg, "data.root", throw_on_resolution_failure=False)
        if value:
            candidates.append(Path(str(value)))
        elif root:
            candidates.append(Path(str(root)) / default_rel)
    for path in candidates:
        if not path.is_file():
            continue
        try:
            cmap = CategoryMap.from_coco(path)
        except (ValueError, OSError) as e:
            log.warning("could not read class names from %s: %s", path, e)
            continue
        if cmap.num_classes == num_classes:
            return cmap.names, cmap.category_ids
        log.warning(
            "%s has %d classes but the network %d; not using its names", path, cmap.num_classes, num_classes
        )
    log.warning(
        "no annotation file of the run found (looked at %s); classes are named class_<k>",
        ", ".join(map(str, candidates)) or "nothing: the run config has no data.root",
    )
    names = ("background", *(f"class_{k}" for k in range(1, num_classes)))
    return names, tuple(range(1, num_classes))


def load_detector(
    ckpt_path: str | os.PathLike | None = None,
    *,
    nvidia_checkpoint: str | os.PathLike | None = None,
    run_config: str | os.PathLike | None = None,
    backbone: str = "resnet50",
    num_classes: int = 81,
    decoder: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    trust_checkpoint: bool = False,
) -> Detector:
    """Build the network of a checkpoint, load its weights, find its class names; ``eval()`` mode.

    Exactly one source:

    * ``ckpt_path``: a Lightning checkpoint of ``SSDLitModule`` (e.g. ``<run>/checkpoints/last.ckpt``). It
      stores weights, not the architecture: the network is rebuilt from the run's composed config
      (``run_config``, default ``<run>/.hydra/config.yaml``) with ``hydra.utils.instantiate(cfg.model.net)``
      (backbone weights never downloaded), and the ``net.*`` entries of ``state_dict`` are loaded (strict).
      Class names and category ids come from the run's annotation file when it is still there, else
      ``class_<k>``. Decoder settings: the checkpoint's ``hyper_parameters["decoder"]``.
    * ``nvidia_checkpoint``: a checkpoint of the NVIDIA reference (``main.py --save`` or torch.hub),
      ``ssd300(backbone=backbone, num_classes=num_classes)``; COCO names and ids when ``num_classes == 81``.

    ``decoder`` overrides keys of the decoder settings (see :meth:`BoxCoder.decode`).

    Both are read with ``torch.load(weights_only=True)`` (tensors and plain values only; see
    :func:`ssd_lightning.io.weights.read_checkpoint`); ``trust_checkpoint=True`` unpickles them fully, which
    can run code from the file, so only for files from a source you trust.

    Raises:
        ValueError: none or both sources given; checkpoint without ``state_dict``/``net.*`` keys.
        FileNotFoundError: checkpoint or run config missing (the message says what to pass).
        UntrustedCheckpointError: the file holds more than tensors and plain values and
            ``trust_checkpoint`` is false; nothing from it has run.
    """
    if (ckpt_path is None) == (nvidia_checkpoint is None):
        raise ValueError("give exactly one of ckpt_path=<Lightning .ckpt> or nvidia_checkpoint=<NVIDIA .pt>")
    settings = dict(DEFAULT_DECODER)
    if nvidia_checkpoint is not None:
        net = ssd300(backbone=backbone, num_classes=num_classes)
        net.load_state_dict(
            load_nvidia_checkpoint(
                nvidia_checkpoint,
                backbone=backbone,
                num_classes=num_classes,
                trust_checkpoint=trust_checkpoint,
            )
        )
        if num_classes == len(COCO_CLASS_NAMES):
            names, ids = COCO_CLASS_NAMES, COCO_CATEGORY_IDS
        else:
            names = ("background", *(f"class_{k}" for k in range(1, num_classes)))
            ids = tuple(range(1, num_classes))
        source = str(nvidia_checkpoint)
    else:
        ckpt = Path(ckpt_path)
        if not ckpt.is_file():
            raise FileNotFoundError(f"ckpt_path={ckpt} does not exist")
        config_path = Path(run_config) if run_config is not None else _run_config_path(ckpt)
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{config_path} not found: a Lightning checkpoint holds weights only, the network is rebuilt "
                "from the run's .hydra/config.yaml. Keep the checkpoint inside its run directory "
                "(<run>/checkpoints/*.ckpt) or pass run_config=<run>/.hydra/config.yaml"
            )
        import hydra

        cfg = _load_run_config(config_path)
        net_cfg = cfg.model.net.copy()
        if "weights_backbone" in net_cfg:
            net_cfg.weights_backbone = None  # the checkpoint has every weight; never download
        net = hydra.utils.instantiate(net_cfg)
        checkpoint = read_checkpoint(ckpt, trust_checkpoint=trust_checkpoint, what="ckpt_path")
        state = checkpoint.get("state_dict") if isinstance(checkpoint, Mapping) else None
        if not isinstance(state, Mapping):
            raise ValueError(
                f"{ckpt} has no 'state_dict': not a Lightning checkpoint (NVIDIA: nvidia_checkpoint=)"
            )
        net_state = {k[len("net.") :]: v for k, v in state.items() if k.startswith("net.")}
        if not net_state:
            raise ValueError(f"{ckpt}: no 'net.*' weights in state_dict; is it an SSDLitModule checkpoint?")
        net.load_state_dict(net_state, strict=True)
        saved = (checkpoint.get("hyper_parameters") or {}).get("decoder") or {}
        settings.update(saved)
        if getattr(net, "num_classes", None) is None:
            raise ValueError(
                f"{config_path}: model.net builds a network without `num_classes`; not an SSD300"
            )
        names, ids = _class_names_from_run(cfg, int(net.num_classes))
        source = str(ckpt)
    settings.update(dict(decoder or {}))
    net.eval().to(device)
    return Detector(
        net=net, class_names=tuple(names), category_ids=tuple(ids), decoder=settings, source=source
    )


def _onnx_providers(device: str | torch.device) -> list[str]:
    """onnxruntime execution providers for ``device`` (``auto``: CUDA when this onnxruntime has it)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    device = str(device)
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device.startswith("cuda") and "CUDAExecutionProvider" not in available:
        raise ValueError(
            f"device={device}: this onnxruntime has no CUDAExecutionProvider (it has "
            f"{', '.join(available)}); install onnxruntime-gpu or use device=cpu"
        )
    if device == "auto" and "CUDAExecutionProvider" not in available:
        return ["CPUExecutionProvider"]
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def load_onnx_detector(
    path: str | os.PathLike, *, decoder: Mapping[str, Any] | None = None, device: str | torch.device = "cpu"
) -> OnnxDetector:
    """Open an end-to-end ONNX export of ``scripts/export_onnx.py end_to_end=true`` with onnxruntime.

    Class names, category ids and decoder settings come from the file's metadata. The decoder settings are
    part of the graph: ``decoder`` may only repeat them (a different value raises, naming the re-export).
    ``device``: ``cpu``, ``cuda`` (needs onnxruntime-gpu) or ``auto``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an end-to-end export of this project (a network-only export, another model), or a
            ``decoder`` value that differs from the exported one.
    """
    import onnxruntime as ort

    from ssd_lightning.inference.export import END_TO_END_OUTPUTS, METADATA_KEYS, read_metadata

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"onnx={path} does not exist")
    session = ort.InferenceSession(str(path), providers=_onnx_providers(device))
    outputs = tuple(o.name for o in session.get_outputs())
    if outputs != END_TO_END_OUTPUTS:
        raise ValueError(
            f"onnx={path} has outputs {', '.join(outputs)}, not {', '.join(END_TO_END_OUTPUTS)}: predict.py "
            "runs end-to-end exports; write one with `python scripts/export_onnx.py ckpt_path=... "
            "end_to_end=true`"
        )
    meta = read_metadata(session.get_modelmeta().custom_metadata_map)
    missing = set(METADATA_KEYS) - set(meta)
    if missing:
        raise ValueError(
            f"onnx={path} lacks the metadata {sorted(missing)} that scripts/export_onnx.py end_to_end=true "
            "writes (class names, decoder settings); re-export it with that script"
        )
    settings = dict(meta["decoder"])
    for key, value in dict(decoder or {}).items():
        if settings.get(key) != value:
            raise ValueError(
                f"decoder.{key}={value}: the decoder of {path} is part of its graph ({key}="
                f"{settings.get(key)}); re-export with `scripts/export_onnx.py ... end_to_end=true "
                f"decoder.{key}={value}`"
            )
    return OnnxDetector(
        session=session,
        class_names=tuple(meta["class_names"]),
        category_ids=tuple(meta["category_ids"]),
        decoder=settings,
        source=str(path),
        image_size=int(meta["image_size"]),
    )


# ------------------------------------------------------------------------------------------ inputs
def collect_inputs(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Image files named by ``spec``: a file, a folder (its files with an image extension, sorted, not
    recursive), a glob pattern (``photos/*.jpg``, ``**`` allowed), or a list of those.

    Raises:
        FileNotFoundError: nothing matched (the message names ``spec``).
    """
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    found: list[Path] = []
    for item in specs:
        path = Path(item)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
        else:
            found += sorted(Path(p) for p in glob.glob(str(item), recursive=True) if Path(p).is_file())
    if not found:
        raise FileNotFoundError(
            f"input={spec!s}: no image files found; give an image, a folder of images or a glob in quotes"
        )
    return list(dict.fromkeys(found))


def preprocess(image: Image.Image, size: int = 300) -> Tensor:
    """PIL image -> (3, size, size) float32, RGB, resized without letterbox, ImageNet-normalised."""
    rgb = image.convert("RGB").resize((size, size), Image.BILINEAR)
    array = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1)  # (3, S, S) 0..255
    mean = torch.tensor(IMAGENET_MEAN_255).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD_255).view(3, 1, 1)
    return (array - mean) / std


def open_image(path: Path) -> Image.Image:
    """Decode fully (so a truncated file fails here, not later) and apply the EXIF orientation."""
    with Image.open(path) as img:
        img.load()
        return ImageOps.exif_transpose(img).convert("RGB")


def _batches(paths: Sequence[Path], batch_size: int, failures: list[tuple[Path, str]]) -> Iterator[list]:
    batch: list[tuple[Path, Image.Image]] = []
    for path in paths:
        try:
            batch.append((path, open_image(path)))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            failures.append((path, f"{type(e).__name__}: {e}"))
            log.error("skipping %s: cannot read it as an image (%s)", path, e)
            continue
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


# ------------------------------------------------------------------------------------------ running
def _unique_name(path: Path, used: set[str]) -> str:
    name = f"{path.stem}.jpg"
    k = 1
    while name in used:
        name, k = f"{path.stem}_{k}.jpg", k + 1
    used.add(name)
    return name


def predict_images(
    detector: Detector | OnnxDetector,
    inputs: Sequence[Path],
    output_dir: str | os.PathLike,
    *,
    batch_size: int = 8,
    draw_score_thresh: float = 0.3,
    draw: bool = True,
) -> tuple[list[dict[str, Any]], list[tuple[Path, str]]]:
    """Detect objects in ``inputs``; write annotated pictures and ``predictions.json`` to ``output_dir``.

    ``predictions.json`` is in COCO results format, one entry per detection (everything the decoder keeps:
    score > ``decoder["score_thresh"]``, at most ``max_detections`` per image): ``image_id`` (index of the
    image in ``inputs`` order, failures included), ``file_name`` (the input path), ``category_id`` (dataset
    id), ``category_name``, ``bbox`` ``[x, y, w, h]`` in original pixels clipped to the image, ``score``.
    Pictures ``<output_dir>/<stem>.jpg`` show detections with score >= ``draw_score_thresh``.

    Returns:
        (the COCO results, the failures as ``(path, reason)``). Unreadable files are skipped with an
        error message naming them; the others are processed.
    """
    from ssd_lightning.visualize import draw_detections

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    index = {path: i for i, path in enumerate(inputs)}
    results: list[dict[str, Any]] = []
    failures: list[tuple[Path, str]] = []
    used: set[str] = set()
    done = 0
    for batch in _batches(inputs, batch_size, failures):
        images = torch.stack([preprocess(img, detector.image_size) for _, img in batch])
        sizes = [(img.height, img.width) for _, img in batch]
        detections = detector.detect(images, sizes)
        for (path, img), det in zip(batch, detections, strict=True):
            boxes = det["boxes"].cpu().double().numpy()
            scores = det["scores"].cpu().numpy()
            labels = det["labels"].cpu().numpy()
            clipped = boxes.copy()
            clipped[:, 0::2] = clipped[:, 0::2].clip(0, img.width)
            clipped[:, 1::2] = clipped[:, 1::2].clip(0, img.height)
            for box, score, label in zip(clipped, scores, labels, strict=True):
                results.append(
                    {
                        "image_id": index[path],
                        "file_name": str(path),
                        "category_id": int(detector.category_ids[int(label) - 1]),
                        "category_name": detector.class_names[int(label)],
                        "bbox": [
                            round(float(v), 2) for v in (box[0], box[1], box[2] - box[0], box[3] - box[1])
                        ],
                        "score": round(float(score), 5),
                    }
                )
            if draw:
                picture = draw_detections(
                    img,
                    clipped,
                    labels,
                    scores,
                    class_names=detector.class_names,
                    score_thresh=draw_score_thresh,
                )
                picture.save(output_dir / _unique_name(path, used), quality=92, subsampling=0)
            done += 1
        log.info("%d/%d images done", done + len(failures), len(inputs))
    with open(output_dir / "predictions.json", "w", encoding="utf-8") as f:
        json.dump(results, f)
    return results, failures
