"""ssd_lightning.compat: every accessor against the installed Lightning/Hydra/torch, the one-line error when
an attribute is gone, and no private attribute of another library used anywhere else in the package."""

from __future__ import annotations

import ast
import datetime
import os
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from hydra.core.utils import JobReturn, JobStatus
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.utilities import CombinedLoader
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ssd_lightning import compat
from ssd_lightning.errors import user_errors_as_messages
from tests.helpers import REPO_ROOT, quiet_trainer

pytestmark = pytest.mark.no_dali

SUPPORTED_PL = "pytorch-lightning>=2.6,<2.7"


def _expected(package: str, what: str, supported: str) -> str:
    version = sys.modules[package].__version__
    return f"{package} {version} has no {what}; ssd_lightning supports {supported}"


def test_check_installed_passes_on_a_fresh_trainer():
    compat.check_installed(quiet_trainer())


# -- every accessor, against the installed libraries -----------------------------------------------------
class _Probe(pl.Callback):
    """Replaces Lightning's signal handling in on_fit_start (as InterruptCheckpoint does), signals itself
    SIGTERM in the first step and raises Lightning's stop flag in the second."""

    def __init__(self, replace: bool) -> None:
        self.replace = replace
        self.got: list[int] = []
        self.actions: list[str] = []
        self.steps: list[tuple[int, int]] = []  # (batches_that_stepped, global_step) after each batch
        self.flag_after_signal: bool | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.replace:
            compat.replace_signal_handlers(
                trainer, sigterm=lambda s, f: self.got.append(s), slurm_requeue=lambda s, f: None
            )
            compat.skip_per_step_sigterm_broadcast(trainer)
        start = trainer.profiler.start
        trainer.profiler.start = lambda name: (self.actions.append(name), start(name))[1]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append((compat.batches_that_stepped(trainer), trainer.global_step))
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # what Lightning calls before a DDP step
        if batch_idx == 0 and self.replace:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not self.got and time.monotonic() < deadline:
                time.sleep(0.01)
            self.flag_after_signal = trainer.received_sigterm  # Lightning's public reading of the flag
        if batch_idx == 1:
            compat.set_sigterm_received(trainer, True)
            assert trainer.received_sigterm  # Lightning's public reading of the same flag


def _fit(replace: bool, monkeypatch) -> tuple[_Probe, pl.Trainer, list[int]]:
    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    broadcasts: list[int] = []
    original = _TrainingEpochLoop._broadcast_sigterm_tensor
    monkeypatch.setattr(
        _TrainingEpochLoop,
        "_broadcast_sigterm_tensor",
        lambda loop: (broadcasts.append(1), original(loop))[1],
    )
    probe = _Probe(replace)
    trainer = quiet_trainer(max_steps=5, limit_val_batches=0, callbacks=[probe])
    with pytest.raises(SIGTERMException):
        trainer.fit(BoringModel())
    return probe, trainer, broadcasts


def test_signal_and_loop_accessors_during_a_fit(monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    probe, trainer, broadcasts = _fit(replace=True, monkeypatch=monkeypatch)
    assert probe.got == [signal.SIGTERM]  # Lightning registered our handler in place of its notifier
    assert probe.flag_after_signal is False  # ... which would have raised its stop flag
    # in on_train_batch_end Lightning has not counted the batch yet; stopped right after the flag's step
    assert probe.steps == [(0, 1), (1, 2)]
    assert broadcasts == []  # the stand-in ran, not Lightning's broadcast
    assert any(name.endswith("." + compat.train_fetch_action(trainer)) for name in probe.actions)
    assert signal.getsignal(signal.SIGTERM) == before  # Lightning's teardown restored the handler
    assert "_sigterm_notifier_fn" in vars(trainer._signal_connector)
    compat.restore_signal_handling(trainer)  # (callbacks' teardown hooks do not run after an exception)
    for name in ("_sigterm_notifier_fn", "_slurm_sigusr_handler_fn"):
        assert name not in vars(trainer._signal_connector)
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)

    control, _, broadcasts = _fit(replace=False, monkeypatch=monkeypatch)
    assert len(broadcasts) == 2  # without the skip: Lightning's broadcast
    assert control.steps == [(0, 1), (1, 2)]


