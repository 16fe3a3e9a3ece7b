"""ssd_lightning.io.atomic: a file appears whole or not at all."""

from __future__ import annotations

import csv

import pytest

from ssd_lightning.io.atomic import atomic_write, atomic_write_json, atomic_write_text


def test_writes_replace_whole_files_and_leave_no_temporaries(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_json(path, {"a": [1, 2]}, indent=1)
    assert path.read_text() == '{\n "a": [\n  1,\n  2\n ]\n}'
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]


def test_a_failing_writer_keeps_the_previous_file(tmp_path):
    path = atomic_write_text(tmp_path / "a.txt", "old")

    def half_then_fail(f):
        f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_csv_rows_keep_their_line_endings(tmp_path):
    def write(f):
        writer = csv.writer(f)
        writer.writerow(["a", "b\nc"])  # a quoted newline inside a field

    path = atomic_write(tmp_path / "m.csv", write)
    assert path.read_bytes() == b'a,"b\nc"\r\n'
    assert list(csv.reader(path.open(newline=""))) == [["a", "b\nc"]]


def test_files_get_the_mode_a_plain_open_gives_and_bytes_work(tmp_path):
    import os

    plain = tmp_path / "plain"
    plain.write_text("x")
    path = atomic_write(tmp_path / "a.bin", lambda f: f.write(b"\x00\xff"), binary=True)
    assert path.read_bytes() == b"\x00\xff"
    # mkstemp's files are owner-only (0600): a shared run folder or a container's mounted output needs more
    assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777
