"""Every command README.md and docs/*.md show still works against the code, without running anything heavy.

Commands come from the shell-tagged fenced blocks (```bash) and from inline code that starts with a
command word (`python train.py ... --cfg job`, `make test-fast`, `pip install -e ".[cuda120]"`). Inline
overrides named in the prose (`trainer.max_epochs=1`, `model.channels_last=true`) are composed too: against
the default config or, for keys of another model or dataset, against one of the experiments.

* ``python train.py`` / ``python predict.py``: the overrides are composed by Hydra's compose API against
  ``configs/`` (``--cfg job`` without a subprocess), so a renamed experiment, group or key fails here.
  Multirun commands are expanded into their jobs, ready-made sweeps (``sweep=...``) included.
* ``python scripts/<x>.py`` / ``python benchmarks/<x>.py``: the script exists and ``--help`` works and
  lists the options used; the ``key=value`` scripts (no ``--help``) have every key checked against their
  ``DEFAULTS``.
* ``scripts/<x>.sh`` / ``benchmarks/<x>.sh``: exists, is executable, parses (``bash -n``); the options used
  are in its ``--help`` where it has one.
* ``make <target>``: the target exists; ``ARGS=...`` given to a target that runs ``train.py`` is composed.
* ``sbatch``/``srun``/``torchrun``/``docker``: the files they name exist (``docker build .``: the
  Dockerfile); a ``train.py`` among their arguments gets its overrides composed.
* ``pip install -e ".[extras]"``: the extras exist in pyproject.toml.
* ``key=value`` in inline code: composes with ``train.py``'s config (some experiment's, if not the default's);
  the overrides the docs show as mistakes (``DOCUMENTED_MISTAKES``) must fail to compose.

Anything else must be listed in ``NOT_CHECKED`` with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from tests.helpers import REPO_ROOT, compose_config

# composes configs and reads --help: no DALI pipeline runs, nothing here depends on the DALI line
pytestmark = pytest.mark.no_dali

README = REPO_ROOT / "README.md"
DOCUMENTS = [README, REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# first words that make a line of inline code or of an untagged block a command
COMMAND_WORDS = (
    *("python", "make", "scripts/", "benchmarks/", "sbatch", "srun", "torchrun", "docker", "pip", "bash"),
    "conda",
)
SHELL_SCRIPT = re.compile(r"(scripts|benchmarks)/\S+\.sh\b")  # a user command or a measurement harness
# `key=value` scripts without --help: module attribute holding the accepted keys
KEY_VALUE_SCRIPTS = {"scripts/export_onnx.py": "DEFAULTS"}
# Commands that cannot be checked here (exact text as extracted), with the reason.
NOT_CHECKED: dict[str, str] = {
    "docker stop": "docker's own command, named as one of the things that send SIGTERM",
}
# Inline overrides the docs show as what a user gets wrong: composing them must fail with this text.
DOCUMENTED_MISTAKES = {
    "data.batch_sze=8": "batch_sze",
    "experiment=ssd300_fp17": "experiment/ssd300_fp17",
    "model=resnet": "model/resnet",
}
# an inline span made only of Hydra overrides: `key=value`, `+key=value`, several separated by spaces
OVERRIDES_SPAN = re.compile(r"[+~]?[a-z_][\w.]*=\S*(?: [+~]?[a-z_][\w.]*=\S*)*")
PLACEHOLDER = re.compile(r"<[^<>\s]+>")  # <run>, <date>: the user fills them in


@dataclass(frozen=True)
class Command:
    text: str
    line: int
    file: str = "README.md"

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.text[:60]}"


def _fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of the first content line, content) of each fenced block."""
    blocks = []
    for match in re.finditer(r"^```([\w+-]*)[^\n]*\n(.*?)^```", text, re.M | re.S):
        blocks.append((match.group(1).lower(), text.count("\n", 0, match.start(2)) + 1, match.group(2)))
    return blocks


def _block_commands(content: str, first_line: int) -> list[Command]:
    commands, pending, start = [], "", first_line
    for offset, line in enumerate(content.splitlines()):
        if not pending:
            start = first_line + offset
        line = line.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line and not line.startswith("#"):
            commands.append(Command(line.removeprefix("$ "), start))
    return commands


def _inline_spans(text: str) -> list[tuple[str, int]]:
    """(inline code, line number) outside fenced blocks."""
    without_blocks = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
    return [
        (match.group(1).strip(), without_blocks.count("\n", 0, match.start()) + 1)
        for match in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", without_blocks)
    ]