def test_val_check_time_interval():
    assert compat.val_check_time_interval(quiet_trainer()) is None
    assert compat.val_check_time_interval(quiet_trainer(val_check_interval=0.5)) is None
    timed = quiet_trainer(val_check_interval=datetime.timedelta(minutes=1, seconds=30))
    assert compat.val_check_time_interval(timed) == 90.0


def test_launcher_accessors():
    assert compat.subprocess_script_launcher(quiet_trainer()) is None
    assert compat.take_launched_processes(quiet_trainer()) == []
    ddp = quiet_trainer(strategy="ddp", devices=2)
    launcher = compat.subprocess_script_launcher(ddp)
    assert launcher is ddp.strategy.launcher and callable(launcher.kill)


class _Rank:
    """A launched rank process: records what Lightning's observer could see when it was killed."""

    def __init__(self, watched: list) -> None:
        self.watched, self.seen_at_kill = watched, None

    def kill(self) -> None:
        self.seen_at_kill = list(self.watched)

    def wait(self, timeout: float) -> int:
        return -9


def test_a_failed_main_process_ends_its_ranks_unseen_by_lightnings_observer():
    """CI once lost rank 0's error: the observer found the rank it had just killed and SIGKILLed rank 0."""
    from ssd_lightning.cli.train import _stop_other_ranks

    ddp = quiet_trainer(strategy="ddp", devices=2)
    watched = compat.subprocess_script_launcher(ddp).procs  # the very list the observer polls
    ranks = [_Rank(watched), _Rank(watched)]
    watched.extend(ranks)
    _stop_other_ranks(ddp)
    assert [r.seen_at_kill for r in ranks] == [[], []]
    assert watched == [] and compat.take_launched_processes(ddp) == []


class _StatefulLoader:
    def __init__(self) -> None:
        self.loaded: list[dict] = []

    def __iter__(self):
        return iter([torch.zeros(1)])

    def __len__(self) -> int:
        return 1

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


def test_load_pending_loader_states():
    trainer = quiet_trainer()
    fit_loop = trainer.fit_loop
    compat.load_pending_loader_states(trainer)  # nothing pending, no loader: nothing happens
    loader = _StatefulLoader()
    fit_loop.on_load_checkpoint({"combined_loader": [{"position": 7}]})  # what a checkpoint hands over
    compat.load_pending_loader_states(trainer)  # no loader yet: the states wait
    assert fit_loop._combined_loader_states_to_load == [{"position": 7}]
    fit_loop._combined_loader = CombinedLoader([loader])
    compat.load_pending_loader_states(trainer)
    assert loader.loaded == [{"position": 7}]
    assert fit_loop._combined_loader_states_to_load == []
    compat.load_pending_loader_states(trainer)  # once only
    assert loader.loaded == [{"position": 7}]


def test_csv_logger_experiment(tmp_path):
    from pytorch_lightning.loggers import CSVLogger
    from pytorch_lightning.loggers.csv_logs import ExperimentWriter

    class Writer(ExperimentWriter):
        pass

    logger = CSVLogger(tmp_path, name="run", version=0)
    writer = compat.csv_logger_experiment(logger, Writer)
    assert type(writer) is Writer and writer.log_dir == logger.log_dir
    assert Path(logger.root_dir).is_dir()
    assert compat.csv_logger_experiment(logger, Writer) is writer  # made once


def test_storage_use_count():
    x = torch.zeros(6)
    assert compat.storage_use_count(x) == 1
    view = x[2:]
    assert compat.storage_use_count(x) == 2
    copy = x.clone()
    assert compat.storage_use_count(x) == 2 and compat.storage_use_count(copy) == 1
    del view
    assert compat.storage_use_count(x) == 1


def test_is_compiled_in_place_and_norm_base_class():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert not compat.is_compiled_in_place(net)
    net.compile()
    assert compat.is_compiled_in_place(net)
    assert not compat.is_compiled_in_place(torch.compile(torch.nn.Linear(2, 2)))  # wrapped, not in place
    base = compat.norm_base_class()
    for layer in (torch.nn.BatchNorm2d(3), torch.nn.SyncBatchNorm(3), torch.nn.InstanceNorm2d(3)):
        assert isinstance(layer, base)
    assert not isinstance(torch.nn.LayerNorm(3), base)


def test_job_return_value():
    done = JobReturn(status=JobStatus.COMPLETED, _return_value=0.5)
    assert compat.job_return_value(done) == 0.5
    error = ValueError("boom")
    failed = JobReturn(status=JobStatus.FAILED, _return_value=error)
    assert compat.job_return_value(failed) is error  # the property would re-raise it
    with pytest.raises(ValueError):
        _ = failed.return_value


