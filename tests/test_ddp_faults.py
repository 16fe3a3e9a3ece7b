"""One DDP rank failing (a corrupt image in its shard) ends the whole job promptly with that rank's message.

2 CPU processes (gloo) through `train.py` and Lightning's own launcher, as users run it; a subprocess with a
timeout, so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.helpers import launch_train_py, requires_dali

# a failing rank's path: DALI only carries the data
pytestmark = [pytest.mark.slow, pytest.mark.no_dali, pytest.mark.multiprocess, requires_dali]

# The job must end within this (10-20 s on a quiet 2-core box), not when the other rank's collective times out
# (30 min for gloo and NCCL): past it the test fails and the job is killed. No other wall-clock assertion.
TIMEOUT_S = 150


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_failing_rank_ends_the_job_with_its_message(failing_rank, shapes_coco, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(shapes_coco, root)
    images = json.loads((root / "annotations" / "instances_val2017.json").read_text())["images"]
    # validation shards are contiguous: rank 0 reads the first half of the file list, rank 1 the second
    victim = sorted(images, key=lambda im: im["id"])[0 if failing_rank == 0 else -1]["file_name"]
    path = root / "val2017" / victim
    # noise after a valid start, end marker kept: passes the start-up check (which sees the file's two ends),
    # so the failure comes from that rank's DALI decoder in the middle of the job
    data = path.read_bytes()
    noise = np.random.default_rng(1).integers(0, 255, len(data) - 22, dtype=np.uint8).tobytes()
    path.write_bytes(data[:20] + noise.replace(b"\xff\xd9", b"\xff\x00") + b"\xff\xd9")

    with launch_train_py(
        "experiment=demo",
        "task=validate",
        "trainer=ddp_cpu",
        f"data.root={root}",
        "logger=csv",
        f"hydra.run.dir={tmp_path / 'run'}",
    ) as job:
        done = job.finish(timeout=TIMEOUT_S)  # a hang fails here, its processes killed
        left = job.leftovers(within_s=20)  # no rank left behind (give exiting processes a moment)
    out = done.stdout
    assert done.returncode != 0, out[-3000:]
    assert f"[rank {failing_rank}] Error:" in out, out[-3000:]
    assert f"corrupt or truncated: {path}" in out
    # the other rank either says why it stops or is ended before it can (Lightning's launcher kills it)
    other = f"[rank {1 - failing_rank}]"
    assert f"{other} Stopped: another process of this job failed" in out or other not in out
    assert "Traceback" not in out, out[-3000:]
    assert left == [], left
