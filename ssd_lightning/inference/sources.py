"""The images of a ``predict.py`` run: what ``input=`` names, each with the name its outputs are written
under, and their image ids in a COCO annotation file.

An :class:`InputImage`'s ``name`` is its path relative to the folder given (``a/b.jpg`` for
``input=photos/`` and ``photos/a/b.jpg``), to a glob's leading folder or to a list file's folder; a file
outside it, and a single file, by its file name. Names are POSIX paths without ``..`` (``<output>/<name>``
stays inside ``<output>``), recorded as ``predictions.json``'s ``file_name``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path, PurePosixPath
from typing import Any

from ssd_lightning.errors import DataError, MissingDataError

__all__ = [
    "IMAGE_EXTENSIONS",
    "InputImage",
    "collect_inputs",
    "load_annotation_file",
    "match_annotation_ids",
    "read_list_file",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
_GLOB_MAGIC = re.compile(r"[*?[]")
_SHOWN = 5  # names quoted in a message about many files


@dataclass(frozen=True)
class InputImage:
    """One input file: ``path`` to read, ``name`` (POSIX, relative, no ``..``) for its outputs."""

    path: Path
    name: str


def _named(path: Path, root: Path) -> InputImage:
    with contextlib.suppress(ValueError):
        relative = path.resolve().relative_to(root.resolve())
        if relative.parts:
            return InputImage(path, relative.as_posix())
    return InputImage(path, path.name)


def _first_of_each(images: Iterable[InputImage]) -> list[InputImage]:
    """A file named twice (same resolved path) kept at its first place."""
    unique: dict[Path, InputImage] = {}
    for image in images:
        unique.setdefault(image.path.resolve(), image)
    return list(unique.values())


def _folder_images(folder: Path, recursive: bool, exclude: Sequence[Path]) -> list[InputImage]:
    """Image files in ``folder`` (and below with ``recursive``), sorted by name; hidden ones and the
    subfolders in ``exclude`` skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        if not recursive:
            dirnames.clear()
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and (here / d).resolve() not in exclude]
        for name in filenames:
            path = here / name
            if not name.startswith(".") and path.suffix.lower() in IMAGE_EXTENSIONS:
                found.append(InputImage(path, path.relative_to(folder).as_posix()))
    return sorted(found, key=lambda item: item.name)


def read_list_file(list_file: str | os.PathLike) -> list[InputImage]:
    """The files a list file names, in order (a repeated path once): one path per line, relative to the
    list file's folder; blank lines and ``#`` lines skipped. MissingDataError: the list file or a listed
    file does not exist (the message names the first lines); DataError: a listed path is a folder."""
    list_file = Path(list_file)
    if not list_file.is_file():
        raise MissingDataError(f"input=@{list_file}: the list file does not exist")
    base, found, missing = list_file.parent, [], []
    for number, line in enumerate(list_file.read_text(encoding="utf-8-sig").splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        path = base / Path(entry).expanduser()  # an absolute path as it is
        if path.is_dir():
            raise DataError(
                f"{list_file}:{number}: {entry!r} is a folder; a list file names image files, one per line"
            )
        if not path.is_file():
            missing.append(f"{list_file}:{number} {entry!r}")
            continue
        found.append(_named(path, base))
    if missing:
        raise MissingDataError(
            f"input=@{list_file}: {len(missing)} listed file(s) do not exist, e.g. "
            f"{'; '.join(missing[:_SHOWN])} (relative paths are resolved against {base.resolve()}); "
            "fix or remove those lines"
        )
    return _first_of_each(found)


def collect_inputs(
    spec: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    recursive: bool = True,
    exclude: Iterable[str | os.PathLike] = (),
) -> list[InputImage]:
    """The images named by ``spec``, each once, in order (sorted by name within a folder or glob): an image
    file, a folder (with ``recursive`` its subfolders too; hidden ones and ``exclude`` skipped), a glob
    (``**`` matches subfolders), a list file (``@list`` or a ``*.txt``: :func:`read_list_file`), or a
    sequence of those. MissingDataError when nothing matched."""
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    skip = [Path(p).resolve() for p in exclude]
    found: list[InputImage] = []
    for item in specs:
        path = Path(item)
        if os.fspath(item).startswith("@"):
            found += read_list_file(os.fspath(item)[1:])
        elif path.suffix.lower() == ".txt" and path.is_file():
            found += read_list_file(path)
        elif path.is_file():
            found.append(InputImage(path, path.name))
        elif path.is_dir():
            found += _folder_images(path, recursive, skip)
        else:
            root = Path(*takewhile(lambda part: not _GLOB_MAGIC.search(part), path.parts[:-1]))  # a/**/*: a
            matches = sorted(Path(p) for p in glob.glob(os.fspath(item), recursive=True))
            found += [_named(p, root) for p in matches if p.is_file()]
    if not found:
        raise MissingDataError(
            f"input={spec!s}: no image files found; give an image, a folder of images, a glob in quotes "
            "or a list file (@list.txt)"
        )
    return _first_of_each(found)


def preview(names: Sequence[str], limit: int = _SHOWN) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def match_annotation_ids(
    images: Sequence[InputImage], dataset: Mapping[str, Any], *, where: str = "annotations"
) -> list[int]:
    """The image id of each of ``images`` in a COCO ``dataset``: the entry whose ``file_name`` is its
    ``name``, else the only entry with its basename. DataError (``where`` names the file) for no or an
    ambiguous match, or two images matching one entry."""
    entries = dataset.get("images")
    if not isinstance(entries, list):
        raise DataError(f"{where}: no 'images' list; is it a COCO instances file?")
    by_path: dict[str, int] = {}
    by_base: dict[str, list[int]] = {}  # file name -> the ids of the entries with it
    for entry in entries:
        file_name = PurePosixPath(str(entry["file_name"]).replace("\\", "/"))
        by_path[file_name.as_posix()] = int(entry["id"])
        by_base.setdefault(file_name.name, []).append(int(entry["id"]))
    ids, unmatched = [], []
    for image in images:
        same_base = by_base.get(PurePosixPath(image.name).name, [])
        if image.name in by_path:
            ids.append(by_path[image.name])
        elif len(same_base) == 1:
            ids.append(same_base[0])
        else:
            unmatched.append(image.name + (" (file name not unique there)" if same_base else ""))
    if unmatched:
        raise DataError(
            f"{where}: {len(unmatched)} of the {len(images)} input image(s) are not in its 'images' "
            f"(matched by path relative to the input folder, then by file name): {preview(unmatched)}; "
            "predict on the annotated images only (a list file, input=@list.txt) or leave out annotations="
        )
    if twice := [name for name, n in Counter(ids).items() if n > 1]:
        names = [image.name for image, i in zip(images, ids, strict=True) if i in set(twice)]
        raise DataError(
            f"{where}: several input images match the same image entry (same file name in different "
            f"folders): {preview(names)}; name them by their path relative to the annotation's file_name"
        )
    return ids


def load_annotation_file(path: str | os.PathLike) -> dict[str, Any]:
    """A COCO annotation file's parsed JSON; MissingDataError if missing, DataError if not a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"annotations={path}: the file does not exist; give a COCO instances JSON")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"annotations={path}: not a JSON file ({e})") from e
    if not isinstance(data, dict):
        raise DataError(f"annotations={path}: a COCO instances file is a JSON object")
    return data
