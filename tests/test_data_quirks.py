"""Real-world dataset quirks that DALI reads without naming the file, or trains on silently wrong.

Each is caught by the start-up check (:func:`check_coco_split`, cached per machine) and named, also when
the check runs again: a JPEG or PNG cut short (DALI decodes the missing part grey), an image listed with
another size than its file's (DALI scales boxes by the listed size), a ``NaN`` or a string in a ``bbox``
(DALI's parser fails with an unrelated message). Data: the project's own shapes generator, copied per test
before it is damaged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from ssd_lightning.data import coco_validation
from ssd_lightning.data.coco_validation import check_coco_split, check_image_headers
from ssd_lightning.errors import DataError
from tests.helpers import run_train_py
from tests.test_split_cache import _backdate, _count_checks

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def root(shapes_coco, tmp_path) -> Path:
    """A private copy of the generated COCO-layout shapes dataset."""
    return Path(shutil.copytree(shapes_coco, tmp_path / "data"))


def _ann(root: Path) -> Path:
    return root / "annotations" / "instances_val2017.json"


def _images(root: Path) -> list[dict]:
    return json.loads(_ann(root).read_text())["images"]


def _edit(root: Path, fn) -> None:
    data = json.loads(_ann(root).read_text())
    fn(data)
    _ann(root).write_text(json.dumps(data))  # json writes float("nan") as NaN, as exporters do


def _backdate_split(root: Path) -> None:
    _backdate(_ann(root), root / "val2017")


def _check(root: Path, cache: Path, **kwargs):
    return check_coco_split(root / "val2017", _ann(root), cache_dir=cache, **kwargs)


def _cut(path: Path, fraction: float = 1 / 3) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


# ------------------------------------------------------------------------------- files cut short
def test_truncated_jpeg_is_named_cold_and_again(root, tmp_path, monkeypatch):
    victim = root / "val2017" / _images(root)[3]["file_name"]
    _cut(victim)
    _backdate_split(root)
    calls = _count_checks(monkeypatch)
    for _ in range(2):  # the second call finds the cache folder the first one used: the error is not hidden
        with pytest.raises(DataError, match=r"1 image file\(s\) are corrupt or truncated: ") as err:
            _check(root, tmp_path / "cache")
        assert f"corrupt or truncated: {victim} (no JPEG end marker FFD9" in str(err.value)
        assert "\n" not in str(err.value)
    assert len(calls) == 2  # a failed check is never cached as a pass


def test_an_undamaged_copy_passes_and_is_cached(root, tmp_path, monkeypatch):
    """Control: the undamaged copy passes, and the second call is served by the cache."""
    _backdate_split(root)
    calls = _count_checks(monkeypatch)
    first = _check(root, tmp_path / "cache")
    assert _check(root, tmp_path / "cache") == first
    assert len(calls) == 1 and first.num_size_mismatches == 0


@pytest.mark.parametrize("trailer", [b"\x00" * 16, b"camera maker note " * 600], ids=["16-bytes", "10-KiB"])
def test_jpeg_with_bytes_after_its_end_marker_passes(root, tmp_path, trailer):
    """Cameras append bytes after FFD9; more than the last page read (motion photos) is decoded to decide."""
    victim = root / "val2017" / _images(root)[0]["file_name"]
    victim.write_bytes(victim.read_bytes() + trailer)
    assert _check(root, tmp_path / "cache").num_images == len(_images(root))


def test_truncated_png_is_named(root, tmp_path):
    entry = _images(root)[2]
    jpeg = root / "val2017" / entry["file_name"]
    png = jpeg.with_suffix(".png")
    Image.open(jpeg).save(png)
    _edit(root, lambda d: d["images"][2].update(file_name=png.name))
    assert _check(root, tmp_path / "cache").num_images == len(_images(root))  # whole: fine
    _cut(png)
    with pytest.raises(DataError, match=r"corrupt or truncated: .*\.png \(no PNG IEND chunk") as err:
        _check(root, tmp_path / "cache")
    assert str(png) in str(err.value)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "WEBP"])
def test_every_format_gives_its_size_and_its_end(tmp_path, fmt):
    """Sizes come from the first page (no decode); a file cut to a third is named (PIL confirms it)."""
    path = tmp_path / f"img.{fmt.lower()}"
    Image.effect_noise((120, 90), 60).convert("RGB").save(path, fmt)
    exif_candidates, sizes = coco_validation._scan_files([path], check_ends=True, read_sizes=True)
    assert sizes[path] == (120, 90) and exif_candidates == []  # returned: nothing truncated (it raises)
    _cut(path)
    with pytest.raises(DataError, match=r"corrupt or truncated: .*img\."):
        check_image_headers([path], check_ends=True)
    assert check_image_headers([path]) == []  # without check_ends: headers only, as before


@pytest.mark.dali
def test_damage_the_check_cannot_see_is_named_by_dalis_decoder(root, tmp_path):
    """A JPEG with its start and end marker but noise between passes the start-up check (no decode there);
    DALI fails on it and the loader names the file (PIL decodes the split's files to find it)."""
    import numpy as np

    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    victim = root / "val2017" / _images(root)[5]["file_name"]
    data = victim.read_bytes()
    noise = np.random.default_rng(1).integers(0, 255, len(data) - 22, dtype=np.uint8).tobytes()
    victim.write_bytes(data[:20] + noise.replace(b"\xff\xd9", b"\xff\x00") + b"\xff\xd9")
    dm = CocoDALIDataModule(root, batch_size=2, device="cpu", cache_dir=tmp_path / "cache")
    dm.setup("validate")  # passes
    with pytest.raises(DataError, match=rf"corrupt or truncated: {victim}"):
        for _ in dm.val_dataloader():
            pass


# ------------------------------------------------------------------------------- listed size != file size
def _double_size(root: Path) -> tuple[str, str]:
    """List image 1 at twice its real size; returns its file_name and the expected listing."""
    entry = _images(root)[1]
    w, h = Image.open(root / "val2017" / entry["file_name"]).size
    assert (entry["width"], entry["height"]) == (w, h)
    _edit(root, lambda d: d["images"][1].update(width=2 * w, height=2 * h))
    return entry["file_name"], f"{entry['file_name']} (listed {2 * w}x{2 * h}, file {w}x{h})"


def test_image_listed_at_another_size_is_named(root, tmp_path):
    name, listing = _double_size(root)
    with pytest.raises(DataError, match=r"1 image\(s\) are listed with a width and height other than") as err:
        _check(root, tmp_path / "cache")
    message = str(err.value)
    assert listing in message and "relative to the listed size" in message
    assert "data.size_check=warn trains anyway" in message and "\n" not in message


def test_size_check_warn_and_off(root, tmp_path, caplog):
    _, listing = _double_size(root)
    with caplog.at_level("WARNING"):
        info = _check(root, tmp_path / "cache", size_check="warn")
    assert info.num_size_mismatches == 1 and info.size_mismatches == (listing,)
    assert [listing in r.getMessage() for r in caplog.records].count(True) == 1
    caplog.clear()
    with caplog.at_level("WARNING"):
        _check(root, tmp_path / "cache", size_check="off")
    assert not any("listed with a width and height" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="size_check must be one of"):
        _check(root, tmp_path / "cache", size_check="ignore")


def test_size_mismatch_is_judged_at_every_warm_start(root, tmp_path, monkeypatch):
    """Recorded in the cache entry: a warm start with size_check=error still raises, without re-checking."""
    _, listing = _double_size(root)
    _backdate_split(root)
    calls = _count_checks(monkeypatch)
    assert _check(root, tmp_path / "cache", size_check="off").num_size_mismatches == 1
    with pytest.raises(DataError, match="listed with a width and height other than") as err:
        _check(root, tmp_path / "cache")
    assert listing in str(err.value) and len(calls) == 1  # the second call was warm


def test_many_size_mismatches_are_listed_up_to_five(root, tmp_path):
    images = _images(root)

    def halve(d):
        for img in d["images"]:
            img["width"], img["height"] = img["width"] * 2, img["height"] * 2

    _edit(root, halve)
    with pytest.raises(DataError, match=rf"{len(images)} image\(s\) are listed") as err:
        _check(root, tmp_path / "cache")
    assert f"(and {len(images) - 5} more)" in str(err.value)
    assert str(err.value).count("(listed ") == 5


# ------------------------------------------------------------------------------- non-finite boxes
@pytest.mark.parametrize("value", [float("nan"), float("inf"), "12"], ids=["NaN", "Infinity", "string"])
def test_non_finite_or_non_numeric_bbox_names_the_annotation(root, tmp_path, value):
    data = json.loads(_ann(root).read_text())
    ann = data["annotations"][4]
    image = next(img for img in data["images"] if img["id"] == ann["image_id"])
    _edit(root, lambda d: d["annotations"][4]["bbox"].__setitem__(1, value))
    if isinstance(value, float):
        assert ("NaN" if value != value else "Infinity") in _ann(root).read_text()  # what json writes
    with pytest.raises(
        DataError, match=rf"annotation {ann['id']} \(image .*{image['file_name']}\) needs bbox"
    ):
        _check(root, tmp_path / "cache")


@pytest.mark.parametrize("damage", ["width as a string", "NaN in a bbox"])
@pytest.mark.dali
def test_dali_parse_errors_name_the_annotation_file(root, tmp_path, monkeypatch, damage):
    """Should a file the check passed still trip DALI's own parser, its error names the annotation file."""
    import dataclasses

    from ssd_lightning.data import coco_datamodule
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule
    from ssd_lightning.data.dali_compat import DALI_VERSION

    bad = tmp_path / "bad.json"
    data = json.loads(_ann(root).read_text())
    if damage == "width as a string":  # every DALI line's parser rejects it
        data["images"][0]["width"] = "640"
        said = "Error parsing JSON file"
    else:
        if int(DALI_VERSION.split(".")[0]) < 2:
            pytest.skip("DALI 1.34's parser reads a NaN box without complaint: the start-up check names it")
        data["annotations"][0]["bbox"][1] = float("nan")
        said = "Invalid COCO annotation: `bbox` must contain exactly 4 values"
    bad.write_text(json.dumps(data))

    def unchecked(*args, **kwargs):  # what the check would have passed on to DALI
        return dataclasses.replace(check_coco_split(*args, **kwargs), reader_annotation_file=bad)

    monkeypatch.setattr(coco_datamodule, "check_coco_split", unchecked)
    dm = CocoDALIDataModule(root, batch_size=2, device="cpu", cache_dir=tmp_path / "cache")
    dm.setup("validate")
    with pytest.raises(DataError, match=r"DALI could not parse the annotation file") as err:
        dm.make_loader("val")
    message = str(err.value)
    assert str(_ann(root)) in message and str(bad) in message
    assert said in message and "\n" not in message


# ------------------------------------------------------------------------------- the command line
@pytest.mark.slow
@pytest.mark.parametrize("quirk", ["truncated", "nan", "size"])
def test_cli_names_the_file_in_one_error_line(root, tmp_path, quirk):
    """`python train.py experiment=demo data=coco data.root=...` (the README's own-data command), damaged."""
    entry = _images(root)[3]
    if quirk == "truncated":
        _cut(root / "val2017" / entry["file_name"])
        expected = f"corrupt or truncated: {root / 'val2017' / entry['file_name']}"
    elif quirk == "nan":
        ann_id = json.loads(_ann(root).read_text())["annotations"][2]["id"]
        _edit(root, lambda d: d["annotations"][2]["bbox"].__setitem__(0, float("nan")))
        expected = f"annotation {ann_id} (image "
    else:
        _, expected = _double_size(root)
    result = run_train_py(
        "experiment=demo",
        "data=coco",
        f"data.root={root}",
        f"paths.output_dir={tmp_path / 'out'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=240,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_switch_values_are_checked_when_the_datamodule_is_made(tmp_path):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    with pytest.raises(
        ValueError, match=r"size_check must be one of \('error', 'warn', 'off'\), got 'sometimes'"
    ):
        CocoDALIDataModule(tmp_path, size_check="sometimes")


def test_width_or_height_written_as_a_string_names_the_image(root, tmp_path):
    data = json.loads(_ann(root).read_text())
    data["images"][2]["height"] = str(data["images"][2]["height"])
    _ann(root).write_text(json.dumps(data))
    name, iid = data["images"][2]["file_name"], data["images"][2]["id"]
    with pytest.raises(DataError, match=rf"image {name} \(id {iid}\) lists width .* as numbers"):
        _check(root, tmp_path / "cache")
