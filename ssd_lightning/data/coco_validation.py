"""Up-front checks of a COCO-layout split, before any DALI pipeline is built: :func:`check_coco_split`.

Reads the annotation file once (polygons skipped) and, with ``check_files``, each image's first and last
4 KiB. In short: boxes under 0.1 px are dropped, boxes slightly outside the image (``max(2 px, 2 %)``) are
clipped in a copy for DALI, others raise; missing, non-image and truncated files raise; size and EXIF
mismatches raise or warn; what labelling tools leave out is filled in a normalised copy (image ids ``1..N``)
that the reader and the evaluation share. Full policy: docs/internals.md; cached by :mod:`.split_cache`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.data.split_cache import SplitCache, writable_cache_dir
from ssd_lightning.errors import DataError, MissingDataError, UserError
from ssd_lightning.io.atomic import atomic_write_json

log = logging.getLogger(__name__)

__all__ = ["CocoSplitInfo", "check_coco_split", "check_image_headers", "check_mode_args", "exif_orientation"]
__all__ += ["read_annotation_json", "decoder_applies_exif_orientation", "find_undecodable_images"]

MIN_BOX_SIZE = 0.1  # px; DALI readers.coco default size_threshold
_MAGIC = {b"\xff\xd8\xff": "JPEG", b"\x89PNG\r\n\x1a\n": "PNG", b"BM": "BMP", b"II*\x00": "TIFF"}
_MAGIC[b"MM\x00*"] = "TIFF"  # big-endian
_MAX_LISTED = 5
_HEADER_BYTES = _TAIL_BYTES = 4096  # the tail: where a file's end marker must be (cameras append a few bytes)
_EXIF_ORIENTATION = 0x0112  # EXIF tag "Orientation"
SWAPS_SIDES = frozenset({5, 6, 7, 8})  # orientations that turn the image by 90 degrees
_INT32 = range(-(2**31), 2**31)  # DALI reads image ids as int32
_COPY_FORMAT = 2  # part of the copies' names: bump when what goes into a copy changes
# A polygon "segmentation" value: most of COCO's bytes, slow to parse, read by nothing here. On valid JSON
# this matches only that key (a bare "segmentation" followed by ':' cannot occur in a string).
_POLYGONS = re.compile(rb'"segmentation"\s*:\s*\[[-+0-9.eE,\s\[\]]*\]')
_FILLED = {  # what the normalised copy changed -> how the warning says it
    "image id": "ids 1..{n} for the {n} images, as not all were 32-bit integers (old ids in 'original_id')",
    "annotation id": "ids 1..{n} for the {n} annotations, as ids were missing, duplicated or not integers",
    "iscrowd": "iscrowd=0 for {n} annotation(s)",
    "area": "area=w*h of the box for {n} annotation(s)",
}
CHECK_MODES = ("error", "warn", "off")  # exif_check, size_check
_COUNTS = ("num_images", "num_images_with_boxes", "num_dropped", "num_clipped", "num_size_mismatches")
_NAMES = ("exif_listed_upright", "exif_listed_unrotated", "size_mismatches")  # file names
_NUMBER = frozenset({int, float})  # exact types: what json gives, without bool


@dataclass(frozen=True)
class CocoSplitInfo:
    """What :func:`check_coco_split` found; ``image_dir`` is what ``file_name`` entries are relative to."""

    image_dir: Path
    annotation_file: Path  # the original
    reader_annotation_file: Path  # for DALI: the original, or a normalised and/or clipped copy
    evaluation_annotation_file: Path  # the original, or the normalised copy (reader's image ids, unclipped)
    category_map: CategoryMap  # in DALI's order
    num_images: int
    num_images_with_boxes: int  # images with a box DALI keeps (what ``skip_empty`` leaves)
    num_dropped: int
    num_clipped: int
    filled: tuple[tuple[str, int], ...] = ()  # (what, how many) the normalised copy filled in (): no copy
    # file_name of the EXIF-rotated images listed with their upright size (what DALI 2.x decodes) / with
    # their stored size (turned 90 degrees, not square)
    exif_listed_upright: tuple[str, ...] = ()
    exif_listed_unrotated: tuple[str, ...] = ()
    size_mismatches: tuple[str, ...] = ()  # first 5 "file_name (listed WxH, file wxh)", EXIF-rotated excepted
    num_size_mismatches: int = 0


def _listing(items: Sequence[str], total: int | None = None) -> str:
    """The first 5 of ``items`` and how many more there are (of ``total``, default ``len(items)``)."""
    more = (len(items) if total is None else total) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f" (and {more} more)" if more > 0 else "")


def check_image_headers(paths: Iterable[Path], *, check_ends: bool = False) -> list[Path]:
    """Raise if a file is missing or does not start like an image DALI decodes (JPEG, PNG, BMP, TIFF, WebP),
    from its first 4 KiB (cheap at COCO's 118k images); ``check_ends``: also its last 4 KiB, to name files
    cut short. Returns the files that may carry an EXIF orientation (:func:`exif_orientation`)."""
    return _scan_files(paths, check_ends=check_ends)[0]


def _scan_files(
    paths: Iterable[Path], *, check_ends: bool, read_sizes: bool = False
) -> tuple[list[Path], dict[Path, tuple[int, int] | None]]:
    """Read each file's first (and with ``check_ends`` last) page; raise for unusable files (policy:
    docs/internals.md). Returns the EXIF candidates and, with ``read_sizes``, each file's (width, height)
    from its header (None: it does not tell)."""
    missing, bad, exif_candidates, sizes = [], [], [], {}
    suspects: list[tuple[Path, str]] = []
    for path in paths:
        try:
            head, end, size = _read_ends(path, check_ends)
        except FileNotFoundError:
            missing.append(str(path))
            continue
        except IsADirectoryError:
            bad.append(f"{path} (a directory)")
            continue
        kind = _image_kind(head)
        if kind is None:
            bad.append(f"{path} (starts with {head[:4]!r})")
            continue
        may_have_exif, size_read = _header_facts(kind, head)
        if read_sizes:
            sizes[path] = size_read
        if may_have_exif:
            exif_candidates.append(path)
        if check_ends and (why := _cut_short(kind, head, end, size)):
            suspects.append((path, why))
    truncated = []
    if suspects:  # trailers longer than a page (motion photos) look the same: let PIL decide
        log.info(
            "decoding %d image(s) without their end marker to see whether they are complete", len(suspects)
        )
        undecodable = dict(_undecodable(path for path, _ in suspects))
        truncated = [f"{p} ({why}; PIL: {undecodable[p]})" for p, why in suspects if p in undecodable]
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
    if truncated:
        raise DataError(
            f"{len(truncated)} image file(s) are corrupt or truncated: {_listing(truncated)}. Re-copy or "
            "re-download them, or remove their entries from the annotation file (DALI would decode the "
            "missing part of a truncated JPEG as grey)."
        )
    return exif_candidates, sizes


def _read_ends(path: Path, check_ends: bool) -> tuple[bytes, bytes, int]:
    """``(first page, last page or b"", size or 0)``: two reads at most, no seek (runs once per image)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.read(fd, _HEADER_BYTES)
        if not check_ends:
            return head, b"", 0
        if len(head) < _HEADER_BYTES or (size := os.fstat(fd).st_size) <= _HEADER_BYTES:  # read whole
            return head, head, len(head)
        start = max(size - _TAIL_BYTES, _HEADER_BYTES)
        end = os.pread(fd, size - start, start)
        return head, (head + end)[-_TAIL_BYTES:] if start == _HEADER_BYTES else end, size
    finally:
        os.close(fd)


