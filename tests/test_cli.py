"""The command line as README shows it: `python train.py ...` through @hydra.main, in a subprocess."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import run_script, run_train_py


def test_cfg_job_prints_the_composed_config():
    result = run_train_py("experiment=ssd300_fp16_8gpu", "--cfg", "job", timeout=600)
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert cfg["trainer"]["devices"] == 8 and cfg["trainer"]["precision"] == "16-mixed"
    assert cfg["data"]["batch_size"] == 64 and cfg["data"]["output_dtype"] == "float16"
    assert cfg["eval_epochs"] == [21, 31, 37, 42, 48, 53, 59, 64]


def test_composing_a_config_loads_neither_torch_nor_lightning():
    """`--cfg job`, `--help` and tab completion run train.py's module level only: the resolvers it registers
    must not pull in the training stack (seconds per call)."""
    code = (
        "import sys, runpy; sys.argv = ['train.py', 'experiment=demo', '--cfg', 'job']\n"
        "try:\n    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('torch', 'pytorch_lightning', 'nvidia.dali') if m in sys.modules)\n"
        "print('HEAVY', heavy)"
    )
    result = run_script("-c", code)
    assert result.returncode == 0, result.stderr
    assert "task_name: demo" in result.stdout
    assert result.stdout.strip().endswith("HEAVY []"), result.stdout[-500:]


def test_unknown_experiment_fails_with_the_accepted_names():
    result = run_train_py("experiment=ssd300_fp17", timeout=600)
    assert result.returncode == 1  # Hydra's composition error (README: 1 for anything but our config checks)
    assert "ssd300_fp16_8gpu" in result.stderr  # Hydra lists the available options


@pytest.mark.no_dali  # the run directory: DALI only carries the data
@pytest.mark.slow
def test_demo_run_writes_the_documented_run_directory(shapes_coco, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train_py(
        "experiment=demo",
        "debug=fast",
        f"data.root={shapes_coco}",
        "data.batch_size=4",
        f"hydra.run.dir={run_dir}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for path in (
        ".hydra/config.yaml",
        ".hydra/overrides.yaml",
        "demo.log",
        "csv/metrics.csv",
        "checkpoints/last.ckpt",
        "detections_epoch_0.json",
    ):
        assert (run_dir / path).is_file(), path
    saved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert saved["data"]["root"] == str(shapes_coco)
    assert "val/mAP" in (run_dir / "csv" / "metrics.csv").read_text()
    # train.py reuses host memory before torch runs (ssd_lightning/cli/host_memory.py)
    assert "host memory reused between steps" in (run_dir / "demo.log").read_text()
