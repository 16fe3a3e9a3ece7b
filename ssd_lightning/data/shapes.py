"""Synthetic "shapes" datasets, deterministic from ``seed``, to train and evaluate without COCO.

* detection (:func:`make_detection_dataset`): COCO 2017 layout (``root/{train,val}2017/*.jpg``,
  ``root/annotations/instances_{train,val}2017.json``), 1-6 shapes per image on textured backgrounds, none
  in every 20th; ``bbox`` ``[x, y, w, h]`` of the *visible* pixels (pixel ``i`` covers ``[i, i + 1)``),
  ``area`` their count, ``segmentation`` the full outline; shapes under 25 % visible are not annotated.
* classification (:func:`make_classification_dataset`): ``root/{train,val}/<name>/*.jpg``, one shape each.

RGB JPEGs (quality 90), written in a temporary sibling and renamed; ``ensure_*_dataset`` generate only when
``root`` does not exist. Design notes: docs/internals.md.
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

__all__ = ["SHAPE_CATALOGUE", "SHAPE_CATEGORIES", "ShapeObject", "check_max_objects", "resolve_categories"]
__all__ += ["make_classification_dataset", "make_detection_dataset", "ensure_classification_dataset"]
__all__ += ["ensure_detection_dataset", "render_classification_image", "render_detection_image"]
__all__ += ["dataset_folder_name"]

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
EMPTY_EVERY, EMPTY_OFFSET = 20, 3  # image index i of a split has no objects when i % 20 == 3
MIN_VISIBLE_FRACTION = 0.25
# Shape extent drawn log-uniformly between these fractions of the image's short side (at least 10 px).
DEFAULT_MIN_SCALE, DEFAULT_MAX_SCALE = 0.07, 0.75
SPLITS = {"train": ("train2017", 0), "val": ("val2017", 1)}
CLS_SPLITS = {"train": 2, "val": 3}
METADATA_FILE = "shapes_dataset.json"
_KINDS = [c["name"] for c in SHAPE_CATEGORIES]  # the default class set, in id order
_CATALOGUE_IDS = {c["name"]: c["id"] for c in SHAPE_CATALOGUE}
# Settings the metadata file records only when they differ from these defaults: default datasets stay
# byte-identical, metadata file included, to those generated before they were configurable.
_UNRECORDED_DEFAULTS = dict(
    min_scale=DEFAULT_MIN_SCALE, max_scale=DEFAULT_MAX_SCALE, categories=_KINDS, max_objects_train=MAX_OBJECTS
)
_ANN_ID_STRIDE = 10  # annotation ids are image_id * 10 + k: at most 9 objects per image


@dataclass
class ShapeObject:
    """One shape drawn into an image."""

    category_id: int
    colour: np.ndarray  # (3,) uint8 RGB, before the per-image noise
    polygon: np.ndarray  # full outline, (P, 2) float64 (x, y) pixel coordinates (pixel centres at +0.5)
    full_area: int  # pixels covered when drawn
    visible: np.ndarray  # (H, W) bool: its pixels still visible in the finished image

    @property
    def visible_fraction(self) -> float:
        return float(self.visible.sum()) / max(self.full_area, 1)

    def bbox(self) -> list[float]:
        """Tight ``[x, y, w, h]`` pixel box of the visible pixels (``[0, 0, 0, 0]`` if none)."""
        rows, cols = np.flatnonzero(self.visible.any(axis=1)), np.flatnonzero(self.visible.any(axis=0))
        if rows.size == 0:
            return [0.0, 0.0, 0.0, 0.0]
        return [float(cols[0]), float(rows[0]), float(cols[-1] + 1 - cols[0]), float(rows[-1] + 1 - rows[0])]


def _rng(seed: int, *keys: int) -> np.random.Generator:
    """Independent generator per (seed, split, index): images do not depend on how many are drawn."""
    return np.random.default_rng([int(seed), *(int(k) for k in keys)])


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """``(H, W, 3)`` uint8: linear colour gradient + low-frequency blotches + clutter lines."""
    c0, c1 = (rng.uniform(0, 255, 3).astype(np.float32) for _ in range(2))
    theta = rng.uniform(0, 2 * math.pi)
    xs = np.arange(width, dtype=np.float32) * math.cos(theta)
    ys = np.arange(height, dtype=np.float32) * math.sin(theta)
    t = ys[:, None] + xs[None, :]
    t -= t.min()
    t /= max(float(t.max()), 1e-6)
    img = c0 + t[..., None] * (c1 - c0)  # (H, W, 3)
    amp = rng.uniform(10, 45)  # blotches: a coarse random field, bilinearly upsampled per channel
    coarse = rng.uniform(-amp, amp, (max(2, height // 40), max(2, width // 40), 3)).astype(np.float32)
    for c in range(3):
        blot = Image.fromarray(coarse[..., c], mode="F").resize((width, height), Image.BILINEAR)
        img[..., c] += np.asarray(blot)
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


def _shape_outline(rng: np.random.Generator, kind: str, size: float) -> tuple[np.ndarray, tuple | None]:
    """``(P, 2)`` (x, y) outline around the origin, extent ~``size``; ellipses' ``(a, b, angle)`` or None."""
    angle, ellipse = rng.uniform(0, 2 * math.pi), None
    if kind == "rectangle":
        aspect = math.exp(rng.uniform(math.log(0.4), math.log(2.5)))
        w, h = size * math.sqrt(aspect), size / math.sqrt(aspect)
        if rng.random() < 0.5:  # half of them axis-aligned
            angle = 0.0
        pts = np.array([[-w, -h], [w, -h], [w, h], [-w, h]]) / 2
    elif kind == "ellipse":
        aspect = math.exp(rng.uniform(math.log(0.45), math.log(1.0)))
        a, b = size / 2, size * aspect / 2
        pts = np.stack([a * np.cos(t := np.linspace(0, 2 * math.pi, 32, endpoint=False)), b * np.sin(t)], 1)
        ellipse = (a, b, angle)
    elif kind == "triangle":  # irregular but never degenerate; not rotated
        pts = _regular_polygon(3, size / 2, angle) + rng.uniform(-0.15, 0.15, (3, 2)) * size
        return pts - pts.mean(axis=0), None
    elif kind == "star":  # not rotated
        outer = _regular_polygon(5, size / 2, angle)
        inner = _regular_polygon(5, size / 2 * rng.uniform(0.38, 0.55), angle + math.pi / 5)
        return np.stack([outer, inner], axis=1).reshape(10, 2), None
    elif kind == "cross":  # a plus sign: two bars of width 28-42 % of its length
        half, bar = size / 2, size * rng.uniform(0.14, 0.21)
        pts = np.array(
            [
                [-bar, -half], [bar, -half], [bar, -bar], [half, -bar], [half, bar], [bar, bar],
                [bar, half], [-bar, half], [-bar, bar], [-half, bar], [-half, -bar], [-bar, -bar],
            ]
        )  # fmt: skip
    elif kind == "hexagon":
        pts = _regular_polygon(6, size / 2, 0.0) * [1.0, rng.uniform(0.75, 1.0)]  # slightly squashed
    elif kind == "arrow":  # shaft and head along +x, the box of its outline centred at the origin
        half, head = size / 2, size * rng.uniform(0.3, 0.45)
        head_w, shaft_w = size * rng.uniform(0.22, 0.32), size * rng.uniform(0.07, 0.13)
        neck = half - head
        pts = np.array(
            [[-half, -shaft_w], [neck, -shaft_w], [neck, -head_w], [half, 0.0],
             [neck, head_w], [neck, shaft_w], [-half, shaft_w]]
        )  # fmt: skip
    else:
        raise ValueError(f"unknown shape kind {kind!r}; expected one of {list(_CATALOGUE_IDS)}")
    c, s = math.cos(angle), math.sin(angle)
    return pts @ np.array([[c, s], [-s, c]]), ellipse  # rotated by angle