# -- a missing attribute: one line naming it and the installed version ------------------------------------
def _without(monkeypatch, owner, name: str) -> None:
    monkeypatch.delattr(owner, name)


MISSING = {
    "Trainer._signal_connector": lambda t, mp: _without(mp, t, "_signal_connector"),
    "Trainer._signal_connector._sigterm_notifier_fn": lambda t, mp: _without(
        mp, type(t._signal_connector), "_sigterm_notifier_fn"
    ),
    "Trainer._signal_connector._slurm_sigusr_handler_fn": lambda t, mp: _without(
        mp, type(t._signal_connector), "_slurm_sigusr_handler_fn"
    ),
    "Trainer._signal_connector.received_sigterm": lambda t, mp: _without(
        mp, t._signal_connector, "received_sigterm"
    ),
    "Trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor": lambda t, mp: _without(
        mp, type(t.fit_loop.epoch_loop), "_broadcast_sigterm_tensor"
    ),
    "Trainer.fit_loop._combined_loader_states_to_load": lambda t, mp: _without(
        mp, t.fit_loop, "_combined_loader_states_to_load"
    ),
    "Trainer.fit_loop._combined_loader": lambda t, mp: _without(mp, t.fit_loop, "_combined_loader"),
    "CombinedLoader._load_state_dicts": lambda t, mp: _without(mp, CombinedLoader, "_load_state_dicts"),
    "Trainer.fit_loop.epoch_loop._batches_that_stepped": lambda t, mp: _without(
        mp, t.fit_loop.epoch_loop, "_batches_that_stepped"
    ),
    "Trainer._val_check_time_interval": lambda t, mp: _without(mp, t, "_val_check_time_interval"),
    '_TrainingEpochLoop profiler action "renamed_next"': lambda t, mp: mp.setattr(
        compat, "TRAIN_FETCH_ACTION", "renamed_next"
    ),
    "ExperimentWriter._check_log_dir_exists": lambda t, mp: _without(
        mp, sys.modules["lightning_fabric.loggers.csv_logs"]._ExperimentWriter, "_check_log_dir_exists"
    ),
}


@pytest.mark.parametrize("what", MISSING)
def test_check_installed_names_the_missing_attribute_and_the_version(what, monkeypatch, capsys):
    trainer = quiet_trainer()
    compat._fetch_action_in.cache_clear()
    MISSING[what](trainer, monkeypatch)
    try:
        with pytest.raises(compat.CompatError) as info:
            compat.check_installed(trainer)
    finally:
        compat._fetch_action_in.cache_clear()
    assert str(info.value) == _expected("pytorch_lightning", what, SUPPORTED_PL)
    with pytest.raises(SystemExit) as exit_info, user_errors_as_messages():  # how train.py prints it
        compat.check_installed(trainer)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"Error: {info.value}"


def test_torch_and_hydra_attributes_missing(monkeypatch):
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    compat._storage_use_count_fn.cache_clear()
    try:
        with pytest.raises(compat.CompatError) as info:
            compat.storage_use_count(torch.zeros(1))
    finally:
        monkeypatch.undo()
        compat._storage_use_count_fn.cache_clear()
    torch_range = re.escape("torch>=2.6,<=2.14.1")
    assert re.fullmatch(
        rf"torch \S+ has no torch\._C\._storage_Use_Count; ssd_lightning supports {torch_range}",
        str(info.value),
    )

    with pytest.raises(compat.CompatError, match=r"^torch \S+ has no nn\.Module\._compiled_call_impl; "):
        compat.is_compiled_in_place(SimpleNamespace())
    with pytest.raises(compat.CompatError) as info:
        compat.job_return_value(SimpleNamespace(status=JobStatus.FAILED))
    assert str(info.value) == _expected("hydra", "JobReturn._return_value", "hydra-core>=1.3.2,<1.4")
    with pytest.raises(compat.CompatError, match=r"has no CSVLogger\._experiment;"):
        compat.csv_logger_experiment(SimpleNamespace(), object)


