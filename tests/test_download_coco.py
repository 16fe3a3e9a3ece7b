"""scripts/download_coco.sh, offline: a local HTTP server (with byte ranges) serves small COCO-layout zips.

The archives are made from the generated shapes dataset, so the extracted result is checked with the same
validation the COCO datamodule runs before building its pipelines.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import shutil
import subprocess
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssd_lightning.data.coco_validation import check_coco_split
from tests.helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "download_coco.sh"
# archive -> (URL path under the base URL, directory of the dataset it holds)
ARCHIVES = {
    "train2017.zip": ("zips/train2017.zip", "train2017"),
    "val2017.zip": ("zips/val2017.zip", "val2017"),
    "annotations_trainval2017.zip": ("annotations/annotations_trainval2017.zip", "annotations"),
}
LAYOUT_DIRS = ("train2017", "val2017", "annotations")


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with ``Range: bytes=N-`` support (as S3 has), recording every request's path and range."""

    log: list[tuple[str, str | None]]
    ranges: bool

    def do_GET(self) -> None:
        self.log.append((self.path, self.headers.get("Range")))
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "") if self.ranges else None
        start = int(match.group(1)) if match else 0
        if start >= len(data) and match:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if match else 200)
        if match:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(data[start:])

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server:
    def __init__(self, directory: Path) -> None:
        self.tree = directory
        self.log: list[tuple[str, str | None]] = []
        self.handler = type("Handler", (_RangeHandler,), {"log": self.log, "ranges": True})
        handler = self.handler
        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(directory))
        )
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def requested(self) -> list[str]:
        return [Path(path).name for path, _ in self.log]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _zip_dir(source: Path, archive: Path) -> None:
    """``archive`` holds ``source.name/...``, as COCO's zips hold ``train2017/...``."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive, "w") as zf:
        for file in sorted(source.rglob("*")):
            zf.write(file, file.relative_to(source.parent).as_posix())


@pytest.fixture(scope="module")
def served_tree(tmp_path_factory, shapes_coco) -> Path:
    """The three COCO archives of the shapes dataset at their images.cocodataset.org paths, + md5s.txt."""
    tree = tmp_path_factory.mktemp("coco_server")
    for url_path, directory in ARCHIVES.values():
        _zip_dir(shapes_coco / directory, tree / url_path)
    lines = [f"{_md5(tree / url_path)}  {name}" for name, (url_path, _) in ARCHIVES.items()]
    (tree / "md5s.txt").write_text("\n".join(lines) + "\n")
    return tree


@pytest.fixture
def server(served_tree: Path, tmp_path: Path) -> Iterator[_Server]:
    """A per-test copy of the tree (tests may corrupt it) behind a fresh server."""
    tree = tmp_path / "served"
    shutil.copytree(served_tree, tree)
    srv = _Server(tree)
    yield srv
    srv.close()


def _run(
    *args: str, base_url: str, md5_file: Path | None = None, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    environ = {**os.environ, "COCO_BASE_URL": base_url, **env}
    environ.pop("COCO_MD5_FILE", None)
    if md5_file is not None:
        environ["COCO_MD5_FILE"] = str(md5_file)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=environ, cwd=cwd, timeout=120
    )


def _fetch(server, downloader: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The script with ``downloader`` against the test server, checking its checksums."""
    return _run(
        *args, base_url=server.url, md5_file=server.tree / "md5s.txt", COCO_DOWNLOADER=downloader, **env
    )


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.glob(".extract-*")]


def test_script_parses_and_is_executable():
    assert os.access(SCRIPT, os.X_OK)
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_help_names_the_options_and_the_layout():
    result = _run("--help", base_url="http://unused.invalid")
    assert result.returncode == 0
    for text in (
        "--parts",
        "--download-dir",
        "--md5-file",
        "--delete-archives",
        "COCO_BASE_URL",
        "train2017",
    ):
        assert text in result.stdout, text


@pytest.mark.parametrize("args", [["--parts", "train,foo"], ["--frobnicate"], ["a", "b"]])
def test_bad_arguments_fail_before_touching_the_disk(tmp_path, args):
    result = _run(*args, base_url="http://unused.invalid", cwd=tmp_path)  # ROOT would be relative to it
    assert result.returncode != 0 and "error" in result.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("downloader", ["curl", "wget"])
def test_download_verify_extract_gives_the_datamodule_layout(server, tmp_path, shapes_coco, downloader):
    if shutil.which(downloader) is None:
        pytest.skip(f"{downloader} is not installed")
    root = tmp_path / "coco"
    result = _fetch(server, downloader, str(root))
    assert result.returncode == 0, result.stderr
    assert sorted(server.requested()) == sorted(ARCHIVES)
    for split in ("train", "val"):
        info = check_coco_split(root / f"{split}2017", root / "annotations" / f"instances_{split}2017.json")
        assert info.num_images == len(list((shapes_coco / f"{split}2017").iterdir()))
    first = sorted((shapes_coco / "val2017").iterdir())[0]
    assert (root / "val2017" / first.name).read_bytes() == first.read_bytes()
    assert sorted(p.name for p in (root / "downloads").iterdir()) == sorted(ARCHIVES)  # kept by default
    assert not _leftovers(root)

    # a second run finds every part and downloads nothing, even with the server gone
    again = _run(str(root), base_url="http://127.0.0.1:9", md5_file=server.tree / "md5s.txt")
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("skipping") == 3


