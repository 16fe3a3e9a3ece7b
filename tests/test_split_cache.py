"""The COCO split check runs once per unchanged dataset and machine, and still catches every changed file."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ssd_lightning.data import coco_validation
from ssd_lightning.data.coco_validation import check_coco_split
from ssd_lightning.errors import DataError
from tests.helpers import REPO_ROOT, ProcessGroup, requires_dali

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:.*extending slightly outside their image:UserWarning"),
]


def _fixture_module():
    spec = importlib.util.spec_from_file_location(
        "make_fixture", REPO_ROOT / "benchmarks" / "make_coco_scale_fixture.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _backdate(*paths: Path, seconds: float = 60.0) -> None:
    """Files written just now are not cached (coarse mtime ticks); tests make them look older."""
    when = time.time() - seconds
    for path in paths:
        os.utime(path, (when, when))


@pytest.fixture(scope="module")
def coco_small(tmp_path_factory) -> Path:
    """COCO-shaped data with polygon and RLE segmentations, COCO's 80 category ids, 3 boxes 1 px outside."""
    root = tmp_path_factory.mktemp("coco_small") / "coco"
    args = ["--out", str(root), "--train-images", "40", "--val-images", "8", "--outside", "3"]
    assert _fixture_module().main(args) == 0
    return root


@pytest.fixture
def split(coco_small, tmp_path):
    """(image_dir, annotation_file, cache_dir): a private copy of the train split's JSON, backdated."""
    ann = tmp_path / "instances_train2017.json"
    ann.write_bytes((coco_small / "annotations" / "instances_train2017.json").read_bytes())
    _backdate(ann, coco_small / "train2017")
    return coco_small / "train2017", ann, tmp_path / "cache"


def _count_checks(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = coco_validation._check_split

    def counted(image_dir, annotation_file, *args):
        calls.append(annotation_file)
        return real(image_dir, annotation_file, *args)

    monkeypatch.setattr(coco_validation, "_check_split", counted)
    return calls


def test_fixture_is_coco_shaped(coco_small):
    data = json.loads((coco_small / "annotations" / "instances_train2017.json").read_text())
    assert len(data["images"]) == 40 and len(data["categories"]) == 80
    assert [c["id"] for c in data["categories"]][-3:] == [88, 89, 90]
    segs = [a["segmentation"] for a in data["annotations"]]
    assert all(isinstance(s, list) and len(s[0]) == 44 for s in segs if not isinstance(s, dict))
    names = {p.name for p in (coco_small / "train2017").iterdir()}
    assert names == {im["file_name"] for im in data["images"]}


def test_polygons_are_not_parsed_but_everything_else_is(split):
    _, ann, _ = split
    original = json.loads(ann.read_text())
    loaded = coco_validation.read_annotation_json(ann)
    for a in original["annotations"]:
        if not isinstance(a["segmentation"], dict):  # polygons become [], RLE dicts are kept
            a["segmentation"] = []
    assert loaded == original


def test_cache_hit_reads_no_json_and_gives_the_same_result(split, monkeypatch):
    image_dir, ann, cache = split
    calls = _count_checks(monkeypatch)
    with pytest.warns(UserWarning, match="3 box\\(es\\) extending slightly outside"):
        first = check_coco_split(image_dir, ann, cache_dir=cache)
    assert first.num_clipped == 3 and first.reader_annotation_file.parent == cache
    assert first.category_map.category_ids[:12] == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13)

    def no_check(*args, **kwargs):
        raise AssertionError("the annotation file was read on a cache hit")

    real_loads = json.loads

    def loads(text, *args, **kwargs):  # the cache entry is JSON too; the annotation file must not be
        if (b'"annotations"' if isinstance(text, bytes | bytearray) else '"annotations"') in text:
            raise AssertionError("the annotation file was parsed on a cache hit")
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(coco_validation, "read_annotation_json", no_check)
    monkeypatch.setattr(json, "loads", loads)
    with pytest.warns(UserWarning, match="3 box\\(es\\) extending slightly outside"):  # same warnings
        second = check_coco_split(image_dir, ann, cache_dir=cache)
    assert second == first and len(calls) == 1