def _rasterise(
    polygon: np.ndarray, ellipse: tuple | None, x0: int, y0: int, x1: int, y1: int, centre: np.ndarray
) -> np.ndarray:
    """Mask of the pixels of ``[y0:y1, x0:x1]`` whose centres lie inside (even-odd rule, ellipses exact)."""
    py = np.arange(y0, y1, dtype=np.float64)[:, None] + 0.5  # (h, 1)
    px = np.arange(x0, x1, dtype=np.float64)[None, :] + 0.5  # (1, w)
    if ellipse is not None:
        a, b, angle = ellipse
        dx, dy, c, s = px - centre[0], py - centre[1], math.cos(angle), math.sin(angle)
        return ((dx * c + dy * s) / a) ** 2 + ((-dx * s + dy * c) / b) ** 2 <= 1.0
    inside = np.zeros((y1 - y0, x1 - x0), dtype=bool)
    nxt = np.roll(polygon, -1, axis=0)
    for (ax, ay), (bx, by) in zip(polygon, nxt, strict=True):
        if ay == by:
            continue
        crosses = (ay > py) != (by > py)  # (h, 1)
        x_int = ax + (py - ay) * (bx - ax) / (by - ay)  # (h, 1)
        inside ^= crosses & (px < x_int)
    return inside


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
        x0, y0 = max(0, math.floor(centre[0] - ex)), max(0, math.floor(centre[1] - ey))
        x1, y1 = min(width, math.ceil(centre[0] + ex) + 1), min(height, math.ceil(centre[1] + ey) + 1)
        mask = _rasterise(polygon, ellipse, x0, y0, x1, y1, centre)
        region = img[y0:y1, x0:x1]
        under = region[mask].mean(axis=0) if mask.any() else np.full(3, 128.0)
        colour = rng.integers(0, 256, 3)  # redrawn (20 tries) until it differs clearly from the mean under it
        for _ in range(20):
            if np.abs(colour - under).sum() > 120:
                break
            colour = rng.integers(0, 256, 3)
        colour = colour.astype(np.uint8)
        region[mask] = colour
        owner[y0:y1, x0:x1][mask] = k
        drawn.append(ShapeObject(_CATALOGUE_IDS[kind], colour, polygon, int(mask.sum()), np.zeros(0, bool)))
    for k, obj in enumerate(drawn):
        obj.visible = owner == k
    return drawn