@pytest.mark.parametrize("downloader", ["curl", "wget"])
def test_an_interrupted_download_resumes_with_a_byte_range(server, tmp_path, downloader):
    if shutil.which(downloader) is None:
        pytest.skip(f"{downloader} is not installed")
    root = tmp_path / "coco"
    full = (server.tree / "zips" / "val2017.zip").read_bytes()
    (root / "downloads").mkdir(parents=True)
    (root / "downloads" / "val2017.zip").write_bytes(full[: len(full) // 3])
    result = _fetch(server, downloader, "--parts", "val,annotations", str(root))
    assert result.returncode == 0, result.stderr
    assert ("/zips/val2017.zip", f"bytes={len(full) // 3}-") in server.log
    assert "train2017.zip" not in server.requested()
    assert sorted(p.name for p in root.iterdir()) == ["annotations", "downloads", "val2017"]


def test_delete_archives_removes_each_archive_after_extraction(server, tmp_path):
    root = tmp_path / "coco"
    result = _run(
        "--delete-archives",
        "--download-dir",
        str(tmp_path / "zips"),
        str(root),
        base_url=server.url,
        md5_file=server.tree / "md5s.txt",
    )
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "zips").iterdir()) == []
    assert all((root / d).is_dir() for d in LAYOUT_DIRS)


def test_a_corrupted_archive_is_a_clear_error_and_no_directory_appears(server, tmp_path):
    (server.tree / "zips" / "val2017.zip").write_bytes(b"PK\x03\x04 truncated by a proxy")
    root = tmp_path / "coco"
    result = _run(str(root), base_url=server.url, md5_file=server.tree / "md5s.txt")
    assert result.returncode != 0
    assert "MD5 mismatch" in result.stderr and "val2017.zip" in result.stderr
    # every archive is verified before any is extracted: not even the good train2017 appears
    assert not any((root / d).exists() for d in LAYOUT_DIRS)
    assert not (root / "downloads" / "val2017.zip").exists()  # deleted, so the next run starts afresh
    assert not _leftovers(root)


def test_the_built_in_checksums_reject_other_archives(server, tmp_path):
    """Without an md5 file the published MD5s apply; the fake archives must fail them."""
    root = tmp_path / "coco"
    result = _run("--parts", "val", str(root), base_url=server.url)
    assert result.returncode != 0
    assert "expected 442b8da7639aecaf257c1dceb8ba8c80" in result.stderr
    assert not (root / "val2017").exists()


def test_a_missing_checksum_fails_before_any_download(server, tmp_path):
    md5s = tmp_path / "partial.md5"
    md5s.write_text("".join(line + "\n" for line in (server.tree / "md5s.txt").read_text().splitlines()[:2]))
    result = _run(str(tmp_path / "coco"), base_url=server.url, md5_file=md5s)
    assert result.returncode != 0
    assert "no MD5 for annotations_trainval2017.zip" in result.stderr
    assert server.log == []


def test_a_failed_extraction_leaves_no_half_directory(server, tmp_path):
    """An archive that matches its MD5 but breaks half-way through unzip: val2017/ must not appear."""
    archive = server.tree / "zips" / "val2017.zip"
    with zipfile.ZipFile(archive) as zf:
        last = zf.infolist()[-1]
    data = bytearray(archive.read_bytes())
    data[last.header_offset + 30 + len(last.filename) + 10] ^= 0xFF  # a byte inside the last member
    archive.write_bytes(bytes(data))
    md5s = tmp_path / "md5s.txt"
    md5s.write_text(
        re.sub(
            r"^\S+(  val2017\.zip)$",
            rf"{_md5(archive)}\1",
            (server.tree / "md5s.txt").read_text(),
            flags=re.M,
        )
    )
    root = tmp_path / "coco"
    result = _run("--parts", "val", str(root), base_url=server.url, md5_file=md5s)
    assert result.returncode != 0
    assert "extracting" in result.stderr and "failed" in result.stderr
    assert not (root / "val2017").exists()
    assert not _leftovers(root)


@pytest.mark.parametrize("downloader", ["curl", "wget"])
def test_a_complete_archive_left_by_an_earlier_run_is_verified_and_extracted(server, tmp_path, downloader):
    """Extraction interrupted last time: the archive is whole, the server answers 416 to the resume."""
    if shutil.which(downloader) is None:
        pytest.skip(f"{downloader} is not installed")
    root = tmp_path / "coco"
    (root / "downloads").mkdir(parents=True)
    shutil.copy(server.tree / "zips" / "val2017.zip", root / "downloads" / "val2017.zip")
    result = _fetch(server, downloader, "--parts", "val", str(root))
    assert result.returncode == 0, result.stderr
    assert (root / "val2017").is_dir()


def test_a_server_without_byte_ranges_gets_a_fresh_download(server, tmp_path):
    server.handler.ranges = False  # answers 200 with the whole file to a Range request
    root = tmp_path / "coco"
    (root / "downloads").mkdir(parents=True)
    (root / "downloads" / "val2017.zip").write_bytes(b"the first bytes of another file")
    result = _run("--parts", "val", str(root), base_url=server.url, md5_file=server.tree / "md5s.txt")
    assert result.returncode == 0, result.stderr
    assert "downloading it again from the start" in result.stderr
    assert (root / "val2017").is_dir()
