"""Session set-up and fixtures: generated datasets, composed configs (helpers live in tests/helpers.py)."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from tests.helpers import train_config

# pytest-xdist (`make test` runs `-n auto --dist loadfile`): each worker, and every process it starts, gets
# its share of the cores (torch threads here, OMP_NUM_THREADS in children): workers do not oversubscribe them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
torch.set_num_threads(min(2, _THREADS))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
# The COCO split-check cache (ssd_lightning.data.split_cache) of this test session, not the user's
# ~/.cache: subprocesses (train.py, torchrun ranks) inherit it; removed when the session ends.
os.environ["SSD_LIGHTNING_CACHE_DIR"] = tempfile.mkdtemp(prefix="ssd_lightning_tests_cache_")
atexit.register(shutil.rmtree, os.environ["SSD_LIGHTNING_CACHE_DIR"], ignore_errors=True)

# The DALI guard (tests/dali_guard/sitecustomize.py): every DALI pipeline built, in this process or a child,
# is logged with what was running. A test that builds one (or uses a shared fixture that does) must be marked
# `dali` (`make test-dali-lines` repeats those under every DALI line) or `no_dali` (with the reason it runs
# once); an unmarked one fails. SSD_LIGHTNING_TEST_DALI_RECORD=<file> lists every test that builds one in
# <file> instead (marked or not; how the markers were set).
_GUARD_DIR = Path(__file__).parent / "dali_guard"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(_GUARD_DIR), os.environ.get("PYTHONPATH"))))
_guard_spec = importlib.util.spec_from_file_location("dali_guard", _GUARD_DIR / "sitecustomize.py")
dali_guard = importlib.util.module_from_spec(_guard_spec)
_guard_spec.loader.exec_module(dali_guard)
_BUILDS_LOG = Path(os.environ["SSD_LIGHTNING_CACHE_DIR"]) / "dali_builds.log"
os.environ[dali_guard.BUILDS_LOG] = str(_BUILDS_LOG)
dali_guard.install()
_RECORD = os.environ.get("SSD_LIGHTNING_TEST_DALI_RECORD")
_dali_fixtures: set[str] = set()  # shared (module/session) fixtures seen building pipelines


def _builds_by(context: str) -> bool:
    return _BUILDS_LOG.is_file() and context in _BUILDS_LOG.read_text(encoding="utf-8").splitlines()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        return (yield)
    context = f"fixture {fixturedef.argname}"
    outer = os.environ.get(dali_guard.BUILD_CONTEXT)
    os.environ[dali_guard.BUILD_CONTEXT] = context
    try:
        return (yield)
    finally:
        if outer is None:
            del os.environ[dali_guard.BUILD_CONTEXT]
        else:
            os.environ[dali_guard.BUILD_CONTEXT] = outer
        if _builds_by(context):
            _dali_fixtures.add(fixturedef.argname)


@pytest.fixture(autouse=True)
def _dali_builds_need_a_marker(request, monkeypatch):
    monkeypatch.setenv(dali_guard.BUILD_CONTEXT, request.node.nodeid)
    yield
    marked = any(request.node.get_closest_marker(m) for m in ("dali", "no_dali"))
    if marked and not _RECORD:
        return
    fixtures = sorted(_dali_fixtures.intersection(request.fixturenames))
    if _builds_by(request.node.nodeid) or fixtures:
        if _RECORD:
            with open(_RECORD, "a", encoding="utf-8") as out:
                out.write(request.node.nodeid + "\n")
            return
        through = f" (through the shared fixture {', '.join(fixtures)})" if fixtures else ""
        pytest.fail(
            f"this test builds a DALI pipeline{through} but has no `dali` marker: mark it @pytest.mark.dali "
            "(`make test-dali-lines` runs those under every DALI line), or @pytest.mark.no_dali with the "
            "reason it need not"
        )


# The longest files (`--durations` of `make test`), started first so that no worker is left with one of them
# at the end (`make test` runs `--dist loadfile --no-loadscope-reorder`: a file runs on one worker, in order).
LONGEST_FIRST = (
    "test_docs_commands_run.py",
    "test_docs_harnesses_run.py",
    "test_signals_multiprocess.py",
    "test_readme_commands.py",
    "test_checkpoint_is_a_model.py",
    "test_distributed.py",
    "test_benchmark_tasks.py",
    "test_gpu_benchmark_script.py",
    "test_training_controls.py",
    "test_interrupt.py",
    "test_loggers_tracking.py",
    "test_sweeps.py",
    "test_data_ddp.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.fspath).name, len(rank)))  # stable: file order kept


@pytest.fixture(scope="session")
def shapes_coco(tmp_path_factory) -> Path:
    """A small COCO-layout detection dataset (non-contiguous category ids), generated once per session."""
    from ssd_lightning.data.shapes import make_detection_dataset

    root = tmp_path_factory.mktemp("shapes_coco") / "shapes"
    return make_detection_dataset(root, num_train=24, num_val=13, seed=1, min_size=96, max_size=256)


@pytest.fixture(scope="session")
def shapes_imagefolder(tmp_path_factory) -> Path:
    """A small ImageFolder-layout classification dataset, generated once per session."""
    from ssd_lightning.data.shapes import make_classification_dataset

    root = tmp_path_factory.mktemp("shapes_cls") / "shapes"
    return make_classification_dataset(
        root, num_train_per_class=16, num_val_per_class=5, seed=1, image_size=64
    )


@pytest.fixture
def make_cfg(tmp_path):
    """Factory: :func:`tests.helpers.train_config` with outputs under ``tmp_path``."""

    def _make(overrides: list[str] | None = None) -> DictConfig:
        return train_config(overrides or [], output_dir=tmp_path)

    yield _make
    GlobalHydra.instance().clear()