def _is_command(span: str) -> bool:
    return span.startswith(tuple(w + " " for w in COMMAND_WORDS)) or bool(SHELL_SCRIPT.match(span))


def documented_commands(document: Path) -> list[Command]:
    text, name = document.read_text(), str(document.relative_to(REPO_ROOT))
    commands = []
    for language, first_line, content in _fenced_blocks(text):
        if language in SHELL_LANGUAGES:
            commands += [Command(c.text, c.line, name) for c in _block_commands(content, first_line)]
    return commands + [Command(span, line, name) for span, line in _inline_spans(text) if _is_command(span)]


@functools.cache
def _top_level_names() -> frozenset[str]:
    """Keys and config groups an undotted override can name: train.py's and predict.py's."""
    names = {p.name for p in (REPO_ROOT / "configs").iterdir() if p.is_dir()}
    for config in ("train", "predict"):
        names |= set(OmegaConf.load(REPO_ROOT / "configs" / f"{config}.yaml")) - {"defaults"}
    return frozenset(names)


def _is_override_span(span: str) -> bool:
    """`trainer.max_epochs=1`, `task=validate`, `model.x=1 data.y=2`; not `enable_checkpointing=True`
    (a Python keyword argument) or `torch==2.14.1`."""
    if not OVERRIDES_SPAN.fullmatch(span) or _is_command(span):
        return False
    keys = [word.split("=", 1)[0].lstrip("+~") for word in span.split()]
    return any("." in key for key in keys) or all(key in _top_level_names() for key in keys)


def documented_overrides(document: Path) -> list[Command]:
    """Inline spans that are Hydra overrides of train.py or predict.py (`trainer.max_epochs=1`)."""
    name = str(document.relative_to(REPO_ROOT))
    return [
        Command(span, line, name)
        for span, line in _inline_spans(document.read_text())
        if _is_override_span(span)
    ]


COMMANDS = [command for document in DOCUMENTS for command in documented_commands(document)]
OVERRIDES = [override for document in DOCUMENTS for override in documented_overrides(document)]
EXPERIMENTS = sorted(p.stem for p in (REPO_ROOT / "configs" / "experiment").glob("*.yaml"))


