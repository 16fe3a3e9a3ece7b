"""The test suite's DALI guard: which test (or shared fixture) built a DALI pipeline, in any process.

``make test`` repeats the ``dali``-marked tests under every DALI line (``make test-dali-lines``); a test
that builds pipelines without the marker would silently escape that pass. ``tests/conftest.py`` puts this
folder first on ``PYTHONPATH``, so Python runs this file at the start of every subprocess (``train.py``
runs, torchrun and DDP ranks), and names what is running in ``BUILD_CONTEXT``. Every pipeline build
appends that name to the file ``BUILDS_LOG`` names; conftest reads it when the test ends.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

BUILD_CONTEXT = "SSD_LIGHTNING_TEST_CONTEXT"
BUILDS_LOG = "SSD_LIGHTNING_TEST_DALI_BUILDS"


def guard(pipeline_module) -> None:
    """Wrap ``Pipeline._init_pipeline_backend`` (every build, on every DALI line, goes through it)."""
    pipeline = pipeline_module.Pipeline
    original = pipeline._init_pipeline_backend
    if getattr(original, "dali_guard", False):
        return

    def init_pipeline_backend(self):
        if os.environ.get(BUILDS_LOG):
            with open(os.environ[BUILDS_LOG], "a", encoding="utf-8") as log:
                log.write(os.environ.get(BUILD_CONTEXT, "?") + "\n")
        return original(self)

    init_pipeline_backend.dali_guard = True
    pipeline._init_pipeline_backend = init_pipeline_backend


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards ``nvidia.dali.pipeline`` as it is imported."""

    def find_spec(self, name, path, target=None):
        if name != "nvidia.dali.pipeline":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_guard(module):
            exec_module(module)
            guard(module)

        spec.loader.exec_module = exec_and_guard
        return spec


def install() -> None:
    if "nvidia.dali.pipeline" in sys.modules:
        guard(sys.modules["nvidia.dali.pipeline"])
    elif not any(isinstance(f, _GuardOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardOnImport())


if os.environ.get(BUILDS_LOG):
    install()
