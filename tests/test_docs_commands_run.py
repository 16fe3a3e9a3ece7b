"""Every command README.md and docs/*.md print, run exactly as printed, in a fresh copy of the repository.

``test_readme_commands.py`` composes each command in-process and reads scripts' ``--help``; that cannot see
what only a real start shows (a sweep directory that fails to resolve, a script that crashes after parsing
its options). Here each command is given to ``bash -c`` as printed, in a clone of this repository (with the
working tree's changes on top and ``.venv`` linked), with the venv's ``python`` first on ``PATH``:

* **run**: exit 0 and no traceback. Commands that would run for minutes get size overrides *appended*
  (``SIZE``, ``SCRIPT_SIZE``: fewer images, epochs, iterations; never other settings). Placeholders are
  filled from real runs this test made first: ``outputs/<experiment>/<run>`` / ``<date>_<time>`` and
  ``<run>`` from the demo run, ``multirun/<date>/<time>`` from the newest sweep, ``photos/`` from the demo's
  validation images, ``/tmp/<name>`` with a folder of this test.
* **fails cleanly**: commands for data this machine does not have (COCO, ImageNet) or GPUs: composed with
  ``--cfg job`` (exit 0), then started as printed against the missing root: exit 1 or 2 with the project's
  ``Error:`` line, no traceback.
* **composed**: commands that would submit to SLURM or read NVIDIA's released checkpoint (a file that cannot
  exist here): ``--cfg job`` only.
* **not run** (``NOT_RUN``, by name, with the reason): commands that change the environment or run the suite
  itself.

Each distinct command line runs once: ``make train ARGS="..."`` is checked to be ``python train.py
experiment=demo ...`` (``make -n``, set-up current) and shares that run, and a ``train.py`` override given
twice (a printed value, then the size override) counts once, as Hydra takes the last. A command none of these
rules classifies fails the test. Runs once (``no_dali``), not per DALI line.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO_ROOT, compose_config
from tests.test_readme_commands import COMMANDS, Command

pytestmark = [pytest.mark.no_dali, pytest.mark.slow]

SUITE = "runs the test suite itself (CI runs `make test`)"
INSTALLS = "installs packages into the environment"
DOCKER = "needs a Docker engine (none here); test_readme_commands checks the Dockerfile and train.py command"
NVIDIA_FILE = "nvidia_ssdpyt_amp.pt"  # NVIDIA's released checkpoint: cannot exist on this machine
# Commands not run, by their text (comment removed, spaces collapsed), with the reason.
NOT_RUN: dict[str, str] = {
    "make test": SUITE,
    "make test-fast": SUITE,
    "make test-dali-lines": SUITE,
    "make test TEST_DALI_LINES=": SUITE,
    "make lint": "the first step of `make test`, which CI runs",
    "python benchmarks/stress_tests.py --repeat 20 --load 2 -m multiprocess": SUITE + ", repeatedly",
    "python benchmarks/stress_tests.py --repeat 20 --load 2 -- -m multiprocess tests/test_split_cache.py "
    "tests/test_throughput.py tests/test_ddp_faults.py": SUITE + ", repeatedly",
    "python benchmarks/stress_tests.py --repeat 3 --load 2 -- -m multiprocess "
    "tests/test_coco_map_callback.py tests/test_data_ddp.py tests/test_distributed.py "
    "tests/test_no_host_sync.py tests/test_signals_multiprocess.py": SUITE + ", repeatedly",
    "make setup EXTRAS=dev,cuda130": INSTALLS,
    "make setup EXTRAS=dev,cuda110": INSTALLS,
    'pip install -e ".[dev,cuda130]"': INSTALLS,
    'pip install -e ".[dev,sweeps]"': INSTALLS,
    'pip install -e ".[loggers]"': INSTALLS,
    "make setup": INSTALLS,
    "pip install -e .": INSTALLS,
    "bash benchmarks/gpu_benchmark.sh": "needs a CUDA GPU; test_gpu_benchmark_script runs its CPU smoke plan",
    "OUT=/tmp/gpu_results bash benchmarks/gpu_benchmark.sh --no-compile": "needs a CUDA GPU",
    "python benchmarks/benchmark_predict.py --device cuda --ckpt outputs/demo/<run>/checkpoints/last.ckpt": (
        "needs a CUDA GPU; tests/test_predict_gpu.py runs the GPU reading (its pieces on a CPU too)"
    ),
    "scripts/download_coco.sh /coco": "downloads 20 GB from COCO's servers; test_download_coco.py runs it "
    "against a local server",
    "scripts/torchrun_example.sh": "starts 8 ranks of a GPU recipe; test_readme_commands composes it",
    "torchrun --nproc-per-node 2 train.py ...": "'...' stands for any train.py arguments; torchrun runs "
    "are in test_distributed.py",
    "docker stop": "docker's own command, named as one of the things that send SIGTERM",
    "docker build -t ssd_lightning .": DOCKER,
    "docker run --gpus all --ipc=host -v /data/coco:/coco -v /data/runs:/workspace/ssd_lightning/outputs "
    "ssd_lightning python train.py experiment=ssd300_fp16_8gpu data.root=/coco": DOCKER,
    f"python scripts/export_onnx.py nvidia_checkpoint={NVIDIA_FILE} output=ssd300_coco.onnx": NVIDIA_FILE
    + " (NVIDIA's released checkpoint) cannot exist here",
}
# Appended to train.py runs that start a new run, by the composed task_name: sizes only.
SIZE: dict[str, list[str]] = {
    "demo": ["trainer.max_epochs=1", "data.num_train=24", "data.num_val=8"],
    "mobilenetv2_demo": ["trainer.max_epochs=1", "data.num_train_per_class=8", "data.num_val_per_class=4"],
    "benchmark_training": ["benchmark_warmup=0", "benchmark_iterations=1", "data.batch_size=2"],
    "benchmark_inference": ["benchmark_warmup=0", "benchmark_iterations=1"],
}
# Appended to scripts/<name>.py and benchmarks/<name>.py (argparse: the last value of an option wins): sizes
# only.
SCRIPT_SIZE: dict[str, list[str]] = {
    "scripts/plot_run.py": [],
    "scripts/module_map.py": [],  # rewrites the map only when it is stale (then test_layers fails too)
    "scripts/export_onnx.py": [],
    "benchmarks/benchmark_analysis.py": ["--images", "20", "--detections", "5"],
    "benchmarks/benchmark_cpu_step.py": [
        *("--batch", "2", "--warmup", "1", "--repeats", "1", "--variants", "w0.35", "w0.35+fp32dw"),
    ],
    "benchmarks/benchmark_demo.py": [
        *("--seeds", "1", "--override", "trainer.max_epochs=1"),
        *("--override", "data.num_train=24", "--override", "data.num_val=8"),
    ],
    "benchmarks/benchmark_host_memory.py": ["--rounds", "1", "--steps", "1", "--warmup", "1", "--batch", "2"],
    "benchmarks/benchmark_decoder.py": ["--batch-size", "2", "--repeats", "1", "--ref-repeats", "1"],
    "benchmarks/benchmark_loader.py": [
        *("--num-images", "48", "--batches", "2", "--warmup", "1", "--repeats", "1"),
    ],
    "benchmarks/make_coco_scale_fixture.py": ["--train-images", "40", "--val-images", "8"],
    "benchmarks/benchmark_startup.py": ["--ranks", "1", "--repeats", "1"],
    "benchmarks/benchmark_eval.py": ["--images", "16", "--repeats", "1"],
    "benchmarks/benchmark_training.py": [
        *("--batch-size", "2", "--warmup", "1", "--iterations", "1", "--repeats", "1", "--skip-variants"),
    ],
    "benchmarks/benchmark_finetune.py": [
        *("--source-epochs", "1", "--epochs", "1", "--num-train", "24", "--num-val", "8"),
        *("--override", "data.num_train=24", "--override", "data.num_val=8"),
    ],
    "benchmarks/benchmark_onnx.py": ["--batch-sizes", "1", "--repeats", "1", "--warmup", "0"],
    "benchmarks/benchmark_predict.py": [  # rows: the network, predict with pictures, ONNX (each a process)
        *("--small", "4", "--large", "2", "--rows", "'predict draw=true'", "'predict ONNX'"),
        "'predict replayed network'",
    ],
    "benchmarks/gpu_benchmark.py": [],  # documented with --dry-run: prints the plan, runs nothing
}
# Datamodules that read a dataset this machine does not have (the shapes ones generate theirs).
REAL_DATASETS = (
    "ssd_lightning.data.coco_datamodule.CocoDALIDataModule",
    "ssd_lightning.data.imagefolder_datamodule.ImageFolderDALIDataModule",
    "ssd_lightning.data.voc.VOCDALIDataModule",  # docs/own_data.md; tests/test_voc_yolo.py runs exports
    "ssd_lightning.data.yolo.YOLODALIDataModule",
)
README_SWEEP = "python train.py -m experiment=demo model.optimizer.lr=1e-3,3e-3 data.batch_size=8,16"
BENCHMARK_SWEEP = "python train.py -m experiment=ssd300_benchmark_inference data.eval_batch_size=2,4,8,16,32"
ERROR_LINE = re.compile(r"^(\[rank \d+\] )?Error: ", re.M)


@dataclass(frozen=True)
class Plan:
    kind: str  # "run" | "fails cleanly" | "composed" | "not run"
    why: str = ""
    size: tuple[str, ...] = ()


def normalised(text: str) -> str:
    """The command without its trailing ``# comment``, spaces collapsed."""
    return " ".join(re.sub(r"\s+#\s.*$", "", text).split())


