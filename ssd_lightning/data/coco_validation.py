"""Cheap up-front checks of a COCO-layout split before any DALI pipeline is built.

DALI reports bad data late and vaguely (an assertion inside ``random_bbox_crop``, a decoder error that
does not always name the file). :func:`check_coco_split` reads the annotation file once in Python and
raises ``FileNotFoundError``/``ValueError`` that name the file and say what to do.

Policy for boxes (documented, tested):

* width or height below 0.1 px (zero, negative, degenerate): dropped, with ONE warning that counts them
  (DALI's ``readers.coco`` drops them itself through ``size_threshold=0.1``);
* extending outside the image by at most ``max(2 px, 2 % of the side)``: clipped to the image (COCO-style
  rounding), with ONE warning that counts them; the clipped copy of the annotation file is written to a
  cache directory and fed to DALI (``random_bbox_crop`` aborts the whole pipeline on out-of-image boxes);
* further outside than that: ``ValueError`` (the file is probably in another box format or the image
  sizes are wrong).

The COCO evaluation keeps reading the original file.

The check reads the whole file (~450 MB for COCO train2017; polygons are skipped unparsed) and one header
per image; its result is cached per machine while the files are unchanged, and concurrent processes (the
ranks of a node) wait for the first one's result: see :mod:`ssd_lightning.data.split_cache`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.data.split_cache import SplitCache, writable_cache_dir
from ssd_lightning.errors import DataError, MissingDataError, UserError

__all__ = ["CocoSplitInfo", "check_coco_split", "check_image_headers", "find_undecodable_images"]

MIN_BOX_SIZE = 0.1  # px; DALI readers.coco default size_threshold
_MAGIC = {
    b"\xff\xd8\xff": "JPEG",
    b"\x89PNG\r\n\x1a\n": "PNG",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
}
_MAX_LISTED = 5


@dataclass(frozen=True)
class CocoSplitInfo:
    """What :func:`check_coco_split` found.

    Attributes:
        image_dir: directory the ``file_name`` entries are relative to.
        annotation_file: the original annotation file (use this one for evaluation).
        reader_annotation_file: the file to give DALI (the original, or a clipped copy).
        category_map: labels <-> category ids in DALI's order.
        num_images: images listed.
        num_images_with_boxes: images with at least one box DALI keeps (what ``skip_empty`` leaves).
        num_dropped: boxes below 0.1 px dropped.
        num_clipped: boxes clipped to the image.
    """

    image_dir: Path
    annotation_file: Path
    reader_annotation_file: Path
    category_map: CategoryMap
    num_images: int
    num_images_with_boxes: int
    num_dropped: int
    num_clipped: int


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return shown + more


def check_image_headers(paths: Iterable[Path]) -> None:
    """Raise if a file is missing or does not start like an image DALI decodes (JPEG, PNG, BMP, TIFF, WebP).

    Reads 12 bytes per file, so it is cheap even for COCO's 118k images. Truncated files pass here; DALI's
    decoder names those when it meets them (see :func:`find_undecodable_images`).
    """
    missing, bad = [], []
    for path in paths:
        try:
            with open(path, "rb") as f:
                head = f.read(12)
        except FileNotFoundError:
            missing.append(str(path))
            continue
        except IsADirectoryError:
            bad.append(f"{path} (a directory)")
            continue
        is_webp = head[:4] == b"RIFF" and head[8:12] == b"WEBP"
        if not is_webp and not any(head.startswith(m) for m in _MAGIC):
            bad.append(f"{path} (starts with {head[:4]!r})")
    if missing:
        raise MissingDataError(
            f"{len(missing)} image file(s) listed in the annotations do not exist: {_listing(missing)}. "
            "Restore them or remove their entries from the annotation file."
        )
    if bad:
        raise DataError(
            f"{len(bad)} file(s) are not images DALI can decode (JPEG, PNG, BMP, TIFF, WebP): "
            f"{_listing(bad)}. Re-encode or remove them."
        )


def find_undecodable_images(paths: Iterable[Path]) -> list[str]:
    """Paths that PIL cannot fully decode (truncated or corrupt), each with PIL's reason.

    Slow (decodes every file at 1/8 scale); used only to name the culprit after DALI failed.
    """
    from PIL import Image

    bad = []
    for path in paths:
        try:
            with Image.open(path) as img:
                img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
                img.load()
        except Exception as exc:  # noqa: BLE001 - any failure means DALI will fail too
            bad.append(f"{path} ({type(exc).__name__}: {exc})")
    return bad


# A polygon list value of "segmentation" (numbers and brackets only). Polygons are ~2/3 of COCO's bytes and
# most of its numbers (slow to parse, ~2 GiB as Python floats for train2017), and nothing here reads them.
# On valid JSON this matches only that key: a bare "segmentation" followed by ':' cannot occur in a string.
_POLYGONS = re.compile(rb'"segmentation"\s*:\s*\[[-+0-9.eE,\s\[\]]*\]')


def _load_json(path: Path) -> dict[str, Any]:
    """The annotation file with every polygon ``segmentation`` replaced by ``[]`` (RLE ones are kept)."""
    raw = path.read_bytes()
    text = _POLYGONS.sub(b'"segmentation": []', raw)
    del raw  # ~0.4 GB for train2017: free it before parsing
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:  # report the position in the file, not in the stripped text (slow path: broken files only)
            data = json.loads(path.read_bytes())
        except json.JSONDecodeError as exc:
            raise DataError(
                f"annotation file {path} is not valid JSON ({exc}); re-download or regenerate it"
            ) from exc
    if not isinstance(data, dict):
        raise DataError(f"annotation file {path}: expected a JSON object with images/annotations/categories")
    missing = [k for k in ("images", "annotations", "categories") if not isinstance(data.get(k), list)]
    if missing:
        raise DataError(
            f"annotation file {path} lacks the COCO list(s) {missing}; a COCO detection file needs "
            "'images', 'annotations' and 'categories' (instances_*.json, not captions/keypoints)"
        )
    return data


def _clipped_copy(path: Path, data: dict[str, Any], out_dir: Path) -> Path:
    """Write ``data`` (boxes clipped, polygons empty: DALI reads boxes) for DALI, keyed on the original."""
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{path.stem}.clipped.{key}.json"
    if not out.exists():
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, out)  # atomic: ranks writing the same content concurrently is fine
    return out


def check_coco_split(
    image_dir: str | os.PathLike,
    annotation_file: str | os.PathLike,
    *,
    check_files: bool = True,
    cache_dir: str | os.PathLike | None = None,
) -> CocoSplitInfo:
    """Validate one COCO split and return what the pipelines need. See the module docstring for the policy.

    The result is cached (:mod:`ssd_lightning.data.split_cache`): while the annotation file and the image
    directory are unchanged, later calls (other ranks, later runs) read a small JSON instead of checking
    again, and concurrent calls for the same split wait for the first one instead of repeating it.

    Args:
        image_dir: directory the ``file_name`` entries are relative to.
        annotation_file: COCO instances JSON.
        check_files: also check that every listed image exists and starts like an image.
        cache_dir: where the check results and clipped copies go (default
            :func:`~ssd_lightning.data.split_cache.default_cache_dir`).

    Raises:
        FileNotFoundError: ``image_dir``, ``annotation_file`` or a listed image is missing.
        ValueError: unparsable JSON, missing COCO keys, no images, duplicate ids, annotations that
            reference unknown images or categories, malformed boxes, boxes far outside their image, files
            that are not images.
    """
    image_dir, annotation_file = Path(image_dir), Path(annotation_file)
    if not image_dir.is_dir():
        raise MissingDataError(
            f"image directory {image_dir} does not exist; point the datamodule's root (or train_images/"
            "val_images) at a COCO-layout dataset"
        )
    if not annotation_file.is_file():
        raise MissingDataError(
            f"annotation file {annotation_file} does not exist; expected <root>/annotations/"
            "instances_<split>.json or pass train_annotations/val_annotations"
        )
    folder = writable_cache_dir(cache_dir)
    if folder is None:
        info = _check_split(
            image_dir, annotation_file, check_files, Path(tempfile.gettempdir()) / "ssd_lightning_ann"
        )
    else:
        cache = SplitCache(folder, annotation_file, image_dir)
        with cache.locked():
            cached = cache.load(check_files=check_files)  # raises the error a process just found
            info = _from_json(cached, image_dir, annotation_file) if cached is not None else None
            if info is None:
                try:
                    info = _check_split(image_dir, annotation_file, check_files, folder)
                except UserError as exc:
                    cache.store_error(exc)  # the processes waiting for this one raise it too
                    raise
                cache.store(_to_json(info), files_checked=check_files)
    if info.num_dropped:
        warnings.warn(
            f"{annotation_file}: {info.num_dropped} box(es) narrower or lower than {MIN_BOX_SIZE} px are "
            "ignored",
            stacklevel=2,
        )
    if info.num_clipped:
        warnings.warn(
            f"{annotation_file}: {info.num_clipped} box(es) extending slightly outside their image were "
            "clipped to it (the reader uses a clipped copy; evaluation uses the original file)",
            stacklevel=2,
        )
    return info


def _to_json(info: CocoSplitInfo) -> dict[str, Any]:
    return {
        "reader_annotation_file": str(info.reader_annotation_file.resolve()),
        "category_ids": list(info.category_map.category_ids),
        "names": list(info.category_map.names),
        "num_images": info.num_images,
        "num_images_with_boxes": info.num_images_with_boxes,
        "num_dropped": info.num_dropped,
        "num_clipped": info.num_clipped,
    }


def _from_json(entry: dict[str, Any], image_dir: Path, annotation_file: Path) -> CocoSplitInfo | None:
    """The cached result, or None when it is malformed or its clipped copy is gone."""
    try:
        counts = {
            k: int(entry[k]) for k in ("num_images", "num_images_with_boxes", "num_dropped", "num_clipped")
        }
        cmap = CategoryMap(
            tuple(int(i) for i in entry["category_ids"]), tuple(str(n) for n in entry["names"])
        )
        reader = Path(entry["reader_annotation_file"]) if counts["num_clipped"] else annotation_file
    except (KeyError, TypeError, ValueError):
        return None
    if not reader.is_file():  # the clipped copy was deleted
        return None
    return CocoSplitInfo(image_dir, annotation_file, reader, cmap, **counts)


def _check_split(image_dir: Path, annotation_file: Path, check_files: bool, clip_dir: Path) -> CocoSplitInfo:
    """The check itself: reads the whole annotation file (and one header per image with ``check_files``)."""
    data = _load_json(annotation_file)
    category_map = CategoryMap.from_coco(data) if data["categories"] else None
    if category_map is None:
        raise DataError(f"annotation file {annotation_file} has an empty 'categories' list")
    if not data["images"]:
        raise DataError(f"annotation file {annotation_file} lists no images; the split would be empty")

    sizes: dict[int, tuple[float, float, str]] = {}
    for img in data["images"]:
        try:
            iid, w, h, name = img["id"], float(img["width"]), float(img["height"]), str(img["file_name"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(
                f"annotation file {annotation_file}: image entry {img!r} needs 'id', 'file_name', "
                f"'width' and 'height' ({exc!r})"
            ) from exc
        if iid in sizes:
            raise DataError(f"annotation file {annotation_file}: duplicate image id {iid}")
        if w <= 0 or h <= 0:
            raise DataError(f"annotation file {annotation_file}: image {name} (id {iid}) has size {w}x{h}")
        sizes[iid] = (w, h, name)
    if check_files:
        check_image_headers(image_dir / s[2] for s in sizes.values())

    valid_cats = set(category_map.category_ids)
    with_boxes: set[int] = set()
    dropped = clipped = 0
    for ann in data["annotations"]:
        iid, cid, bbox = ann.get("image_id"), ann.get("category_id"), ann.get("bbox")
        if iid not in sizes:
            raise DataError(
                f"annotation file {annotation_file}: annotation {ann.get('id')} references image id {iid}, "
                "which is not in 'images'; fix or remove that annotation"
            )
        if cid not in valid_cats:
            raise DataError(
                f"annotation file {annotation_file}: annotation {ann.get('id')} has category id {cid}, "
                f"which is not in 'categories' {sorted(valid_cats)}"
            )
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(isinstance(v, int | float) for v in bbox)):
            raise DataError(
                f"annotation file {annotation_file}: annotation {ann.get('id')} needs bbox [x, y, w, h], "
                f"got {bbox!r}"
            )
        x, y, bw, bh = (float(v) for v in bbox)
        iw, ih, name = sizes[iid]
        if bw < MIN_BOX_SIZE or bh < MIN_BOX_SIZE:
            dropped += 1
            continue
        tol_x, tol_y = max(2.0, 0.02 * iw), max(2.0, 0.02 * ih)
        if x < -tol_x or y < -tol_y or x + bw > iw + tol_x or y + bh > ih + tol_y:
            raise DataError(
                f"annotation file {annotation_file}: annotation {ann.get('id')} box {bbox} (x, y, w, h) lies "
                f"outside image {image_dir / name} of size {iw:g}x{ih:g} by more than 2 %; is the file in "
                "COCO's [x, y, width, height] pixel format, and are the image sizes right?"
            )
        left, top, right, bottom = max(x, 0.0), max(y, 0.0), min(x + bw, iw), min(y + bh, ih)
        if (left, top, right, bottom) != (x, y, x + bw, y + bh):
            clipped += 1
            ann["bbox"] = [left, top, right - left, bottom - top]
            if right - left < MIN_BOX_SIZE or bottom - top < MIN_BOX_SIZE:
                dropped += 1
                continue
        with_boxes.add(iid)

    reader_file = annotation_file
    if clipped:
        reader_file = _clipped_copy(annotation_file, data, clip_dir)
    return CocoSplitInfo(
        image_dir=image_dir,
        annotation_file=annotation_file,
        reader_annotation_file=reader_file,
        category_map=category_map,
        num_images=len(sizes),
        num_images_with_boxes=len(with_boxes),
        num_dropped=dropped,
        num_clipped=clipped,
    )