def test_changed_or_touched_file_is_checked_again(split, monkeypatch):
    image_dir, ann, cache = split
    calls = _count_checks(monkeypatch)
    check_coco_split(image_dir, ann, cache_dir=cache, check_files=False)
    os.utime(ann, (time.time() - 30, time.time() - 30))  # same content, other mtime
    check_coco_split(image_dir, ann, cache_dir=cache, check_files=False)
    assert len(calls) == 2

    data = json.loads(ann.read_text())
    data["annotations"][0]["category_id"] = 12  # not a COCO category id
    ann.write_text(json.dumps(data))
    _backdate(ann)
    with pytest.raises(DataError, match=f"annotation {data['annotations'][0]['id']} has category id 12"):
        check_coco_split(image_dir, ann, cache_dir=cache, check_files=False)
    with pytest.raises(DataError, match="has category id 12"):  # a failure is never cached
        check_coco_split(image_dir, ann, cache_dir=cache, check_files=False)
    assert len(calls) == 4


def test_files_written_just_now_are_not_cached(split, monkeypatch):
    image_dir, ann, cache = split
    calls = _count_checks(monkeypatch)
    os.utime(ann)  # mtime = now: an edit within the same mtime tick would look unchanged
    check_coco_split(image_dir, ann, cache_dir=cache, check_files=False)
    check_coco_split(image_dir, ann, cache_dir=cache, check_files=False)
    assert len(calls) == 2 and not list(cache.glob("split-*.json"))


def test_removed_image_and_unchecked_files_are_misses(split, tmp_path, monkeypatch):
    image_dir, ann, cache = split
    calls = _count_checks(monkeypatch)
    check_coco_split(image_dir, ann, cache_dir=cache, check_files=False)
    check_coco_split(image_dir, ann, cache_dir=cache, check_files=True)  # files not checked yet
    check_coco_split(image_dir, ann, cache_dir=cache, check_files=False)  # the stronger check serves
    assert len(calls) == 2
    moved = image_dir / sorted(os.listdir(image_dir))[0]
    os.rename(moved, tmp_path / moved.name)
    try:
        _backdate(image_dir)
        with pytest.raises(FileNotFoundError, match=f"do not exist: .*{moved.name}"):
            check_coco_split(image_dir, ann, cache_dir=cache)
    finally:
        os.rename(tmp_path / moved.name, moved)
        _backdate(image_dir)


def test_corrupt_entry_or_missing_clipped_copy_is_ignored_and_rewritten(split, monkeypatch):
    image_dir, ann, cache = split
    calls = _count_checks(monkeypatch)
    first = check_coco_split(image_dir, ann, cache_dir=cache)
    (entry,) = cache.glob("split-*.json")
    for damage in ('{"identity": ', '["a list"]', '{"identity": 1, "result": 2}'):
        entry.write_text(damage)
        assert check_coco_split(image_dir, ann, cache_dir=cache) == first
        assert json.loads(entry.read_text())["result"]["num_clipped"] == 3  # rewritten
    first.reader_annotation_file.unlink()
    assert check_coco_split(image_dir, ann, cache_dir=cache) == first
    assert first.reader_annotation_file.is_file() and len(calls) == 5
    check_coco_split(image_dir, ann, cache_dir=cache)
    assert len(calls) == 5


def test_datamodule_setup_and_category_map_come_from_the_cache(coco_small, tmp_path, monkeypatch):
    from ssd_lightning.data.categories import CategoryMap
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    _backdate(*coco_small.glob("*2017"), *(coco_small / "annotations").iterdir())
    kwargs = {"batch_size": 2, "device": "cpu", "cache_dir": tmp_path}
    first = CocoDALIDataModule(coco_small, **kwargs)
    first.setup("fit")

    def no_json(*args, **kwargs):
        raise AssertionError("read an annotation file")

    monkeypatch.setattr(coco_validation, "read_annotation_json", no_json)
    monkeypatch.setattr(CategoryMap, "from_coco", no_json)
    second = CocoDALIDataModule(coco_small, **kwargs)
    assert second.category_map == first.category_map and second.num_classes == 81
    second.setup("fit")
    assert second._splits == first._splits