def _finish(rng: np.random.Generator, img: np.ndarray) -> np.ndarray:
    """Add uniform per-pixel noise in ``[-a, a]``, ``a`` from 3..14 (not Gaussian: docs/internals.md)."""
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
    """Image ``index`` of ``split`` ("train"/"val") as :func:`make_detection_dataset` renders it: (H, W, 3)
    uint8 RGB (before JPEG) and every shape drawn, in order. Extents log-uniform in ``[min_scale, max_scale]``
    times the short side (>= 10 px); kinds uniform over ``categories`` (``None``: :data:`SHAPE_CATEGORIES`);
    1..``max_objects`` shapes (none for every 20th index). Size, background, count and kinds are drawn first:
    another scale range keeps them (another ``max_objects`` keeps size and background)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    _check_args(min_size, max_size, min_scale, max_scale, max_objects)
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
    """``(image_size, image_size, 3)`` uint8 RGB: one shape of class ``class_index`` near the centre."""
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
    Raises ValueError for an empty set, a repeated name, or a name not in the catalogue."""
    if categories is None:
        return list(_KINDS)
    if isinstance(categories, str):
        raise ValueError(f"categories must be a list of shape names, got the string {categories!r}")
    names = [str(c) for c in categories]
    if not names or len(set(names)) != len(names) or not set(names) <= _CATALOGUE_IDS.keys():
        raise ValueError(
            f"categories must be distinct names from {list(_CATALOGUE_IDS)} (at least one), got {names}"
        )
    return [c for c in _CATALOGUE_IDS if c in names]


def dataset_folder_name(categories: Sequence[str] | None) -> str:
    """The folder name a class set's dataset goes to by convention: ``shapes`` for the default four (the
    demo's ``data/shapes``), else ``shapes_<names in id order>``, e.g. ``shapes_cross_hexagon_arrow``."""
    names = resolve_categories(categories)
    return "shapes" if names == _KINDS else "_".join(["shapes", *names])


