"""Synthetic "shapes" datasets, deterministic from ``seed``, to train and evaluate without COCO.

* detection (:func:`make_detection_dataset`): the COCO 2017 layout (``root/{train,val}2017/*.jpg``,
  ``root/annotations/instances_{train,val}2017.json``); 1-6 shapes per image (1-``max_objects_train`` in the
  train split) of :data:`SHAPE_CATEGORIES`
  (or ``categories`` drawn from :data:`SHAPE_CATALOGUE`) on textured backgrounds; every 20th image (index 3,
  23, 43, ...) has none. Annotations follow COCO: ``bbox`` ``[x, y, w, h]`` in pixels of the *visible*
  pixels (pixel ``i`` covers ``[i, i + 1)``), ``area`` the visible pixel count, ``segmentation`` the full
  outline as one polygon, ``iscrowd`` 0; objects less than 25 % visible are left out of the annotations;
  category ids are non-contiguous.
* classification (:func:`make_classification_dataset`): ``root/{train,val}/<name>/*.jpg``, one shape each.

Images are RGB JPEG (quality 90). A dataset appears complete or not at all (written in a temporary sibling,
then renamed); ``ensure_*_dataset`` generate only when ``root`` does not exist. Design notes:
docs/internals.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ssd_lightning.errors import DatasetConflictError

__all__ = [
    "SHAPE_CATALOGUE",
    "SHAPE_CATEGORIES",
    "ShapeObject",
    "check_max_objects",
    "make_classification_dataset",
    "make_detection_dataset",
    "ensure_classification_dataset",
    "ensure_detection_dataset",
    "render_classification_image",
    "render_detection_image",
    "dataset_folder_name",
    "resolve_categories",
]

log = logging.getLogger(__name__)

SHAPE_CATEGORIES: list[dict] = [
    {"id": 3, "name": "rectangle", "supercategory": "shape"},
    {"id": 7, "name": "ellipse", "supercategory": "shape"},
    {"id": 11, "name": "triangle", "supercategory": "shape"},
    {"id": 20, "name": "star", "supercategory": "shape"},
]
"""COCO-style categories of the default datasets (the demo's); ids are non-contiguous on purpose."""

SHAPE_CATALOGUE: list[dict] = [
    *SHAPE_CATEGORIES,
    {"id": 24, "name": "cross", "supercategory": "shape"},
    {"id": 31, "name": "hexagon", "supercategory": "shape"},
    {"id": 42, "name": "arrow", "supercategory": "shape"},
]
"""Every shape the detection generator can draw, in id order; ``categories=`` picks a subset by name."""

JPEG_QUALITY = 90
MAX_OBJECTS = 6  # shapes per image: 1..MAX_OBJECTS (the val split always; the train split by default)
EMPTY_EVERY = 20  # image index i of a split has no objects when i % EMPTY_EVERY == EMPTY_OFFSET
EMPTY_OFFSET = 3
MIN_VISIBLE_FRACTION = 0.25
# Shape extent drawn log-uniformly between these fractions of the image's short side (at least 10 px).
DEFAULT_MIN_SCALE = 0.07
DEFAULT_MAX_SCALE = 0.75
SPLITS = {"train": ("train2017", 0), "val": ("val2017", 1)}
CLS_SPLITS = {"train": 2, "val": 3}
METADATA_FILE = "shapes_dataset.json"
_KINDS = [c["name"] for c in SHAPE_CATEGORIES]  # the default class set, in id order
_CATALOGUE_IDS = {c["name"]: c["id"] for c in SHAPE_CATALOGUE}
# Settings a dataset's metadata file records only when they differ from these defaults.
_UNRECORDED_DEFAULTS = {
    "min_scale": DEFAULT_MIN_SCALE,
    "max_scale": DEFAULT_MAX_SCALE,
    "categories": _KINDS,
    "max_objects_train": MAX_OBJECTS,
}
# Upper bound of objects per image, used to build unique annotation ids: image_id * 10 + k.
_ANN_ID_STRIDE = 10


@dataclass
class ShapeObject:
    """One shape drawn into an image.

    Attributes:
        category_id: COCO category id from :data:`SHAPE_CATEGORIES`.
        colour: fill colour, ``(3,)`` uint8 RGB, before the final per-image noise.
        polygon: full outline, ``(P, 2)`` float64 ``(x, y)`` pixel coordinates (pixel centres at ``+0.5``).
        full_area: number of pixels the shape covered when drawn.
        visible: ``(H, W)`` bool mask of its pixels still visible in the finished image.
    """

    category_id: int
    colour: np.ndarray
    polygon: np.ndarray
    full_area: int
    visible: np.ndarray

    @property
    def visible_fraction(self) -> float:
        return float(self.visible.sum()) / max(self.full_area, 1)

    def bbox(self) -> list[float]:
        """Tight ``[x, y, w, h]`` pixel box of the visible pixels (``[0, 0, 0, 0]`` if none)."""
        rows = np.flatnonzero(self.visible.any(axis=1))
        cols = np.flatnonzero(self.visible.any(axis=0))
        if rows.size == 0:
            return [0.0, 0.0, 0.0, 0.0]
        y0, y1 = int(rows[0]), int(rows[-1]) + 1
        x0, x1 = int(cols[0]), int(cols[-1]) + 1
        return [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]


def _rng(seed: int, *keys: int) -> np.random.Generator:
    """Independent generator per (seed, split, index): images do not depend on how many are drawn."""
    return np.random.default_rng([int(seed), *(int(k) for k in keys)])


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Textured background: linear colour gradient + low-frequency blotches + clutter lines.

    Returns ``(H, W, 3)`` uint8.
    """
    c0 = rng.uniform(0, 255, 3).astype(np.float32)
    c1 = rng.uniform(0, 255, 3).astype(np.float32)
    theta = rng.uniform(0, 2 * math.pi)
    xs = np.arange(width, dtype=np.float32) * math.cos(theta)
    ys = np.arange(height, dtype=np.float32) * math.sin(theta)
    t = ys[:, None] + xs[None, :]
    t -= t.min()
    t /= max(float(t.max()), 1e-6)
    img = c0 + t[..., None] * (c1 - c0)  # (H, W, 3)

    # Blotches: coarse random field, bilinearly upsampled per channel.
    gh, gw = max(2, height // 40), max(2, width // 40)
    amp = rng.uniform(10, 45)
    coarse = rng.uniform(-amp, amp, (gh, gw, 3)).astype(np.float32)
    blot = [
        Image.fromarray(coarse[..., c], mode="F").resize((width, height), Image.BILINEAR) for c in range(3)
    ]
    img += np.stack([np.asarray(channel) for channel in blot], axis=-1)
    out = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), mode="RGB")

    draw = ImageDraw.Draw(out)
    for _ in range(int(rng.integers(3, 13))):
        x0, x1 = rng.uniform(-0.2, 1.2, 2) * width
        y0, y1 = rng.uniform(-0.2, 1.2, 2) * height
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        draw.line([(x0, y0), (x1, y1)], fill=colour, width=int(rng.integers(1, 4)))
    return np.array(out)


def _regular_polygon(n: int, radius: float, phase: float) -> np.ndarray:
    a = phase + np.arange(n) * (2 * math.pi / n)
    return np.stack([radius * np.cos(a), radius * np.sin(a)], axis=1)


def _rotate(points: np.ndarray, angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    return points @ np.array([[c, s], [-s, c]])


def _shape_outline(rng: np.random.Generator, kind: str, size: float) -> tuple[np.ndarray, tuple | None]:
    """Outline centred at the origin, ``(P, 2)`` float (x, y), with the shape's extent about ``size``.

    For ellipses also returns ``(a, b, angle)`` so the mask can be rasterised analytically.
    """
    angle = rng.uniform(0, 2 * math.pi)
    if kind == "rectangle":
        aspect = math.exp(rng.uniform(math.log(0.4), math.log(2.5)))
        w, h = size * math.sqrt(aspect), size / math.sqrt(aspect)
        if rng.random() < 0.5:  # half of them axis-aligned
            angle = 0.0
        pts = np.array([[-w, -h], [w, -h], [w, h], [-w, h]]) / 2
        return _rotate(pts, angle), None
    if kind == "ellipse":
        aspect = math.exp(rng.uniform(math.log(0.45), math.log(1.0)))
        a, b = size / 2, size * aspect / 2
        pts = np.stack([a * np.cos(t := np.linspace(0, 2 * math.pi, 32, endpoint=False)), b * np.sin(t)], 1)
        return _rotate(pts, angle), (a, b, angle)
    if kind == "triangle":
        pts = _regular_polygon(3, size / 2, angle)
        pts = pts + rng.uniform(-0.15, 0.15, (3, 2)) * size  # irregular but never degenerate
        return pts - pts.mean(axis=0), None
    if kind == "star":
        outer = _regular_polygon(5, size / 2, angle)
        inner = _regular_polygon(5, size / 2 * rng.uniform(0.38, 0.55), angle + math.pi / 5)
        pts = np.empty((10, 2))
        pts[0::2], pts[1::2] = outer, inner
        return pts, None
    if kind == "cross":  # a plus sign: two bars of width 28-42 % of its length
        half, bar = size / 2, size * rng.uniform(0.14, 0.21)
        pts = np.array(
            [
                [-bar, -half], [bar, -half], [bar, -bar], [half, -bar], [half, bar], [bar, bar],
                [bar, half], [-bar, half], [-bar, bar], [-half, bar], [-half, -bar], [-bar, -bar],
            ]
        )  # fmt: skip
        return _rotate(pts, angle), None
    if kind == "hexagon":
        pts = _regular_polygon(6, size / 2, 0.0) * [1.0, rng.uniform(0.75, 1.0)]  # slightly squashed
        return _rotate(pts, angle), None
    if kind == "arrow":  # shaft and head along +x, the box of its outline centred at the origin
        half, head = size / 2, size * rng.uniform(0.3, 0.45)
        head_w, shaft_w = size * rng.uniform(0.22, 0.32), size * rng.uniform(0.07, 0.13)
        neck = half - head
        pts = np.array(
            [[-half, -shaft_w], [neck, -shaft_w], [neck, -head_w], [half, 0.0],
             [neck, head_w], [neck, shaft_w], [-half, shaft_w]]
        )  # fmt: skip
        return _rotate(pts, angle), None
    raise ValueError(f"unknown shape kind {kind!r}; expected one of {list(_CATALOGUE_IDS)}")


def _rasterise(
    polygon: np.ndarray, ellipse: tuple | None, x0: int, y0: int, x1: int, y1: int, centre: np.ndarray
) -> np.ndarray:
    """Bool mask of pixels of region ``[y0:y1, x0:x1]`` whose centres lie inside the shape.

    Polygons use the even-odd crossing rule (handles the concave star); ellipses are exact.
    """
    py = np.arange(y0, y1, dtype=np.float64)[:, None] + 0.5  # (h, 1)
    px = np.arange(x0, x1, dtype=np.float64)[None, :] + 0.5  # (1, w)
    if ellipse is not None:
        a, b, angle = ellipse
        dx, dy = px - centre[0], py - centre[1]
        c, s = math.cos(angle), math.sin(angle)
        u = dx * c + dy * s
        v = -dx * s + dy * c
        return (u / a) ** 2 + (v / b) ** 2 <= 1.0
    inside = np.zeros((y1 - y0, x1 - x0), dtype=bool)
    nxt = np.roll(polygon, -1, axis=0)
    for (ax, ay), (bx, by) in zip(polygon, nxt, strict=True):
        if ay == by:
            continue
        crosses = (ay > py) != (by > py)  # (h, 1)
        x_int = ax + (py - ay) * (bx - ax) / (by - ay)  # (h, 1)
        inside ^= crosses & (px < x_int)
    return inside


def _pick_colour(rng: np.random.Generator, under: np.ndarray) -> np.ndarray:
    """Random saturated-ish colour that differs clearly from the mean colour ``under`` it."""
    colour = rng.integers(0, 256, 3)
    for _ in range(20):
        if np.abs(colour - under).sum() > 120:
            break
        colour = rng.integers(0, 256, 3)
    return colour.astype(np.uint8)


def _draw_shapes(
    rng: np.random.Generator,
    img: np.ndarray,
    kinds: list[str],
    sizes: list[float],
    centres: list[np.ndarray] | None = None,
) -> list[ShapeObject]:
    """Draw shapes in order into ``img`` ``(H, W, 3)`` uint8 (in place); later ones occlude earlier ones."""
    height, width = img.shape[:2]
    owner = np.full((height, width), -1, dtype=np.int8)
    drawn: list[ShapeObject] = []
    for k, (kind, size) in enumerate(zip(kinds, sizes, strict=True)):
        outline, ellipse = _shape_outline(rng, kind, size)
        if ellipse is not None:
            a, b, angle = ellipse
            ex = math.hypot(a * math.cos(angle), b * math.sin(angle))
            ey = math.hypot(a * math.sin(angle), b * math.cos(angle))
        else:
            ex, ey = np.abs(outline).max(axis=0)
        if centres is None:
            centre = np.array([rng.uniform(ex, max(ex, width - ex)), rng.uniform(ey, max(ey, height - ey))])
        else:
            centre = np.clip(centres[k], [ex, ey], [max(ex, width - ex), max(ey, height - ey)])
        polygon = outline + centre
        x0, y0 = max(0, int(math.floor(centre[0] - ex))), max(0, int(math.floor(centre[1] - ey)))
        x1 = min(width, int(math.ceil(centre[0] + ex)) + 1)
        y1 = min(height, int(math.ceil(centre[1] + ey)) + 1)
        mask = _rasterise(polygon, ellipse, x0, y0, x1, y1, centre)
        region = img[y0:y1, x0:x1]
        under = region[mask].mean(axis=0) if mask.any() else np.full(3, 128.0)
        colour = _pick_colour(rng, under)
        region[mask] = colour
        owner[y0:y1, x0:x1][mask] = k
        drawn.append(
            ShapeObject(_CATALOGUE_IDS[kind], colour, polygon, int(mask.sum()), np.zeros(0, dtype=bool))
        )
    for k, obj in enumerate(drawn):
        obj.visible = owner == k
    return drawn


def _finish(rng: np.random.Generator, img: np.ndarray) -> np.ndarray:
    """Add per-pixel noise, uniform in ``[-a, a]`` with ``a`` drawn from 3..14 (sigma 1.7-8), as uint8.

    Uniform, not Gaussian: cheaper to draw and the same after JPEG (docs/internals.md).
    """
    half = int(rng.integers(3, 15))
    out = img.astype(np.int16)
    out += rng.integers(-half, half + 1, img.shape, dtype=np.int16)
    return np.clip(out, 0, 255, out=out).astype(np.uint8)


def render_detection_image(
    seed: int,
    split: str,
    index: int,
    *,
    min_size: int = 160,
    max_size: int = 480,
    min_scale: float = DEFAULT_MIN_SCALE,
    max_scale: float = DEFAULT_MAX_SCALE,
    categories: Sequence[str] | None = None,
    max_objects: int = MAX_OBJECTS,
) -> tuple[np.ndarray, list[ShapeObject]]:
    """Render image ``index`` of ``split`` ("train" or "val") exactly as :func:`make_detection_dataset` does.

    Shape extents are log-uniform in ``[min_scale, max_scale]`` times the short side, at least 10 px.
    Another scale range keeps the image size, background, number and kinds of shapes of the same
    ``(seed, split, index)`` (they are drawn first); positions, colours and noise follow from the sizes.
    ``categories`` (names from :data:`SHAPE_CATALOGUE`; ``None``: the four of :data:`SHAPE_CATEGORIES`)
    is the set each shape's kind is drawn from, uniformly; the set counts, not the order it is given in.
    An image holds 1..``max_objects`` shapes (uniformly; none for every 20th index); another
    ``max_objects`` keeps the image size and background of the same ``(seed, split, index)``.

    Returns:
        image: ``(H, W, 3)`` uint8 RGB, before JPEG compression; ``min_size <= H, W <= max_size``.
        objects: every shape drawn, in drawing order (including ones that end up < 25 % visible).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    _check_sizes(min_size, max_size)
    _check_scales(min_scale, max_scale)
    check_max_objects(max_objects)
    names = resolve_categories(categories)
    rng = _rng(seed, SPLITS[split][1], index)
    width, height = (int(v) for v in rng.integers(min_size, max_size + 1, 2))
    img = _background(rng, height, width)
    n = 0 if index % EMPTY_EVERY == EMPTY_OFFSET else int(rng.integers(1, max_objects + 1))
    short = min(width, height)
    kinds = [names[int(i)] for i in rng.integers(0, len(names), n)]
    log_lo, log_hi = math.log(min_scale), math.log(max_scale)
    sizes = [max(10.0, short * math.exp(rng.uniform(log_lo, log_hi))) for _ in range(n)]
    objects = _draw_shapes(rng, img, kinds, sizes)
    return _finish(rng, img), objects


def render_classification_image(
    seed: int, split: str, class_index: int, index: int, *, image_size: int = 96
) -> np.ndarray:
    """Render one classification image: a single shape of class ``class_index`` near the centre.

    Returns ``(image_size, image_size, 3)`` uint8 RGB, before JPEG compression.
    """
    if split not in CLS_SPLITS:
        raise ValueError(f"split must be one of {list(CLS_SPLITS)}, got {split!r}")
    if not 0 <= class_index < len(_KINDS):
        raise ValueError(f"class_index must be in [0, {len(_KINDS)}), got {class_index}")
    rng = _rng(seed, CLS_SPLITS[split], class_index, index)
    img = _background(rng, image_size, image_size)
    size = image_size * rng.uniform(0.3, 0.8)
    centre = image_size / 2 + rng.uniform(-0.15, 0.15, 2) * image_size
    _draw_shapes(rng, img, [_KINDS[class_index]], [size], centres=[centre])
    return _finish(rng, img)


def resolve_categories(categories: Sequence[str] | None) -> list[str]:
    """The class set ``categories`` names, in :data:`SHAPE_CATALOGUE` (id) order; ``None``: the default four.

    Raises:
        ValueError: an empty set, a repeated name, or a name that is not in the catalogue.
    """
    if categories is None:
        return list(_KINDS)
    if isinstance(categories, str):
        raise ValueError(f"categories must be a list of shape names, got the string {categories!r}")
    names = [str(c) for c in categories]
    unknown = [c for c in names if c not in _CATALOGUE_IDS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(
            f"categories must be distinct names from {list(_CATALOGUE_IDS)} (at least one), got {names}"
        )
    return [c for c in _CATALOGUE_IDS if c in names]


def dataset_folder_name(categories: Sequence[str] | None) -> str:
    """The folder name a class set's dataset goes to by convention: ``shapes`` for the default four (the
    demo's ``data/shapes``), else ``shapes_<names in id order>``, e.g. ``shapes_cross_hexagon_arrow``."""
    names = resolve_categories(categories)
    return "shapes" if names == _KINDS else "_".join(["shapes", *names])


def _check_sizes(min_size: int, max_size: int) -> None:
    if not 32 <= min_size <= max_size:
        raise ValueError(f"need 32 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}")


def _check_scales(min_scale: float, max_scale: float) -> None:
    if not 0 < min_scale <= max_scale <= 1:
        raise ValueError(
            f"need 0 < min_scale <= max_scale <= 1 (fractions of the short side), "
            f"got min_scale={min_scale}, max_scale={max_scale}"
        )


def check_max_objects(max_objects: int) -> None:
    """Raise ``ValueError`` unless ``max_objects`` (shapes per image) is in 1..9."""
    if not 1 <= max_objects < _ANN_ID_STRIDE:
        raise ValueError(
            f"max_objects must be in [1, {_ANN_ID_STRIDE - 1}] (annotation ids are image_id * "
            f"{_ANN_ID_STRIDE} + k), got {max_objects}"
        )


def _save_jpeg(array: np.ndarray, path: Path) -> None:
    Image.fromarray(array, mode="RGB").save(path, format="JPEG", quality=JPEG_QUALITY)


def _annotation_path(root: Path, split: str) -> Path:
    return root / "annotations" / f"instances_{SPLITS[split][0]}.json"


def _write_detection_split(
    root: Path, split: str, count: int, id_offset: int, seed: int, render_kwargs: dict
) -> None:
    names = render_kwargs["categories"]
    folder, _ = SPLITS[split]
    (root / folder).mkdir(parents=True)
    images, annotations = [], []
    for i in range(count):
        image_id = id_offset + i + 1
        array, objects = render_detection_image(seed, split, i, **render_kwargs)
        height, width = array.shape[:2]
        file_name = f"{image_id:012d}.jpg"
        _save_jpeg(array, root / folder / file_name)
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        for k, obj in enumerate(objects):
            if obj.visible_fraction < MIN_VISIBLE_FRACTION:
                continue
            annotations.append(
                {
                    "id": image_id * _ANN_ID_STRIDE + k,
                    "image_id": image_id,
                    "category_id": obj.category_id,
                    "bbox": obj.bbox(),
                    "area": float(obj.visible.sum()),
                    "iscrowd": 0,
                    "segmentation": [
                        [round(float(v), 2) for v in np.clip(obj.polygon, 0, [width, height]).flat]
                    ],
                }
            )
    coco = {
        "info": {
            "description": f"ssd_lightning synthetic shapes, {split} split (seed {seed})",
            "version": "1.0",
            "year": 2024,
            "contributor": "ssd_lightning.data.shapes",
            "date_created": "",
        },
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [dict(c) for c in SHAPE_CATALOGUE if c["name"] in names],
    }
    path = _annotation_path(root, split)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(coco, separators=(",", ":")))


def _occupied(root: Path) -> bool:
    """``root`` exists and is not an empty folder (which counts as missing)."""
    return root.exists() and not (root.is_dir() and not any(root.iterdir()))


def _write_metadata(root: Path, kind: str, params: dict) -> None:
    (root / METADATA_FILE).write_text(json.dumps({"kind": kind, **params}, indent=2, sort_keys=True) + "\n")


def _atomic_generate(
    root: Path, fill: Callable[[Path], None], is_complete: Callable[[Path], str | None]
) -> Path:
    """Run ``fill(tmp)`` in a temporary sibling of ``root``, then rename it to ``root``; if another process
    renamed a complete dataset into place first, ours is discarded and ``root`` used."""
    if _occupied(root):
        raise DatasetConflictError(
            f"{root} already exists; delete it to regenerate, or use ensure_*_dataset() to reuse it"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fill(tmp)
        try:
            os.replace(tmp, root)
        except OSError:
            if is_complete(root) is None:  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return root
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def make_detection_dataset(
    root: str | os.PathLike,
    *,
    num_train: int = 2000,
    num_val: int = 200,
    seed: int = 0,
    min_size: int = 160,
    max_size: int = 480,
    min_scale: float = DEFAULT_MIN_SCALE,
    max_scale: float = DEFAULT_MAX_SCALE,
    categories: Sequence[str] | None = None,
    max_objects_train: int = MAX_OBJECTS,
) -> Path:
    """Generate a COCO-layout shapes detection dataset at ``root`` (which must not exist or be empty).

    Train image ids are ``1..num_train``, val ids ``num_train + 1 .. num_train + num_val``; annotation ids
    are ``image_id * 10 + k`` for the k-th shape drawn in the image. Images: :func:`render_detection_image`
    (the defaults are the dataset ``make train`` has always generated). The annotation files list exactly
    the ``categories``, with their catalogue ids, and the metadata file records them
    (:func:`ensure_detection_dataset` refuses to reuse a folder of another class set). ``max_objects_train``
    is the most shapes a *training* image holds (1..9); the val split always holds 1..:data:`MAX_OBJECTS`,
    so scores on the val split keep their meaning. Returns ``root`` as a :class:`~pathlib.Path`.
    """
    if num_train < 0 or num_val < 0:
        raise ValueError(f"num_train and num_val must be >= 0, got {num_train} and {num_val}")
    _check_sizes(min_size, max_size)
    _check_scales(min_scale, max_scale)
    check_max_objects(max_objects_train)
    names = resolve_categories(categories)
    render = dict(
        min_size=min_size, max_size=max_size, min_scale=min_scale, max_scale=max_scale, categories=names
    )
    params = dict(num_train=num_train, num_val=num_val, seed=seed, min_size=min_size, max_size=max_size)
    # Scales, categories and max_objects_train are recorded only when they differ from the defaults: default
    # datasets stay byte-identical, metadata file included, to those generated before they were configurable.
    chosen = {**render, "max_objects_train": max_objects_train}
    params |= {k: v for k, v in chosen.items() if k in _UNRECORDED_DEFAULTS and v != _UNRECORDED_DEFAULTS[k]}

    def fill(tmp: Path) -> None:
        _write_detection_split(tmp, "train", num_train, 0, seed, {**render, "max_objects": max_objects_train})
        _write_detection_split(tmp, "val", num_val, num_train, seed, render)
        _write_metadata(tmp, "detection", params)

    return _atomic_generate(Path(root), fill, _detection_problem)


def make_classification_dataset(
    root: str | os.PathLike,
    *,
    num_train_per_class: int = 100,
    num_val_per_class: int = 20,
    seed: int = 0,
    image_size: int = 96,
) -> Path:
    """Generate an ImageFolder shapes classification dataset: ``root/{train,val}/<class_name>/*.jpg``.

    Class names are the ``name`` fields of :data:`SHAPE_CATEGORIES`; images are
    ``image_size x image_size`` RGB JPEGs.
    """
    if num_train_per_class < 1 or num_val_per_class < 1:
        raise ValueError(
            f"num_train_per_class and num_val_per_class must be >= 1, "
            f"got {num_train_per_class} and {num_val_per_class}"
        )
    if image_size < 32:
        raise ValueError(f"image_size must be >= 32, got {image_size}")
    params = {
        "num_train_per_class": num_train_per_class,
        "num_val_per_class": num_val_per_class,
        "seed": seed,
        "image_size": image_size,
    }

    def fill(tmp: Path) -> None:
        for split, count in (("train", num_train_per_class), ("val", num_val_per_class)):
            for c, name in enumerate(_KINDS):
                folder = tmp / split / name
                folder.mkdir(parents=True)
                for i in range(count):
                    array = render_classification_image(seed, split, c, i, image_size=image_size)
                    _save_jpeg(array, folder / f"{name}_{i:05d}.jpg")
        _write_metadata(tmp, "classification", params)

    return _atomic_generate(Path(root), fill, _classification_problem)


def _detection_problem(root: Path) -> str | None:
    """``None`` if ``root`` holds a complete COCO-layout dataset, else what is missing."""
    for split, (folder, _) in SPLITS.items():
        ann = _annotation_path(root, split)
        if not ann.is_file():
            return f"missing annotation file {ann}"
        if not (root / folder).is_dir():
            return f"missing image folder {root / folder}"
        try:
            images = json.loads(ann.read_text())["images"]
        except (ValueError, KeyError) as e:
            return f"unreadable annotation file {ann} ({e})"
        present = set(os.listdir(root / folder))
        missing = [im["file_name"] for im in images if im["file_name"] not in present]
        if missing:
            return f"{len(missing)} images listed in {ann} are missing from {root / folder}"
    return None


def _classification_problem(root: Path) -> str | None:
    meta = {}
    if (root / METADATA_FILE).is_file():
        meta = json.loads((root / METADATA_FILE).read_text())
    for split in CLS_SPLITS:
        expected = meta.get(f"num_{split}_per_class")
        for name in _KINDS:
            folder = root / split / name
            if not folder.is_dir():
                return f"missing class folder {folder}"
            count = sum(1 for p in folder.iterdir() if p.suffix == ".jpg")
            if count == 0 or (expected is not None and count != expected):
                return f"{folder} holds {count} images, expected {expected or 'at least 1'}"
    return None


def _category_conflict(root: Path, kwargs: dict) -> str | None:
    """Why the complete detection dataset at ``root`` cannot serve ``kwargs["categories"]``, or ``None``.

    The annotation file's own ``categories`` are compared (by name, in id order): a folder never serves
    two class sets, whatever its metadata file says (or whether it has one).
    """
    if "categories" not in kwargs:
        return None
    wanted = resolve_categories(kwargs["categories"])
    cats = json.loads(_annotation_path(root, "val").read_text()).get("categories", [])
    present = [c["name"] for c in sorted(cats, key=lambda c: c["id"])]
    if present == wanted:
        return None
    suggestion = root.parent / dataset_folder_name(wanted)
    return (
        f"{root} holds a shapes detection dataset of the categories {present}, but {wanted} were asked for; "
        f"datasets of different class sets never share a folder: pass another root (e.g. {suggestion}; "
        f"data.root=... in configs) or delete {root} to regenerate it"
    )


def _ensure(
    root: str | os.PathLike,
    kind: str,
    make: Callable[..., Path],
    problem: Callable[[Path], str | None],
    kwargs: dict,
    conflict: Callable[[Path, dict], str | None] | None = None,
) -> Path:
    root = Path(root)
    if _occupied(root):
        issue = problem(root)
        if issue is not None:
            raise DatasetConflictError(
                f"{root} exists but is not a complete shapes {kind} dataset: {issue}. "
                f"If it is left over from an interrupted or older run, delete {root} and run again; "
                f"otherwise pass a different path."
            )
        issue = conflict(root, kwargs) if conflict is not None else None
        if issue is not None:
            raise DatasetConflictError(issue)
        meta_path = root / METADATA_FILE
        if meta_path.is_file() and kwargs:
            meta = json.loads(meta_path.read_text())
            # Keys a dataset records only when they differ from the default (see make_detection_dataset).
            recorded = {**_UNRECORDED_DEFAULTS, **meta}
            differ = {
                k: (recorded.get(k), v)
                for k, v in kwargs.items()
                if k != "categories" and recorded.get(k) != v  # categories: checked by `conflict`
            }
            if differ:
                log.warning(
                    "Reusing shapes %s dataset at %s generated with different settings "
                    "(existing, requested): %s; delete it to regenerate",
                    kind,
                    root,
                    differ,
                )
        return root
    start = time.perf_counter()
    make(root, **kwargs)
    log.info("Generated shapes %s dataset at %s in %.1f s", kind, root, time.perf_counter() - start)
    return root


def ensure_detection_dataset(root: str | os.PathLike, **kwargs) -> Path:
    """Return ``root``, generating it with :func:`make_detection_dataset` (``**kwargs``) if it does not exist.

    An existing dataset generated with other sizes, scales or counts is reused with a warning; one of
    another class set is an error (with ``categories`` in ``kwargs``; ``None`` asks for the default four).

    Raises:
        FileExistsError: ``root`` exists but is not a complete COCO-layout dataset, or (with
            ``categories``) its annotation files list other categories.
    """
    if "categories" in kwargs:
        resolve_categories(kwargs["categories"])  # a bad name is a ValueError before anything is read
    return _ensure(root, "detection", make_detection_dataset, _detection_problem, kwargs, _category_conflict)


def ensure_classification_dataset(root: str | os.PathLike, **kwargs) -> Path:
    """Return ``root``, generating it with :func:`make_classification_dataset` if it does not exist.

    Raises:
        FileExistsError: ``root`` exists but is not a complete ImageFolder shapes dataset.
    """
    return _ensure(root, "classification", make_classification_dataset, _classification_problem, kwargs)