def test_launcher_class_missing(monkeypatch):
    import pytorch_lightning.strategies.launchers.subprocess_script as module

    monkeypatch.delattr(module, "_SubprocessScriptLauncher")
    compat._subprocess_script_launcher_class.cache_clear()
    try:
        with pytest.raises(compat.CompatError) as info:
            compat.subprocess_script_launcher(quiet_trainer())
    finally:
        monkeypatch.undo()
        compat._subprocess_script_launcher_class.cache_clear()
    what = "pytorch_lightning.strategies.launchers.subprocess_script._SubprocessScriptLauncher"
    assert str(info.value) == _expected("pytorch_lightning", what, SUPPORTED_PL)


# -- no private attribute of another library outside compat.py -------------------------------------------
# Hydra's public config keys, spelled with underscores
HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}
FOREIGN_PACKAGES = (
    "torch",
    "torchvision",
    "pytorch_lightning",
    "lightning_fabric",
    "lightning",
    "hydra",
    "omegaconf",
    "torchmetrics",
    "nvidia",
    "numpy",
    "pycocotools",
    "faster_coco_eval",
)


def _is_private(name: str) -> bool:
    return (
        name.startswith("_")
        and not (name.startswith("__") and name.endswith("__"))
        and name not in HYDRA_KEYS
    )


def _sources() -> list[Path]:
    files = sorted((REPO_ROOT / "ssd_lightning").rglob("*.py"))
    files += [REPO_ROOT / "train.py", REPO_ROOT / "predict.py"]
    return [f for f in files if f.name != "compat.py" or f.parent.name != "ssd_lightning"]


def _own_private_names(trees: dict[Path, ast.AST], foreign: set[str]) -> set[str]:
    """Private names the package defines: functions, classes, module globals, attributes it assigns, imports
    it renames; minus the ones compat.py reaches into other libraries for."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if _is_private(n)} - foreign


def _compat_foreign_names() -> set[str]:
    """The private names compat.py touches on other libraries' objects."""
    tree = ast.parse((REPO_ROOT / "ssd_lightning" / "compat.py").read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _is_private(n.attr)}
    names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {n for n in names if re.fullmatch(r"_[A-Za-z]\w*", n) and _is_private(n)}


def _violations(path: Path, tree: ast.AST, own: set[str]) -> list[tuple[str, int, str]]:
    """``(file, line, what)`` of every private name of another library used in ``tree``."""
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append((str(path.relative_to(REPO_ROOT)), node.lineno, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own:
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner not in ("self", "cls"):
                flag(node, f".{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            by_name = isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr")
            on_vars = (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Name)
                and func.value.func.id == "vars"
            )
            args = node.args[1:2] if by_name else node.args[:1] if on_vars else []
            for arg in args:
                literal = arg.value if isinstance(arg, ast.Constant) else None
                if isinstance(literal, str) and _is_private(literal) and literal not in own:
                    flag(node, f"{func.id if by_name else 'vars(...)'}({literal!r})")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                full = f"{module}.{alias.name}" if module else alias.name
                if full.split(".")[0] in FOREIGN_PACKAGES and any(_is_private(p) for p in full.split(".")):
                    flag(node, f"import {full}")
    return found


def test_no_private_attribute_of_another_library_outside_compat():
    trees = {path: ast.parse(path.read_text(), str(path)) for path in _sources()}
    foreign = _compat_foreign_names()
    assert {"_signal_connector", "_batches_that_stepped", "_storage_Use_Count", "_return_value"} <= foreign
    own = _own_private_names(trees, foreign)
    found = [v for path, tree in trees.items() for v in _violations(path, tree, own)]
    assert found == [], "private attributes of Lightning/Hydra/torch belong in ssd_lightning/compat.py"


@pytest.mark.parametrize(
    "code",
    [
        "trainer._signal_connector.received_sigterm = True",
        "n = trainer.fit_loop.epoch_loop._batches_that_stepped",
        "x = torch._C._storage_Use_Count(1)",
        "v = getattr(job, '_return_value', None)",
        "vars(loop).pop('_broadcast_sigterm_tensor', None)",
        "from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher",
        "import torch._dynamo",
        "t = trainer._foo",
    ],
)
def test_the_scan_catches_private_uses(code, tmp_path):
    trees = {path: ast.parse(path.read_text(), str(path)) for path in _sources()}
    own = _own_private_names(trees, _compat_foreign_names())
    path = REPO_ROOT / "ssd_lightning" / "example.py"  # never written: the scan reads the tree only
    assert _violations(path, ast.parse(code), own), code
    assert not _violations(path, ast.parse("self._x = 1; cfg._target_ = 'a.b'; y = obj.__class__"), own)