# ---------------------------------------------------------------------------------------------- helpers
def _tokens(command: str) -> list[str]:
    """Shell words as the shell would pass them (quotes removed, comments dropped), placeholders filled."""
    words = shlex.split(PLACEHOLDER.sub("PLACEHOLDER", command), comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value command ...
        words.pop(0)
    if words[:1] == [".venv/bin/python"]:
        words[0] = "python"
    if words[:1] == ["bash"] and len(words) > 1 and SHELL_SCRIPT.match(words[1]):
        words.pop(0)  # bash scripts/x.sh: the script is checked
    return [word for word in words if word != "..."]  # `train.py ...`: the user's own overrides


def _sweep_combinations(overrides: list[str]) -> list[list[str]]:
    """The jobs of a multirun: every combination of the comma/range sweeps among ``overrides``."""
    choices = []
    for text, parsed in zip(overrides, OverridesParser.create().parse_overrides(overrides), strict=True):
        if parsed.is_interval_sweep():  # an Optuna search space (sweep=demo_optuna): compose both ends
            key, interval = text.split("=", 1)[0], parsed.value()
            choices.append([f"{key}={interval.start}", f"{key}={interval.end}"])
        elif parsed.is_sweep_override():
            key = text.split("=", 1)[0]
            choices.append([f"{key}={value}" for value in parsed.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(job) for job in itertools.product(*choices)]


def _check_hydra_app(args: list[str], config_name: str) -> str:
    """Compose ``args`` (an entry point's command line) as Hydra would; return what was composed."""
    multirun = False
    overrides: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg in ("--cfg", "-c", "--package", "-p"):
            next(rest)  # --cfg job|hydra|all, --package <pkg>: printing only
        elif arg == "--resolve":
            pass
        elif arg.startswith("-"):
            raise AssertionError(f"unknown flag {arg!r} for a Hydra app")
        else:
            assert "=" in arg or arg.startswith("~"), f"{arg!r} is not a Hydra override"
            overrides.append(arg)
    jobs = _sweep_combinations(overrides) if multirun else [overrides]
    composed = 0
    for job in jobs:
        cfg = compose_config(job, config_name=config_name)
        params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
        if params and (multirun or cfg.hydra.mode == "MULTIRUN"):
            # a ready-made sweep (sweep=...): its parameters must name keys of the composed config
            swept = [
                f"{key}={value}"
                for key, value in params.items()
                if not any(o.startswith(f"{key}=") for o in job)
            ]
            for sweep_job in _sweep_combinations(swept):
                compose_config(job + sweep_job, config_name=config_name)
                composed += 1
        else:
            composed += 1
    return f"composed {composed} config(s) of configs/{config_name}.yaml"


@functools.cache
def _help_text(script: str) -> str:
    """``script --help`` run from another directory, with the caller's ``PYTHONPATH`` only: a script finds the
    package (installed) and the repository files it reads (``configs/``, ``tests/reference_ssd.py``) from its
    own location, not the working directory."""
    with tempfile.TemporaryDirectory() as elsewhere:
        result = subprocess.run(
            [sys.executable, str(REPO_ROOT / script), "--help"],
            cwd=elsewhere,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 0, f"{script} --help failed:\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return result.stdout


def _check_python_script(script: str, args: list[str]) -> str:
    assert (REPO_ROOT / script).is_file(), f"{script} does not exist"
    if script in KEY_VALUE_SCRIPTS:
        spec = importlib.util.spec_from_file_location(Path(script).stem, REPO_ROOT / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        accepted = getattr(module, KEY_VALUE_SCRIPTS[script])
        keys = [arg.split("=", 1)[0].lstrip("+") for arg in args]
        assert all("=" in arg for arg in args) and set(keys) <= set(accepted), (keys, sorted(accepted))
        return f"{script}: keys {keys} accepted"
    help_text = _help_text(script)
    options = [arg.split("=", 1)[0] for arg in args if arg.startswith("--") and arg != "--"]
    listed = set(re.findall(r"(?<![\w-])--[\w-]+", help_text))  # whole options: --images is not --num-images
    missing = [option for option in options if option not in listed]
    assert not missing, f"{script} --help does not list {missing}"
    return f"{script} --help lists {options}"


def _check_python_module(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    assert 'if __name__ == "__main__":' in Path(spec.origin).read_text(), f"{module} has no __main__ block"
    return f"{module} runs as a script"


def _check_shell_script(path: str, args: list[str]) -> str:
    file = REPO_ROOT / path
    assert file.is_file(), f"{path} does not exist"
    assert os.access(file, os.X_OK), f"{path} is not executable"
    subprocess.run(["bash", "-n", str(file)], check=True)
    if re.search(r"^\s*-h \| --help\)", file.read_text(), re.M):  # the script has --help: options in it
        help_text = subprocess.run(
            ["bash", str(file), "--help"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        missing = [arg for arg in args if arg.startswith("--") and arg.split("=", 1)[0] not in help_text]
        assert not missing, f"{path} --help does not list {missing}"
    return f"{path} exists, is executable and parses"


@functools.cache
def _make_targets() -> dict[str, str]:
    """target -> its recipe."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = {}
    for match in re.finditer(r"^([A-Za-z0-9_-]+):(?!=).*\n((?:\t.*\n?)*)", makefile, re.M):
        targets[match.group(1)] = match.group(2)
    return targets


def _check_make(args: list[str]) -> str:
    variables = dict(arg.split("=", 1) for arg in args if "=" in arg)
    targets = [arg for arg in args if "=" not in arg and not arg.startswith("-")] or ["setup"]
    checked = []
    for target in targets:
        assert target in _make_targets(), f"no `{target}` target in the Makefile"
        call = re.search(r"train\.py (.*)", _make_targets()[target])
        if call:
            words = call.group(1).replace("$(ARGS)", variables.get("ARGS", "")).split()
            checked.append(_check_hydra_app(words, "train"))
    return f"make targets {targets} exist; " + "; ".join(checked)


def _check_launcher(words: list[str]) -> str:
    """sbatch/srun/torchrun/docker: the repository files they name exist; train.py gets composed."""
    checked = []
    if words[:2] == ["docker", "build"]:
        assert (REPO_ROOT / "Dockerfile").is_file()
        checked.append("Dockerfile")
    for i, word in enumerate(words[1:], start=1):
        if word == "train.py" or word.endswith("/train.py"):
            checked.append(_check_hydra_app(words[i + 1 :], "train"))
            break
        relative = not word.startswith(("/", "-", "~")) and "=" not in word and "PLACEHOLDER" not in word
        if relative and ("/" in word or word.endswith((".py", ".sh", ".sbatch", ".yaml"))):
            assert (REPO_ROOT / word).exists(), f"{word} does not exist"
            if word.endswith((".sh", ".sbatch")):
                subprocess.run(["bash", "-n", str(REPO_ROOT / word)], check=True)
            checked.append(word)
    assert checked, "nothing in this launcher command refers to the repository"
    return f"checked {checked}"


def _check_pip(words: list[str]) -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the backport (dev extra)
        import tomli as tomllib
    extras_defined = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    editable = [w for w in words if re.fullmatch(r"\.(\[[\w,-]+\])?", w)]
    assert words[:2] == ["pip", "install"] and editable, "only `pip install -e .[extras]` is understood"
    extras = re.findall(r"[\w-]+", editable[0][1:])
    assert set(extras) <= set(extras_defined), f"unknown extras {set(extras) - set(extras_defined)}"
    return f"extras {extras} exist"


def check_command(command: str) -> str:
    """Check one README command; returns what was checked, raises AssertionError if it is broken."""
    words = _tokens(command)
    assert words, f"no command in {command!r}"
    head = words[0]
    if head in ("python", "python3"):
        script, args = words[1], words[2:]
        if script == "-m":
            return _check_python_module(args[0])
        if script == "train.py":
            return _check_hydra_app(args, "train")
        if script == "predict.py":  # its --help lists its settings, not train.py's config groups
            help_text = _help_text("predict.py")
            assert "input: ???" in help_text and "experiment:" not in help_text, help_text[:2000]
            return _check_hydra_app(args, "predict")
        return _check_python_script(script, args)
    if SHELL_SCRIPT.fullmatch(head):
        return _check_shell_script(head, words[1:])
    if head == "make":
        return _check_make(words[1:])
    if head in ("sbatch", "srun", "torchrun", "docker"):
        return _check_launcher(words)
    if head == "pip":
        return _check_pip(words)
    raise AssertionError(f"no check for {command!r}: add one here, or list it in NOT_CHECKED with a reason")


def check_overrides(span: str) -> str:
    """Compose the overrides of an inline span with train.py's default config, else with the first
    experiment that has their keys, else with predict.py's config; raises the default config's error if
    none composes them."""
    overrides = _tokens(span)
    try:
        compose_config(overrides)
        return "composed with the default config"
    except Exception as default_error:
        attempts = [([f"experiment={e}", *overrides], "train", f"experiment={e}") for e in EXPERIMENTS]
        for attempt, config_name, name in [(overrides, "predict", "predict.py's config"), *attempts]:
            try:
                compose_config(attempt, config_name=config_name)
            except Exception:
                continue
            return f"composed with {name}"
        raise default_error


# ---------------------------------------------------------------------------------------------- tests
def test_the_readme_has_the_commands_this_file_expects():
    texts = [c.text for c in COMMANDS if c.file == "README.md"]
    assert any(t.startswith("make train") for t in texts) and any(t.startswith("make test") for t in texts)
    assert sum(t.startswith("python train.py") for t in texts) >= 5
    assert any(t.startswith("python predict.py") for t in texts)
    assert any(t.startswith("sbatch ") for t in texts)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.text not in NOT_CHECKED], ids=lambda c: c.id)
def test_readme_command(command: Command):
    check_command(command.text)


def test_not_checked_entries_are_still_in_the_readme():
    stale = set(NOT_CHECKED) - {c.text for c in COMMANDS}
    assert not stale, f"remove from NOT_CHECKED: {stale}"


BENCHMARKS = REPO_ROOT / "benchmarks"
# what docs/benchmarks.md and the harnesses' own docstrings name: none may go missing unnoticed
HARNESSES = {
    *("benchmark_analysis.py", "benchmark_cpu_step.py", "benchmark_decoder.py", "benchmark_demo.py"),
    *("benchmark_eval.py", "benchmark_finetune.py", "benchmark_host_memory.py", "benchmark_loader.py"),
    *("benchmark_onnx.py", "benchmark_startup.py", "benchmark_training.py", "gpu_benchmark.py"),
    *("benchmark_predict.py", "make_coco_scale_fixture.py", "stress_tests.py"),
}


def test_the_harnesses_live_in_benchmarks_and_not_in_scripts():
    assert {p.name for p in BENCHMARKS.glob("*.py")} == HARNESSES
    assert not {p.name for p in (REPO_ROOT / "scripts").glob("*")} & (HARNESSES | {"gpu_benchmark.sh"})
    # benchmark_decoder.py imports tests/reference_ssd.py by its own path
    assert (REPO_ROOT / "tests" / "reference_ssd.py").is_file()
    assert 'parents[1] / "tests"' in (BENCHMARKS / "benchmark_decoder.py").read_text()


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_every_harness_starts_from_any_directory(harness: str):
    """Documented or not: ``--help`` exits 0 with its usage line (shared with the documented commands')."""
    assert _help_text(f"benchmarks/{harness}").startswith(f"usage: {harness} ")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: d.name)
def test_untagged_blocks_hold_no_commands(document: Path):
    """A command in a block without a shell tag would escape this file: tag the block ```bash."""
    for language, first_line, content in _fenced_blocks(document.read_text()):
        if language in SHELL_LANGUAGES or language == "python":
            continue
        for offset, line in enumerate(content.splitlines()):
            assert not line.strip().startswith(COMMAND_WORDS), (
                f"{document.name}:{first_line + offset}: {line}"
            )


@pytest.mark.parametrize(
    "override", [o for o in OVERRIDES if o.text not in DOCUMENTED_MISTAKES], ids=lambda o: o.id
)
def test_documented_override(override: Command):
    check_overrides(override.text)


@pytest.mark.parametrize(("span", "error"), DOCUMENTED_MISTAKES.items())
def test_documented_mistakes_fail_and_are_still_documented(span: str, error: str):
    assert span in {o.text for o in OVERRIDES}, f"remove {span!r} from DOCUMENTED_MISTAKES"
    with pytest.raises(Exception, match=re.escape(error)):
        check_overrides(span)


def test_prose_overrides_are_found_and_a_stale_key_would_fail():
    texts = {o.text for o in OVERRIDES}
    assert {"trainer.max_epochs=1", "model.depthwise_weight_decay=0.0", "data.min_scale=0.15"} <= texts
    assert not {"enable_checkpointing=True", "torch==2.14.1 torchvision==0.29.1"} & texts  # not overrides
    with pytest.raises(Exception, match="depthwise_weight_dekay"):
        check_overrides("model.depthwise_weight_dekay=0.0")
    assert check_overrides("model.depthwise_weight_decay=0.0").startswith(
        "composed with experiment=mobilenetv2"
    )


@pytest.mark.parametrize(
    ("command", "error"),
    [
        ("python train.py experiment=ssd300_fp17_8gpu data.root=/coco", "experiment/ssd300_fp17_8gpu"),
        ("python train.py experiment=demo data.rooot=/coco", "data.rooot"),
        ("python train.py -m experiment=demo model.optimizer.lrr=1e-3,3e-3", "model.optimizer.lrr"),
        ("python train.py -m experiment=demo sweep=no_such_sweep", "sweep/no_such_sweep"),
        ("python train.py experiment=demo model.optimizer.lr=1e-3,3e-3", "Ambiguous value"),  # no -m
        ("python train.py experiment=demo --no-such-flag", "unknown flag"),
        ("python predict.py checkpoint=x.ckpt input=photos/", "override 'checkpoint'"),
        ("python scripts/export_onnx.py checkpoint=x.ckpt", "checkpoint"),
        ("python scripts/plot_run.py RUN --no-such-option", "does not list"),
        ("python scripts/no_such_script.py --help", "does not exist"),
        ("make no-such-target", "no `no-such-target` target"),
        ('make train ARGS="trainer.max_epochs=1 trainer.no_such_key=2"', "trainer.no_such_key"),
        ("sbatch scripts/slurm/no_such.sbatch", "does not exist"),
        ("scripts/no_such.sh", "does not exist"),
        ("scripts/download_coco.sh --no-such-option /coco", "does not list"),
        ("python benchmarks/no_such_benchmark.py --help", "does not exist"),
        ("bash benchmarks/no_such.sh", "does not exist"),
        ("python benchmarks/benchmark_decoder.py --no-such-option", "does not list"),
        ('pip install -e ".[cuda99]"', "cuda99"),
        ("tensorboard --logdir outputs", "NOT_CHECKED"),  # a new kind of command needs a check
    ],
)
def test_broken_commands_are_caught(command: str, error: str):
    with pytest.raises(Exception, match=re.escape(error)):
        check_command(command)


def test_a_ready_made_sweep_is_expanded_into_its_jobs():
    assert check_command("python train.py -m experiment=demo sweep=ssd300_lr_batch") == (
        "composed 6 config(s) of configs/train.yaml"
    )
    assert check_command("python train.py -m experiment=demo model.optimizer.lr=1e-3,3e-3 seed=1,2,3") == (
        "composed 6 config(s) of configs/train.yaml"
    )


def test_a_documented_download_command_would_be_checked():
    assert check_command("scripts/download_coco.sh --parts val,annotations /coco").endswith("parses")