def _train_overrides(words: list[str]) -> list[str]:
    """``key=value`` words after train.py, sweeps reduced to their first value (to compose one job)."""
    after = words[words.index("train.py") + 1 :]
    return [re.sub(r"=([^,\[\]()]+),[^\s]*$", r"=\1", w) for w in after if "=" in w and "<" not in w]


def classify(text: str) -> Plan:
    """How ``text`` is checked; raises for a command no rule covers."""
    command = normalised(text)
    if command in NOT_RUN:
        return Plan("not run", NOT_RUN[command])
    words = command.split()
    if words[0] == ".venv/bin/python":
        words[0] = "python"
    if words[0] in ("sbatch", "srun"):
        return Plan("not run", "needs SLURM; test_readme_commands checks the files it names")
    if words[:2] == ["make", "train"]:
        return Plan("run", size=tuple(SIZE["demo"]))
    if words[0] != "python":
        raise AssertionError(f"no rule for {text!r}: add one to test_docs_commands_run.py, or to NOT_RUN")
    script = words[1]
    if script in ("train.py", "predict.py") and NVIDIA_FILE in command:
        return Plan("composed", f"{NVIDIA_FILE} (NVIDIA's released checkpoint) cannot exist here")
    if script == "predict.py":
        return Plan("run")
    if script == "-m" and words[2] == "ssd_lightning.cli.benchmark":
        return Plan("run")
    if script in SCRIPT_SIZE:
        return Plan("run", size=tuple(SCRIPT_SIZE[script]))
    if script != "train.py":
        raise AssertionError(
            f"no rule for {text!r}: add the script to SCRIPT_SIZE, or the command to NOT_RUN"
        )
    if "hydra/launcher=slurm" in words:
        return Plan("composed", "submits SLURM jobs")
    if any(w.startswith(("resume=", "run_dir=")) for w in words) or "--cfg" in words:
        return Plan("run")  # the run's own config and size; or only printing the config
    cfg = compose_config([o.replace("'", "") for o in _train_overrides(words)])
    if cfg.data._target_ in REAL_DATASETS:
        root = next(
            (w.split("=", 1)[1] for w in words if w.startswith("data.root=")), "data/ of the checkout"
        )
        return Plan("fails cleanly", f"reads a dataset under {root}, which this machine does not have")
    if str(OmegaConf.select(cfg, "trainer.accelerator")) in ("gpu", "cuda"):
        return Plan("fails cleanly", "needs a CUDA GPU")
    assert cfg.task_name in SIZE, f"{text!r}: add size overrides for task_name={cfg.task_name} to SIZE"
    size = [*SIZE[cfg.task_name], *(["hydra.sweeper.n_trials=1"] if "sweep=demo_optuna" in words else [])]
    return Plan("run", size=tuple(size))


