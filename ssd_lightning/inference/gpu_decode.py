"""JPEGs decoded on a CUDA device (nvJPEG through ``torchvision.io.decode_jpeg``) into the network's input
and a picture-sized copy (the only thing copied back to the host, and only when pictures are drawn).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags, Image
from torch import Tensor

from ssd_lightning.models import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["decode_jpegs_on", "jpeg_orientation", "network_input", "orient", "picture_of"]

# torchvision 0.29 deprecates its image codecs for TorchCodec (not pinned here); the call is the same in
# 0.21-0.29. Filtered once, at import: warnings.catch_warnings is not thread-safe.
warnings.filterwarnings(
    "ignore", "The image decoding and encoding capabilities of TorchVision", DeprecationWarning
)


def jpeg_orientation(path: Path) -> int | None:
    """The EXIF orientation (1-8, 1 when absent) of a JPEG that nvJPEG decodes to RGB (1 or 3 channels);
    None for any other file (a PNG, a CMYK JPEG), which is read on the host. Only the header is read."""
    with Image.open(path) as img:
        if img.format != "JPEG" or img.mode not in ("RGB", "L"):
            return None
        orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
        return orientation if orientation in range(1, 9) else 1  # a malformed tag: as exif_transpose, ignored


def orient(image: Tensor, orientation: int) -> Tensor:
    """``image`` (C, H, W) turned as EXIF ``orientation`` says (what ``PIL.ImageOps.exif_transpose`` does)."""
    if orientation in (5, 6, 7, 8):  # a quarter turn: transposed first
        image = image.transpose(1, 2)
    flips = {2: (2,), 3: (1, 2), 4: (1,), 6: (2,), 7: (1, 2), 8: (1,)}.get(orientation, ())
    return image.flip(flips) if flips else image


def decode_jpegs_on(
    paths: Sequence[Path], orientations: Sequence[int], device: torch.device
) -> list[Tensor | None]:
    """The JPEGs at ``paths`` as (3, H, W) uint8 RGB on ``device``, each turned by its EXIF orientation;
    None for a file nvJPEG refuses or that does not end in the JPEG end marker (nvJPEG fills a cut-off
    image with grey): the host reads those and says what is wrong. One batched call (on A100/H100/H200
    the hardware decoder), or one per file when that fails."""
    data = [torch.from_numpy(np.fromfile(path, dtype=np.uint8)) for path in paths]
    whole = [k for k, one in enumerate(data) if bytes(one[-2:].tolist()) == b"\xff\xd9"]
    images: list[Tensor | None] = [None] * len(data)
    try:
        for k, image in zip(whole, _decode([data[k] for k in whole], device) if whole else [], strict=True):
            images[k] = image
    except RuntimeError:  # one bad file fails the batch: one call per file
        for k in whole:
            images[k] = _decode(data[k], device)
    return [
        None if image is None else orient(image, k) for image, k in zip(images, orientations, strict=True)
    ]


def _decode(data: Tensor | list[Tensor], device: torch.device) -> Tensor | list[Tensor] | None:
    """``torchvision.io.decode_jpeg`` to RGB on ``device``; None for one file nvJPEG refuses. A list that
    fails raises (the caller tries its files one by one); running out of GPU memory always raises."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        if isinstance(data, list):
            raise
        return None


def network_input(image: Tensor, size: int = 300) -> Tensor:
    """(3, H, W) uint8 -> (3, size, size) float32 ImageNet-normalised: the host's ``preprocess`` (PIL
    ``BILINEAR`` is antialiased) to within rounding."""
    resized = F.interpolate(image[None].float(), size=(size, size), mode="bilinear", antialias=True)[0]
    mean, std = (torch.tensor(v, device=image.device).view(3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    return (resized - mean) / std


def picture_of(image: Tensor, longest: int) -> Image.Image:
    """(3, H, W) uint8 on any device -> a host PIL image, its longer side at most ``longest``."""
    height, width = image.shape[1:]
    scale = min(1.0, longest / max(height, width))
    if scale < 1.0:
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
        image = F.interpolate(image[None].float(), size=size, mode="bilinear", antialias=True)[0]
        image = image.round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(image.permute(1, 2, 0).cpu().numpy())