def _cut_short(kind: str, head: bytes, end: bytes, size: int) -> str | None:
    """Why a file looks cut short, from its first and last pages (None: it does not)."""
    # FFD9 cannot occur in entropy-coded data (FF is stuffed there); rfind starts at the end, where it is
    if kind == "JPEG" and end.rfind(b"\xff\xd9") < 0:
        return f"no JPEG end marker FFD9 in its last {_TAIL_BYTES} bytes"
    if kind == "PNG" and end.rfind(b"IEND") < 0:
        return f"no PNG IEND chunk in its last {_TAIL_BYTES} bytes"
    if kind == "BMP" and len(head) >= 34:
        declared, pixels_end = int.from_bytes(head[2:6], "little"), 0
        if int.from_bytes(head[14:18], "little") >= 40 and int.from_bytes(head[30:34], "little") in (0, 3):
            width, height = (abs(int.from_bytes(head[i : i + 4], "little", signed=True)) for i in (18, 22))
            row = (int.from_bytes(head[28:30], "little") * width + 31) // 32 * 4  # uncompressed rows
            pixels_end = int.from_bytes(head[10:14], "little") + row * height
        if max(declared, pixels_end) > size:
            return f"{size} bytes, its BMP header says {max(declared, pixels_end)}"
    if kind == "WebP" and int.from_bytes(head[4:8], "little") + 8 > size:
        return f"{size} bytes, its RIFF header says {int.from_bytes(head[4:8], 'little') + 8}"
    return None