@pytest.mark.dali
@requires_dali
def test_dali_reads_the_clipped_copy_with_emptied_polygons(coco_small, tmp_path):
    from ssd_lightning.data.coco_datamodule import CocoDALIDataModule

    dm = CocoDALIDataModule(coco_small, batch_size=4, device="cpu", cache_dir=tmp_path, shuffle=False)
    dm.setup("fit")
    info = dm._split("train")
    assert info.reader_annotation_file.parent == tmp_path
    clipped = json.loads(info.reader_annotation_file.read_text())["annotations"]
    assert {type(a["segmentation"]).__name__ for a in clipped} == {"list", "dict"}  # polygons [], RLE kept
    batch = next(iter(dm.make_loader("train")))
    assert batch["boxes"].shape == (4, 8732, 4) and batch["labels"].max() <= 80


_RANK = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from ssd_lightning.data import coco_validation

    image_dir, ann, counter, cache = sys.argv[1:5]
    real = coco_validation._check_split

    def slow_check(*args):
        with open(counter, "a") as f:
            f.write("check\\n")
        # every rank has entered check_coco_split, and 1.5 s more: the others wait for this check
        while ready.read_text().count("started") < int(os.environ["WORLD_SIZE"]):
            time.sleep(0.02)
        time.sleep(1.5)
        return real(*args)

    coco_validation._check_split = slow_check
    ready = Path(counter + ".ready")  # start together, whatever the import times were
    with open(ready, "a") as f:
        f.write("ready\\n")
    deadline = time.time() + 120
    while ready.read_text().count("ready") < int(os.environ["WORLD_SIZE"]) and time.time() < deadline:
        time.sleep(0.02)
    with open(ready, "a") as f:
        f.write("started\\n")
    info = coco_validation.check_coco_split(image_dir, ann, cache_dir=cache)
    counts = info.num_images, info.num_images_with_boxes, info.num_clipped
    print("RESULT", *counts, info.category_map.category_ids, info.reader_annotation_file)
    """
)


def _run_ranks(
    image_dir: Path, ann: Path, cache: Path, counter: Path, n: int = 2
) -> list[tuple[int, str, str]]:
    cmd = [sys.executable, "-c", _RANK, str(image_dir), str(ann), str(counter), str(cache)]
    with contextlib.ExitStack() as stack:
        ranks = [
            stack.enter_context(
                ProcessGroup(
                    cmd, env={"LOCAL_RANK": str(r), "RANK": str(r), "WORLD_SIZE": str(n)}, merge_stderr=False
                )
            )
            for r in range(n)
        ]
        done = [rank.finish(timeout=240) for rank in ranks]
    return [(d.returncode, d.stdout, d.stderr) for d in done]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_check_once_and_agree(split):
    image_dir, ann, cache = split
    counter = cache.parent / "checks.txt"
    results = _run_ranks(image_dir, ann, cache, counter)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    lines = [next(line for line in out.splitlines() if line.startswith("RESULT")) for _, out, _ in results]
    assert lines[0] == lines[1] and lines[0].startswith("RESULT 40 ")
    assert counter.read_text().count("check") == 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_both_fail_clearly_on_a_bad_file(split, monkeypatch):
    image_dir, ann, cache = split
    data = json.loads(ann.read_text())
    data["annotations"][1]["image_id"] = 999_999_999
    ann.write_text(json.dumps(data))
    _backdate(ann)
    counter = cache.parent / "checks.txt"
    results = _run_ranks(image_dir, ann, cache, counter)
    bad_id = data["annotations"][1]["id"]
    for rc, _, err in results:
        assert rc != 0
        assert f"DataError: annotation file {ann}: annotation {bad_id} references image id 999999999" in err
    assert counter.read_text().count("check") == 1  # the waiting rank raised the error the first one found
    calls = _count_checks(monkeypatch)
    with pytest.raises(DataError, match=f"annotation {bad_id} references image id 999999999"):
        check_coco_split(image_dir, ann, cache_dir=cache)
    assert len(calls) == 1  # a later run checks afresh (an image may have been fixed meanwhile)


def test_unusable_cache_folder_falls_back_to_temp_then_to_none(tmp_path, monkeypatch):
    from ssd_lightning.data.split_cache import writable_cache_dir

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.delenv("SSD_LIGHTNING_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # <file>/ssd_lightning cannot be created
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    assert writable_cache_dir() == tmp_path / "tmp" / f"ssd_lightning-{os.getuid()}"
    assert writable_cache_dir(blocker / "sub") is None  # an explicit cache_dir is not silently replaced