# ------------------------------------------------------------------------------------------- workspace
class Workspace:
    """A fresh copy of the repository where documented commands run; results cached by command text."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root, self.scratch = root, scratch
        self.results: dict[str, subprocess.CompletedProcess] = {}
        # not HYDRA_FULL_ERROR (users see one Error line), nor the make variables of a `make test` around us
        outside = ("HYDRA_FULL_ERROR", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")
        self.env = {k: v for k, v in os.environ.items() if k not in outside}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["PYTHONUNBUFFERED"] = "1"

    def bash(self, command: str, timeout: int = 900) -> subprocess.CompletedProcess:
        if command not in self.results:
            self.results[command] = subprocess.run(
                ["bash", "-c", command],
                cwd=self.root,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        return self.results[command]

    def run(self, command: str) -> subprocess.CompletedProcess:
        """``command`` (sized and filled) as the one run of its distinct command line."""
        if command.startswith("make train"):
            recipe = self.bash(f"make --no-print-directory -n {command.split(maxsplit=1)[1]}")
            _expect_success(recipe)
            assert recipe.stdout.splitlines()[-1].startswith(".venv/bin/python train.py "), _output(recipe)
            assert len(recipe.stdout.splitlines()) == 1, f"set-up would run first:\n{_output(recipe)}"
            command = recipe.stdout.strip().replace(".venv/bin/python", "python", 1)
        return self.bash(distinct(command))

    def run_documented(self, text: str) -> subprocess.CompletedProcess:
        """A documented command, sized and filled as its own test runs it (the same cached run)."""
        result = self.run(self.fill(sized(text, classify(text))))
        _expect_success(result)
        return result

    # -- what placeholders are filled with: made by documented commands on first use --------------------
    @functools.cached_property
    def demo_run(self) -> str:
        """``outputs/demo/<date>_<time>`` of the README's ``python train.py experiment=demo``."""
        result = self.run_documented("python train.py experiment=demo")
        (run,) = re.findall(r"Outputs in (\S+)", result.stdout + result.stderr)
        return str(Path(run).relative_to(self.root))

    def newest_sweep(self, holding: str, made_by: str) -> str:
        """The newest ``multirun/<date>/<time>`` with a file matching ``holding``; ``made_by`` makes one."""
        sweeps = [s for s in sorted(self.root.glob("multirun/*/*")) if any(s.glob(holding))]
        if not sweeps:
            self.run_documented(made_by)
            sweeps = [s for s in sorted(self.root.glob("multirun/*/*")) if any(s.glob(holding))]
        return str(sweeps[-1].relative_to(self.root))

    def fill(self, text: str) -> str:
        """Placeholders of ``text`` replaced by what this workspace has (made on first use)."""
        if "photos/" in text and not (self.root / "photos").is_dir():
            assert self.demo_run  # its data: the demo's validation images
            (self.root / "photos").mkdir()
            for image in sorted((self.root / "data" / "shapes" / "val2017").glob("*.jpg"))[:3]:
                shutil.copy(image, self.root / "photos" / image.name)
        if "onnx=model_e2e.onnx" in text and not (self.root / "model_e2e.onnx").is_file():
            self.run_documented(next(c.text for c in COMMANDS if "output=model_e2e.onnx" in c.text))
        fixture_needed = "/tmp/coco_scale" in text and "make_coco_scale_fixture" not in text
        if fixture_needed and not (self.scratch / "coco_scale").is_dir():
            self.run_documented(
                next(c.text for c in COMMANDS if "make_coco_scale_fixture.py --out" in c.text)
            )
        if "ssd_lightning.cli.benchmark multirun/<date>/<time>" in text:
            sweep = self.newest_sweep("*/benchmark.json", BENCHMARK_SWEEP)
            text = text.replace("multirun/<date>/<time>", sweep)
        if "multirun/<date>/<time>" in text or "RUN_A RUN_B" in text:
            # a sweep whose jobs trained (one that failed on a missing dataset has a summary.csv too)
            sweep = self.newest_sweep("*/csv/metrics.csv", README_SWEEP)
            text = text.replace("multirun/<date>/<time>", sweep)
            text = text.replace("RUN_A RUN_B", f"{self.demo_run} {sweep}/0")
        text = re.sub(r"outputs/\w+/(<run>|<date>_<time>)", lambda _: self.demo_run, text)
        if "<run>" in text or "<source-last.ckpt>" in text:
            text = text.replace("<run>", self.demo_run)
            text = text.replace("<source-last.ckpt>", f"{self.demo_run}/checkpoints/last.ckpt")
        text = text.replace("<partition>", "debug")
        text = re.sub(r"(?<![\w/])/tmp/", f"{self.scratch}/", text)
        assert not re.search(r"<[^<>\s]+>", text), f"unfilled placeholder in {text!r}"
        return text