def _undecodable(paths: Iterable[Path]) -> Iterator[tuple[Path, str]]:
    """``(path, PIL's reason)`` for the files PIL cannot fully decode (at 1/8 scale)."""
    from PIL import Image

    for path in paths:
        try:
            with Image.open(path) as img:
                img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
                img.load()
        except Exception as exc:  # noqa: BLE001 - any failure means DALI will fail (or decode grey) too
            yield path, f"{type(exc).__name__}: {exc}"


def _header_facts(kind: str, head: bytes) -> tuple[bool, tuple[int, int] | None]:
    """``(may carry an EXIF orientation, (width, height) as stored or None)`` from a file's first page."""
    if kind == "JPEG":
        return _jpeg_header(head)
    if kind == "PNG" and head[12:16] == b"IHDR":
        return False, _positive(int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big"))
    if kind == "BMP" and len(head) >= 26:
        if int.from_bytes(head[14:18], "little") == 12:  # OS/2 BITMAPCOREHEADER
            width, height = int.from_bytes(head[18:20], "little"), int.from_bytes(head[20:22], "little")
            return False, _positive(width, height)
        width = int.from_bytes(head[18:22], "little", signed=True)
        return False, _positive(width, abs(int.from_bytes(head[22:26], "little", signed=True)))
    chunk = head[12:16]  # WebP's first chunk
    if kind == "WebP" and chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":  # lossy: EXIF needs VP8X
        width, height = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
        return False, _positive(width & 0x3FFF, height & 0x3FFF)
    if kind == "WebP" and chunk == b"VP8L" and head[20:21] == b"\x2f":  # lossless: 14 bits each, minus one
        bits = int.from_bytes(head[21:25], "little")
        return False, ((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if kind == "WebP" and chunk == b"VP8X" and len(head) >= 30:  # extended: flags (EXIF 0x08), size - 1
        size = (int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1)
        return bool(head[20] & 0x08), size
    return True, None  # TIFF, or a header not parsed here: PIL reads both


def _positive(width: int, height: int) -> tuple[int, int] | None:
    return (width, height) if width > 0 and height > 0 else None


def _image_kind(head: bytes) -> str | None:
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    return next((kind for magic, kind in _MAGIC.items() if head.startswith(magic)), None)


def _jpeg_header(head: bytes) -> tuple[bool, tuple[int, int] | None]:
    """Walk the header segments to the start of frame (SOF: width, height). EXIF is possible after an APP1
    ``Exif`` segment or past ``head``'s end (size unknown too: PIL reads both), not at the image data."""
    at, exif = 2, False  # after SOI
    while at + 4 <= len(head):
        if head[at] != 0xFF:
            return True, None  # not a marker where one should be: let PIL decide
        marker = head[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker == 0xDA:  # start of scan before a frame header: let PIL decide the size
            return exif, None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn: length, precision, h, w
            if at + 9 > len(head):
                return True, None
            height = int.from_bytes(head[at + 5 : at + 7], "big")
            return exif, _positive(int.from_bytes(head[at + 7 : at + 9], "big"), height)
        if marker == 0xE1 and head[at + 4 : at + 10] == b"Exif\x00\x00":
            exif = True
        at += 2 + int.from_bytes(head[at + 2 : at + 4], "big")
    return True, None


def exif_orientation(path: Path) -> tuple[int, tuple[int, int]] | None:
    """``(EXIF orientation, (width, height) as stored)``, None when PIL cannot read it. 1 is upright; 2-8 say
    how viewers turn or mirror the stored pixels (5-8 swap width and height); others count as 1."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
            size = img.size
    except Exception:  # noqa: BLE001 - unreadable: DALI's decoder names it (find_undecodable_images)
        return None
    return (orientation if orientation in range(1, 9) else 1), size


def decoder_applies_exif_orientation() -> bool:
    """Whether this DALI's decoders apply the EXIF orientation (2.x: yes, 1.34: no); tests patch it here."""
    from ssd_lightning.data.dali_compat import decoders_apply_exif_orientation

    return decoders_apply_exif_orientation()


def find_undecodable_images(paths: Iterable[Path]) -> list[str]:
    """``"path (PIL's reason)"`` of the files PIL cannot fully decode; slow: names a culprit DALI met."""
    return [f"{path} ({why})" for path, why in _undecodable(paths)]


def read_annotation_json(path: Path) -> dict[str, Any]:
    """The annotation file with every polygon ``segmentation`` replaced by ``[]`` (RLE ones are kept)."""
    text = _POLYGONS.sub(b'"segmentation": []', path.read_bytes())  # the whole file is freed before parsing
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


def _derived_copy(path: Path, data: dict[str, Any], out_dir: Path, kind: str) -> Path:
    """``data`` as ``out_dir/<stem>.<kind>.<key>.json``, keyed on ``path``'s path, size, mtime; reused."""
    stat = path.stat()
    where = f"{_COPY_FORMAT}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha1(where.encode()).hexdigest()[:16]
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{path.stem}.{kind}.{key}.json"
    if not out.exists():
        atomic_write_json(out, data)  # ranks writing the same content concurrently is fine
    return out


def check_coco_split(
    image_dir: str | os.PathLike,
    annotation_file: str | os.PathLike,
    *,
    check_files: bool = True,
    cache_dir: str | os.PathLike | None = None,
    exif_check: str = "error",
    size_check: str = "error",
) -> CocoSplitInfo:
    """Validate one COCO split and return what the pipelines need (policy: docs/internals.md); unchanged
    files reuse the result (:mod:`.split_cache`, in ``cache_dir``, also for the copies).

    ``check_files``: also check every listed image's file (exists, is an image, not cut short, EXIF, size).
    ``exif_check``/``size_check`` (``"error"``, ``"warn"``, ``"off"``): EXIF-rotated images whose boxes
    cannot line up with what this DALI decodes / images listed at another size than their file's ("warn"
    fits images resized proportionally after labelling). Raises MissingDataError (a FileNotFoundError) for a
    missing path, DataError (ValueError) for the rest.
    """
    check_mode_args(exif_check=exif_check, size_check=size_check)
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
        copies = Path(tempfile.gettempdir()) / "ssd_lightning_ann"
        info = _check_split(image_dir, annotation_file, check_files, copies)
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
    # the orientation depends on the DALI line, not only on the files: not cached; sizes are judged every call
    for key, mode, problem in (
        ("exif_check", exif_check, _orientation_mismatch(info)),
        ("size_check", size_check, _size_mismatch(info)),
    ):
        if problem and mode == "error":
            raise DataError(f"{problem}; data.{key}=warn trains anyway")
        if problem and mode == "warn":
            log.warning(problem)
    _warn_about_changes(info)
    return info


def _warn_about_changes(info: CocoSplitInfo) -> None:
    changes = []
    if info.filled:
        done = ", ".join(_FILLED[what].format(n=n) for what, n in info.filled)
        changes.append(
            f"filled in what the export leaves out: {done}; the reader and the COCO evaluation use the "
            f"normalised copy {info.evaluation_annotation_file}"
        )
    if info.num_dropped:
        changes.append(f"{info.num_dropped} box(es) narrower or lower than {MIN_BOX_SIZE} px are ignored")
    if info.num_clipped:
        changes.append(
            f"{info.num_clipped} box(es) extending slightly outside their image were clipped to it (the "
            "reader uses a clipped copy; evaluation uses the unclipped boxes)"
        )
    for change in changes:
        warnings.warn(f"{info.annotation_file}: {change}", stacklevel=3)


def check_mode_args(**modes: str) -> None:
    """Raise ``ValueError`` unless each value (``exif_check=``, ``size_check=``) is one of CHECK_MODES."""
    for name, value in modes.items():
        if value not in CHECK_MODES:
            raise ValueError(f"{name} must be one of {CHECK_MODES}, got {value!r}")


def _orientation_mismatch(info: CocoSplitInfo) -> str | None:
    oriented = info.exif_listed_upright + info.exif_listed_unrotated
    where = f"{info.annotation_file} (images in {info.image_dir})"
    if oriented and not decoder_applies_exif_orientation():
        from ssd_lightning.data.dali_compat import DALI_VERSION

        return (
            f"{where}: {len(oriented)} image(s) carry an EXIF orientation tag, which the decoders of DALI "
            f"{DALI_VERSION} ignore, while labelling tools draw the boxes on the upright image: "
            f"{_listing(oriented)}. Turn their pixels upright (e.g. `exiftran -ai FILE`, or PIL's "
            "ImageOps.exif_transpose and save) or use DALI 2.x, whose decoders apply the tag"
        )
    if info.exif_listed_unrotated:
        return (
            f"{where}: {len(info.exif_listed_unrotated)} image(s) carry an EXIF rotation and are listed with "
            "their stored width and height, but DALI decodes them upright (width and height swapped): "
            f"{_listing(info.exif_listed_unrotated)}. If their boxes were drawn on the upright image (what "
            "labelling tools show), swap 'width' and 'height' in these image entries; if on the stored "
            "pixels, remove the tag (`exiftool -Orientation= FILE`)"
        )
    return None


def _size_mismatch(info: CocoSplitInfo) -> str | None:
    if not info.num_size_mismatches:
        return None
    named = _listing(info.size_mismatches, info.num_size_mismatches)
    return (
        f"{info.annotation_file} (images in {info.image_dir}): {info.num_size_mismatches} image(s) are "
        f"listed with a width and height other than their file's: {named}. DALI reads the boxes relative "
        "to the listed size, so if they were drawn on the file's pixels they train wrongly scaled: fix "
        "'width' and 'height' in these image entries. If the images were resized proportionally after "
        "labelling, the boxes are still right relative to the listed size (the COCO evaluation's AP on "
        "these images is off: it compares listed pixels with detections in the file's pixels)"
    )


def _to_json(info: CocoSplitInfo) -> dict[str, Any]:
    return {
        "reader_annotation_file": str(info.reader_annotation_file.resolve()),
        "evaluation_annotation_file": str(info.evaluation_annotation_file.resolve()),
        "category_ids": list(info.category_map.category_ids),
        "names": list(info.category_map.names),
        "filled": [list(pair) for pair in info.filled],
        **{k: getattr(info, k) for k in _COUNTS},
        **{k: list(getattr(info, k)) for k in _NAMES},
    }


def _from_json(entry: dict[str, Any], image_dir: Path, annotation_file: Path) -> CocoSplitInfo | None:
    """The cached result, or None when it is malformed or a copy it names is gone."""
    try:
        counts = {k: int(entry[k]) for k in _COUNTS}
        names = {k: tuple(str(n) for n in entry[k]) for k in _NAMES}
        cmap = CategoryMap(tuple(map(int, entry["category_ids"])), tuple(map(str, entry["names"])))
        filled = tuple((str(what), int(n)) for what, n in entry["filled"])
        reader = Path(entry["reader_annotation_file"]) if counts["num_clipped"] or filled else annotation_file
        evaluation = Path(entry["evaluation_annotation_file"]) if filled else annotation_file
    except (KeyError, TypeError, ValueError):
        return None
    if not (reader.is_file() and evaluation.is_file()):  # a copy was deleted
        return None
    return CocoSplitInfo(
        image_dir, annotation_file, reader, evaluation, cmap, filled=filled, **counts, **names
    )


def _check_split(image_dir: Path, annotation_file: Path, check_files: bool, clip_dir: Path) -> CocoSplitInfo:
    data = read_annotation_json(annotation_file)
    if not data["categories"]:
        raise DataError(f"annotation file {annotation_file} has an empty 'categories' list")
    category_map = CategoryMap.from_coco(data, where=f"annotation file {annotation_file}")
    if not data["images"]:
        raise DataError(f"annotation file {annotation_file} lists no images; the split would be empty")
    filled = _normalise(data, annotation_file)
    sizes = _image_sizes(data["images"], annotation_file)
    upright, unrotated, mismatched = [], [], []
    if check_files:
        by_path = {image_dir / name: (w, h, name) for w, h, name in sizes.values()}
        candidates, header_sizes = _scan_files(by_path, check_ends=True, read_sizes=True)
        upright, unrotated, mismatched = _compare_sizes(by_path, candidates, header_sizes, annotation_file)
    clipped, kept, dropped = _check_boxes(data, sizes, category_map, image_dir, annotation_file)
    evaluation_file = reader_file = annotation_file
    if filled:  # before clipping: the evaluation reads the boxes as they were drawn
        evaluation_file = reader_file = _derived_copy(annotation_file, data, clip_dir, "normalised")
    for ann, bbox in clipped:
        ann["bbox"] = bbox
    if clipped:
        reader_file = _derived_copy(annotation_file, data, clip_dir, "clipped")
    return CocoSplitInfo(
        image_dir=image_dir,
        annotation_file=annotation_file,
        reader_annotation_file=reader_file,
        evaluation_annotation_file=evaluation_file,
        category_map=category_map,
        num_images=len(sizes),
        num_images_with_boxes=len(kept),
        num_dropped=dropped,
        num_clipped=len(clipped),
        filled=tuple(filled),
        exif_listed_upright=tuple(upright),
        exif_listed_unrotated=tuple(unrotated),
        size_mismatches=tuple(mismatched[:_MAX_LISTED]),
        num_size_mismatches=len(mismatched),
    )


def _compare_sizes(
    listed: dict[Path, tuple[float, float, str]],
    exif_candidates: list[Path],
    header_sizes: dict[Path, tuple[int, int] | None],
    annotation_file: Path,
) -> tuple[list[str], list[str], list[str]]:
    """Each image's listed size against its file's: the :class:`CocoSplitInfo` fields ``exif_listed_upright``,
    ``exif_listed_unrotated`` (raises for other rotated ones) and all the ``size_mismatches``."""
    oriented = {path: exif_orientation(path) for path in exif_candidates}
    upright, unrotated, neither, mismatched = [], [], [], []
    for path, (width, height, name) in listed.items():
        real = oriented.get(path)
        if real is not None and real[0] != 1:
            orientation, (stored_w, stored_h) = real
            upright_size = (stored_h, stored_w) if orientation in SWAPS_SIDES else (stored_w, stored_h)
            if (width, height) == upright_size:
                upright.append(name)
            elif (width, height) == (stored_w, stored_h):
                unrotated.append(name)
            else:
                upright_w, upright_h = upright_size
                neither.append(f"{name} (listed {width:g}x{height:g}, upright {upright_w}x{upright_h})")
            continue
        real = real[1] if real is not None else header_sizes.get(path)
        if real is None and (found := exif_orientation(path)) is not None:  # PIL reads the header
            real = found[1]
        if real is None:  # unreadable: DALI's decoder names it (find_undecodable_images)
            continue
        if abs(width - real[0]) >= 1 or abs(height - real[1]) >= 1:
            mismatched.append(f"{name} (listed {width:g}x{height:g}, file {real[0]}x{real[1]})")
    if neither:
        raise DataError(
            f"annotation file {annotation_file}: the listed width and height of {len(neither)} EXIF-rotated "
            f"image(s) are neither their upright nor their stored size: {_listing(neither)}; fix them"
        )
    return upright, unrotated, mismatched


def _is_int_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_box(bbox: Any) -> bool:
    """Four finite numbers (json reads ``NaN``/``Infinity`` as floats; DALI fails); unrolled: runs per box."""
    if type(bbox) is not list or len(bbox) != 4:
        return False
    x, y, w, h = bbox
    if not {type(x), type(y), type(w), type(h)} <= _NUMBER:
        return False
    return math.isfinite(x) and math.isfinite(y) and math.isfinite(w) and math.isfinite(h)


def _normalise(data: dict[str, Any], annotation_file: Path) -> list[tuple[str, int]]:
    """Fill in, in place, what minimal exports leave out (docs/internals.md); ``(what, how many)`` changed."""
    annotations = data["annotations"]
    for ann in annotations:
        if not isinstance(ann, dict):
            raise DataError(
                f"annotation file {annotation_file}: every entry of 'annotations' must be an object with "
                f"'image_id', 'category_id' and 'bbox', got {ann!r}"
            )
    changes = dict.fromkeys(_FILLED, 0)
    changes["image id"] = _renumber_images(data, annotation_file)
    ids = [ann.get("id") for ann in annotations]
    if not (all(_is_int_id(i) for i in ids) and len(set(ids)) == len(ids)):  # pycocotools needs unique ids
        for new_id, ann in enumerate(annotations, start=1):
            ann["id"] = new_id
        changes["annotation id"] = len(annotations)
    for ann in annotations:
        if "iscrowd" not in ann:
            ann["iscrowd"] = 0
            changes["iscrowd"] += 1
        if "area" not in ann and _is_box(ann.get("bbox")):
            ann["area"] = float(ann["bbox"][2]) * float(ann["bbox"][3])
            changes["area"] += 1
    return [(what, n) for what, n in changes.items() if n]


def _renumber_images(data: dict[str, Any], annotation_file: Path) -> int:
    """Give the images ids 1..N (old id in ``original_id``) unless all are integers DALI can read."""
    images = data["images"]
    old_ids = [img.get("id") if isinstance(img, dict) else None for img in images]
    if all(_is_int_id(i) and i in _INT32 for i in old_ids):
        return 0
    new_ids: dict[int | str, int] = {}
    for new_id, (img, old_id) in enumerate(zip(images, old_ids, strict=True), start=1):
        if not (_is_int_id(old_id) or isinstance(old_id, str)):
            raise DataError(
                f"annotation file {annotation_file}: image entry {img!r} needs an 'id' that is an integer "
                "or a string"
            )
        if old_id in new_ids:
            raise DataError(f"annotation file {annotation_file}: duplicate image id {old_id!r}")
        new_ids[old_id] = new_id
        img["original_id"], img["id"] = old_id, new_id
    for ann in data["annotations"]:
        old_id = ann.get("image_id")
        if (_is_int_id(old_id) or isinstance(old_id, str)) and old_id in new_ids:
            ann["image_id"] = new_ids[old_id]  # unknown ones stay: the box check names them
    return len(images)


def _image_sizes(images: list[Any], annotation_file: Path) -> dict[int, tuple[float, float, str]]:
    """``{image id: (width, height, file_name)}``; raises on malformed or duplicate entries."""
    sizes: dict[int, tuple[float, float, str]] = {}
    for img in images:
        try:
            iid, w, h, name = img["id"], float(img["width"]), float(img["height"]), str(img["file_name"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(
                f"annotation file {annotation_file}: image entry {img!r} needs 'id', 'file_name', "
                f"'width' and 'height' ({exc!r})"
            ) from exc
        if iid in sizes:
            raise DataError(f"annotation file {annotation_file}: duplicate image id {iid}")
        if isinstance(img["width"], str) or isinstance(img["height"], str):
            raise DataError(
                f"annotation file {annotation_file}: image {name} (id {iid}) lists width {img['width']!r} "
                f"and height {img['height']!r}; write them as numbers (DALI's parser rejects strings)"
            )
        if not (0 < w < math.inf and 0 < h < math.inf):  # also NaN
            raise DataError(f"annotation file {annotation_file}: image {name} (id {iid}) has size {w}x{h}")
        sizes[iid] = (w, h, name)
    return sizes


def _check_boxes(
    data: dict[str, Any],
    sizes: dict[int, tuple[float, float, str]],
    category_map: CategoryMap,
    image_dir: Path,
    annotation_file: Path,
) -> tuple[list[tuple[dict[str, Any], list[float]]], set[int], int]:
    """Check every annotation's image, category and box (docs/internals.md), changing nothing: returns the
    ``(annotation, clipped box)`` pairs, the ids of the images with a box kept, and how many are dropped."""
    clipped, with_boxes, dropped, valid_cats = [], set(), 0, set(category_map.category_ids)
    for ann in data["annotations"]:
        iid, cid, bbox = ann.get("image_id"), ann.get("category_id"), ann.get("bbox")
        if not isinstance(iid, int | str) or iid not in sizes:
            raise DataError(
                f"annotation file {annotation_file}: annotation {ann.get('id')} references image id {iid!r}, "
                "which is not in 'images'; fix or remove that annotation"
            )
        if not isinstance(cid, int | str) or cid not in valid_cats:
            raise DataError(
                f"annotation file {annotation_file}: annotation {ann.get('id')} has category id {cid!r}, "
                f"which is not in 'categories' {sorted(valid_cats)}"
            )
        iw, ih, name = sizes[iid]
        if not _is_box(bbox):
            raise DataError(
                f"annotation file {annotation_file}: annotation {ann.get('id')} (image {image_dir / name}) "
                f"needs bbox [x, y, w, h] of 4 finite numbers, got {bbox!r}"
            )
        x, y, bw, bh = (float(v) for v in bbox)
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
            clipped.append((ann, [left, top, right - left, bottom - top]))
            if right - left < MIN_BOX_SIZE or bottom - top < MIN_BOX_SIZE:
                dropped += 1
                continue
        with_boxes.add(iid)
    return clipped, with_boxes, dropped
