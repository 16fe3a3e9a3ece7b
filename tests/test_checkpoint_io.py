"""Checkpoints are written atomically: a failed or killed save never leaves a broken file under the name."""

from __future__ import annotations

import errno
import hashlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ssd_lightning.cli.train import train
from ssd_lightning.errors import CheckpointWriteError
from ssd_lightning.io import checkpoint_io
from ssd_lightning.io.checkpoint_io import AtomicCheckpointIO
from tests.helpers import SYNTHETIC_SSD_RUN, ProcessGroup, last_checkpoint, load_checkpoint, run_train_py


def _state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((256, 256), value)}, "epoch": int(value)}


def _half_then_fail(checkpoint, f):
    """A writer that fills the disk half-way through the file."""
    torch.save(checkpoint, f)
    f.truncate(f.tell() // 2)
    raise OSError(errno.ENOSPC, "No space left on device")


def test_round_trip(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(_state(1.0), tmp_path / "sub" / "last.ckpt")
    loaded = io.load_checkpoint(tmp_path / "sub" / "last.ckpt", weights_only=True)
    assert torch.equal(loaded["state_dict"]["w"], _state(1.0)["state_dict"]["w"])
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["last.ckpt"]


def test_disk_full_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(_state(1.0), path)
    before = path.read_bytes()
    monkeypatch.setattr(AtomicCheckpointIO, "_write", staticmethod(_half_then_fail))
    with pytest.raises(CheckpointWriteError) as info:
        io.save_checkpoint(_state(2.0), path)
    message = str(info.value)
    assert str(path) in message and "No space left on device" in message
    assert "previous last.ckpt is untouched" in message and "paths.output_dir" in message
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left


def test_a_disk_that_fills_during_torch_save_is_named_too(tmp_path, monkeypatch):
    """torch's writer reports a write that failed for want of space as a RuntimeError ("unexpected pos"):
    with the space gone it is the same one message; with space left it is a bug and stays itself."""
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(_state(1.0), path)

    def fails(checkpoint, f):
        torch.save(checkpoint, f)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 14792000 vs 14791892")

    monkeypatch.setattr(AtomicCheckpointIO, "_write", staticmethod(fails))
    free = iter([2**30, 1000])  # before the write: room for it; after: 1000 bytes left
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda _: usage._replace(free=next(free)))
    with pytest.raises(CheckpointWriteError, match=r"the disk is full \(it needs about 256 KiB, 1 KiB free"):
        io.save_checkpoint(_state(2.0), path)
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda _: usage._replace(free=2**30))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        io.save_checkpoint(_state(2.0), path)
    assert load_checkpoint(path)["epoch"] == 1 and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.fixture
def small_filesystem(tmp_path):
    """A tmpfs of its own (root's `mount`): a disk that really fills."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}): needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_train_py_on_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(small_filesystem, tmp_path):
    """A real full disk (a tmpfs shrunk to what epoch 0 left plus half a checkpoint), then the resume that
    must write the next checkpoint: one Error line with the folder and the space needed, files unchanged."""
    run = small_filesystem / "run"
    common = [*SYNTHETIC_SSD_RUN, "data.steps_per_epoch=2", "model.net.num_classes=5"]
    first = run_train_py(*common, "trainer.max_epochs=1", f"hydra.run.dir={run}")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run / "checkpoints"
    before = {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in checkpoints.iterdir()}
    used = shutil.disk_usage(small_filesystem).used
    half = (checkpoints / "last.ckpt").stat().st_size // 2
    subprocess.run(
        ["mount", "-o", f"remount,size={(used + half) // 1024}k", str(small_filesystem)], check=True
    )

    resumed = run_train_py(f"resume={run}", "trainer.max_epochs=2")
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    assert resumed.stderr.count("Error: ") == 1 and "Traceback" not in resumed.stderr
    line = next(x for x in resumed.stderr.splitlines() if x.startswith("Error: "))
    assert f"could not write checkpoint {checkpoints}/" in line and "No space left on device" in line
    assert re.search(r"needs about \d+ MiB, \d+ MiB free there", line), line
    assert {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in checkpoints.iterdir()} == before
    assert load_checkpoint(checkpoints / "last.ckpt")["epoch"] == 0


def test_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL a process in the middle of writing: the file under the name is the previous one, whole."""
    path = tmp_path / "last.ckpt"
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        from ssd_lightning.io.checkpoint_io import AtomicCheckpointIO

        def slow_write(checkpoint, f):
            torch.save(checkpoint, f)
            f.truncate(f.tell() // 2)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)

        io = AtomicCheckpointIO()
        io.save_checkpoint({{"w": torch.ones(256, 256)}}, {str(path)!r})
        AtomicCheckpointIO._write = staticmethod(slow_write)
        io.save_checkpoint({{"w": torch.zeros(256, 256)}}, {str(path)!r})
        """
    )
    with ProcessGroup([sys.executable, "-c", script], merge_stderr=False) as run:
        assert run.proc.stdout.readline().strip() == "writing"
        time.sleep(0.2)
        run.signal(signal.SIGKILL)
        run.finish(timeout=30)
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["w"], torch.ones(256, 256))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    assert leftovers == [f".last.ckpt.{run.proc.pid}.tmp"]  # only a kill -9 leaves this, never a .ckpt


@pytest.mark.slow
def test_disk_full_during_training_stops_with_the_last_good_checkpoint(tmp_path, monkeypatch, make_cfg):
    """Through train(): epoch 0 saves, epoch 1's save hits a full disk -> clear error, epoch 0's file kept."""
    calls = {"n": 0}
    real_write = AtomicCheckpointIO._write

    def full_on_second_save(checkpoint, f):
        calls["n"] += 1
        if calls["n"] >= 3:  # epoch 0 wrote epoch_0.ckpt and last.ckpt
            _half_then_fail(checkpoint, f)
        real_write(checkpoint, f)

    monkeypatch.setattr(AtomicCheckpointIO, "_write", staticmethod(full_on_second_save))
    # outputs in tmp_path
    cfg = make_cfg(
        [*SYNTHETIC_SSD_RUN, "data.steps_per_epoch=2", "model.net.num_classes=5", "trainer.max_epochs=2"]
    )
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        train(cfg)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch_0.ckpt", "last.ckpt"]
    saved = last_checkpoint(tmp_path)
    assert saved["epoch"] == 0 and saved["global_step"] == 2