def sized(text: str, plan: Plan) -> str:
    """``text`` without its comment, with the plan's size overrides appended (inside ``ARGS`` for make)."""
    command = normalised(text)
    size = " ".join(plan.size)
    if not size:
        return command
    if command.startswith("make train"):
        if 'ARGS="' in command:
            return re.sub(r'ARGS="([^"]*)"', lambda m: f'ARGS="{m.group(1)} {size}"', command)
        return f'{command} ARGS="{size}"'
    return f"{command} {size}"


def distinct(command: str) -> str:
    """A ``train.py`` command with each override once, where it last occurs (Hydra takes the last value)."""
    words = command.split()
    if "train.py" not in words:
        return command
    keys = [w.split("=", 1)[0] if "=" in w and not w.startswith("-") else None for w in words]
    return " ".join(w for i, w in enumerate(words) if keys[i] is None or keys[i] not in keys[i + 1 :])


def _output(result: subprocess.CompletedProcess) -> str:
    tail = f"--- stdout (end)\n{result.stdout[-3000:]}\n--- stderr (end)\n{result.stderr[-3000:]}"
    return f"$ {result.args[-1]}\n{tail}"


def _expect_success(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, _output(result)
    assert "Traceback" not in result.stdout + result.stderr, _output(result)


def _expect_clean_failure(result: subprocess.CompletedProcess) -> None:
    assert result.returncode in (1, 2), _output(result)
    assert ERROR_LINE.search(result.stderr), _output(result)
    assert "Traceback" not in result.stdout + result.stderr, _output(result)


def _as_compose_only(command: str) -> str:
    """The command printing its composed config instead of running (a multirun: its first job)."""
    words = [w for w in command.split() if w not in ("-m", "--multirun")]
    return " ".join(re.sub(r"^([\w./+~-]+=[^,\s]+),\S*$", r"\1", w) for w in words) + " --cfg job"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    """A clone of this repository (its history: benchmark scripts compare with old revisions) with the
    working tree's tracked and untracked files copied over it, and ``.venv`` linked."""
    root = tmp_path_factory.mktemp("docs") / "ssd_lightning"
    subprocess.run(["git", "clone", "--quiet", "--shared", str(REPO_ROOT), str(root)], check=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source, target = REPO_ROOT / name, root / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)  # keeps mtimes: make sees its set-up stamp as current
        elif target.exists():
            target.unlink()  # deleted in the working tree
    (root / ".venv").symlink_to(Path(sys.prefix))
    up_to_date = subprocess.run(["make", "-q", "setup"], cwd=root, capture_output=True)
    if up_to_date.returncode != 0:
        pytest.skip(
            "this venv was not set up by `make setup` with the default EXTRAS; `make train` would install"
        )
    scratch = tmp_path_factory.mktemp("scratch")
    return Workspace(root, scratch)


# ----------------------------------------------------------------------------------------------- tests
def _unique(commands: list[Command]) -> list[Command]:
    seen, unique = set(), []
    for command in commands:
        if normalised(command.text) not in seen:
            seen.add(normalised(command.text))
            unique.append(command)
    return unique


DOCUMENTED = _unique(COMMANDS)


def _is_harness(command: Command) -> bool:
    """A measurement harness of benchmarks/ that needs nothing another documented command makes."""
    words = normalised(command.text).split()
    return len(words) > 1 and words[1].startswith("benchmarks/") and "<" not in command.text


# run by test_docs_harnesses_run.py, in a workspace of its own: pytest-xdist runs the two files side by side
HARNESS_COMMANDS = [c for c in DOCUMENTED if _is_harness(c)]


@pytest.mark.parametrize("command", [c for c in DOCUMENTED if not _is_harness(c)], ids=lambda c: c.id)
def test_documented_command_runs_as_printed(command: Command, workspace: Workspace):
    check_documented(command, workspace)


def check_documented(command: Command, workspace: Workspace) -> None:
    """``command`` checked as its plan says: run, composed, or run against data this machine lacks."""
    plan = classify(command.text)
    if plan.kind == "not run":
        pytest.skip(f"not run: {plan.why}")
    if plan.kind == "composed":
        _expect_success(workspace.bash(_as_compose_only(workspace.fill(normalised(command.text)))))
        return
    text = workspace.fill(sized(command.text, plan))
    if plan.kind == "fails cleanly":
        _expect_success(workspace.bash(_as_compose_only(text)))
        _expect_clean_failure(workspace.bash(text))
        return
    _expect_success(workspace.run(text))


def test_not_run_entries_are_still_documented():
    stale = set(NOT_RUN) - {normalised(c.text) for c in COMMANDS}
    assert not stale, f"remove from NOT_RUN: {stale}"


def test_every_documented_kind_is_exercised():
    """The rules cover the docs' commands: each kind occurs, and the runs outnumber the rest."""
    plans = [classify(c.text) for c in DOCUMENTED]
    kinds = {
        kind: sum(p.kind == kind for p in plans) for kind in ("run", "fails cleanly", "composed", "not run")
    }
    assert all(kinds.values()), kinds
    assert kinds["run"] > kinds["fails cleanly"] + kinds["composed"] + kinds["not run"], kinds


@pytest.mark.parametrize(
    ("command", "error"),
    [
        ("tensorboard --logdir outputs", "no rule"),
        ("python scripts/no_such_benchmark.py --fast", "SCRIPT_SIZE"),
        ("python benchmarks/no_such_benchmark.py --fast", "SCRIPT_SIZE"),
        (
            "python train.py experiment=ssd300_benchmark_training_new",
            "experiment/ssd300_benchmark_training_new",
        ),
    ],
)
def test_an_unclassified_command_fails(command: str, error: str):
    with pytest.raises(Exception, match=re.escape(error)):
        classify(command)


def test_size_overrides_are_appended_not_substituted():
    plan = classify("python train.py experiment=demo")
    assert sized("python train.py experiment=demo   # ten minutes", plan) == (
        "python train.py experiment=demo trainer.max_epochs=1 data.num_train=24 data.num_val=8"
    )
    assert sized('make train ARGS="trainer.max_epochs=1"', classify("make train")).startswith(
        'make train ARGS="trainer.max_epochs=1 trainer.max_epochs=1 data.num_train=24'
    )
    assert classify("python train.py experiment=ssd300_fp16_8gpu data.root=/coco").kind == "fails cleanly"
    assert classify("python train.py").kind == "fails cleanly"  # the default data is COCO under data/coco
    assert distinct("python train.py experiment=demo trainer.max_epochs=4 seed=1 trainer.max_epochs=1") == (
        "python train.py experiment=demo seed=1 trainer.max_epochs=1"
    )
    assert (
        distinct("python x.py --override a=1 --override a=2") == "python x.py --override a=1 --override a=2"
    )
    assert _as_compose_only("python train.py -m experiment=demo model.optimizer.lr=1e-3,3e-3 seed=1") == (
        "python train.py experiment=demo model.optimizer.lr=1e-3 seed=1 --cfg job"
    )