def _check_args(min_size: int, max_size: int, min_scale: float, max_scale: float, max_objects: int) -> None:
    if not 32 <= min_size <= max_size:
        raise ValueError(f"need 32 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}")
    if not 0 < min_scale <= max_scale <= 1:
        raise ValueError(
            f"need 0 < min_scale <= max_scale <= 1 (fractions of the short side), "
            f"got min_scale={min_scale}, max_scale={max_scale}"
        )
    check_max_objects(max_objects)


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
            outline = [round(float(v), 2) for v in np.clip(obj.polygon, 0, [width, height]).flat]
            ann = dict(id=image_id * _ANN_ID_STRIDE + k, image_id=image_id, category_id=obj.category_id)
            ann |= dict(bbox=obj.bbox(), area=float(obj.visible.sum()), iscrowd=0, segmentation=[outline])
            annotations.append(ann)
    info = dict(description=f"ssd_lightning synthetic shapes, {split} split (seed {seed})", version="1.0")
    info |= dict(year=2024, contributor="ssd_lightning.data.shapes", date_created="")
    coco = dict(info=info, licenses=[], images=images, annotations=annotations)
    coco["categories"] = [dict(c) for c in SHAPE_CATALOGUE if c["name"] in names]
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
    """Generate a COCO-layout shapes detection dataset at ``root`` (must not exist or be empty). Image ids:
    train ``1..num_train``, val after them; annotation ids ``image_id * 10 + k``; images:
    :func:`render_detection_image`; categories: exactly ``categories``. ``max_objects_train`` (1..9) bounds
    training images only; val holds 1..:data:`MAX_OBJECTS`, so val scores keep their meaning."""
    if num_train < 0 or num_val < 0:
        raise ValueError(f"num_train and num_val must be >= 0, got {num_train} and {num_val}")
    _check_args(min_size, max_size, min_scale, max_scale, max_objects_train)
    names = resolve_categories(categories)
    render = dict(
        min_size=min_size, max_size=max_size, min_scale=min_scale, max_scale=max_scale, categories=names
    )
    params = dict(num_train=num_train, num_val=num_val, seed=seed, min_size=min_size, max_size=max_size)
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
    """Generate an ImageFolder shapes dataset ``root/{train,val}/<name>/*.jpg`` (:data:`SHAPE_CATEGORIES`)."""
    if num_train_per_class < 1 or num_val_per_class < 1:
        raise ValueError(
            f"num_train_per_class and num_val_per_class must be >= 1, "
            f"got {num_train_per_class} and {num_val_per_class}"
        )
    if image_size < 32:
        raise ValueError(f"image_size must be >= 32, got {image_size}")
    params = dict(num_train_per_class=num_train_per_class, num_val_per_class=num_val_per_class, seed=seed)
    params["image_size"] = image_size

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
    meta = json.loads((root / METADATA_FILE).read_text()) if (root / METADATA_FILE).is_file() else {}
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
    """Why the dataset at ``root`` cannot serve ``kwargs["categories"]`` (its annotation file's own, by name
    in id order: a folder never serves two class sets, whatever its metadata says), or ``None``."""
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


def _ensure(root: str | os.PathLike, kind: str, kwargs: dict) -> Path:
    root, detection = Path(root), kind == "detection"
    if _occupied(root):
        problem = _detection_problem if detection else _classification_problem
        if (issue := problem(root)) is not None:
            raise DatasetConflictError(
                f"{root} exists but is not a complete shapes {kind} dataset: {issue}. "
                f"If it is left over from an interrupted or older run, delete {root} and run again; "
                f"otherwise pass a different path."
            )
        if detection and (issue := _category_conflict(root, kwargs)) is not None:
            raise DatasetConflictError(issue)
        if (root / METADATA_FILE).is_file() and kwargs:  # some keys are recorded only when not the default
            old = {**_UNRECORDED_DEFAULTS, **json.loads((root / METADATA_FILE).read_text())}
            # categories: checked by _category_conflict
            differ = {k: (old.get(k), v) for k, v in kwargs.items() if k != "categories" and old.get(k) != v}
            if differ:
                log.warning(
                    f"Reusing shapes {kind} dataset at {root} generated with different settings "
                    f"(existing, requested): {differ}; delete it to regenerate"
                )
        return root
    start = time.perf_counter()
    (make_detection_dataset if detection else make_classification_dataset)(root, **kwargs)
    log.info("Generated shapes %s dataset at %s in %.1f s", kind, root, time.perf_counter() - start)
    return root


def ensure_detection_dataset(root: str | os.PathLike, **kwargs) -> Path:
    """Return ``root``, generating it with :func:`make_detection_dataset` (``**kwargs``) if it does not exist;
    one of other sizes, scales or counts is reused with a warning. FileExistsError when ``root`` is not a
    complete COCO-layout dataset or (``categories`` given) lists other categories."""
    if "categories" in kwargs:
        resolve_categories(kwargs["categories"])  # a bad name is a ValueError before anything is read
    return _ensure(root, "detection", kwargs)


def ensure_classification_dataset(root: str | os.PathLike, **kwargs) -> Path:
    """Return ``root``, generating it with :func:`make_classification_dataset` if it does not exist (raises
    FileExistsError when ``root`` is not a complete ImageFolder shapes dataset)."""
    return _ensure(root, "classification", kwargs)
