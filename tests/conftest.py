"""Session set-up and fixtures: generated datasets, composed configs (helpers live in tests/helpers.py)."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from tests.helpers import train_config

# Two cores: keep each test process from oversubscribing them.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# The COCO split-check cache (ssd_lightning.data.split_cache) of this test session, not the user's
# ~/.cache: subprocesses (train.py, torchrun ranks) inherit it; removed when the session ends.
os.environ["SSD_LIGHTNING_CACHE_DIR"] = tempfile.mkdtemp(prefix="ssd_lightning_tests_cache_")
atexit.register(shutil.rmtree, os.environ["SSD_LIGHTNING_CACHE_DIR"], ignore_errors=True)

# A test module that mentions any of these can run DALI pipelines (directly, through a datamodule, or through
# train()/train.py): its tests get the `dali` marker, which `make test-dali-lines` runs under every DALI line
# (`no_dali` opts a test on synthetic data out).
_USES_DALI = re.compile(
    r"dali|datamodule|shapes_coco|shapes_imagefolder|make_cfg|train_config|train\(|train\.py|train_py|experiment=",
    re.I,
)


@cache
def _module_uses_dali(path: Path) -> bool:
    return bool(_USES_DALI.search(path.read_text(encoding="utf-8")))


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _module_uses_dali(Path(item.fspath)) and item.get_closest_marker("no_dali") is None:
            item.add_marker(pytest.mark.dali)


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
