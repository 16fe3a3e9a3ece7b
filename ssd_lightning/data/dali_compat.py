"""Every difference between the supported DALI lines (1.34.0 for CUDA 11, 2.x for CUDA 12/13), in one place.

Features are detected (operator schemas, constructor signatures), never inferred from version numbers:
the readers' shuffle seed, the executor and its output buffers, EXIF orientation in the decoders. What
1.34 lacks and what the project does instead: docs/internals.md.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import nvidia.dali
from nvidia.dali import backend
from nvidia.dali.pipeline import Pipeline
from nvidia.dali.plugin.pytorch import feed_ndarray as feed_ndarray  # re-exported: both lines have them
from nvidia.dali.plugin.pytorch import to_torch_type as to_torch_type

DALI_VERSION: str = nvidia.dali.__version__
DEFAULT_SHUFFLE_SEED = 42  # the datamodules' default ``seed``: no warning for it on DALI 1.34
HAS_SHUFFLE_SEED: bool = backend.GetSchema("readers__COCO").HasArgument("shuffle_after_epoch_seed")
HAS_EXEC_DYNAMIC: bool = "exec_dynamic" in inspect.signature(Pipeline.__init__).parameters


@functools.cache
def decoders_apply_exif_orientation() -> bool:
    """Whether the image decoders turn images upright by EXIF (2.x: ``adjust_orientation`` on by default;
    1.34 returns the stored pixels)."""
    schema = backend.GetSchema("decoders__Image")
    return schema.HasArgument("adjust_orientation") and (
        schema.GetArgumentDefaultValueString("adjust_orientation") == "True"
    )


@functools.cache
def _warn_fixed_shuffle_seed() -> None:  # cached: once per process
    warnings.warn(
        f"DALI {DALI_VERSION} cannot seed the global reshuffle (readers' shuffle_after_epoch_seed arrived "
        "in a later line): the sample order follows DALI's built-in seed, the same on every rank; the seed "
        "still drives augmentation. Install nvidia-dali-cuda120/cuda130 2.x for a seeded order.",
        stacklevel=3,
    )


def reader_shuffle_kwargs(seed: int) -> dict[str, Any]:
    """Reader arguments for one global reshuffle per epoch, identical on every rank, seeded where DALI can."""
    if HAS_SHUFFLE_SEED:
        return {"shuffle_after_epoch": True, "shuffle_after_epoch_seed": seed}
    if seed != DEFAULT_SHUFFLE_SEED:
        _warn_fixed_shuffle_seed()
    return {"shuffle_after_epoch": True}


def uses_fresh_outputs(pipe: Pipeline) -> bool:
    """Whether ``pipe`` allocates every iteration's outputs afresh (dynamic executor), never reusing them."""
    return bool(getattr(pipe, "exec_dynamic", False))


def run_pipeline(pipe: Pipeline, cuda_stream: Any = None) -> tuple:
    """One iteration's outputs: with the dynamic executor, GPU outputs bound to ``cuda_stream`` (torch's
    current stream: the host does not wait), else host-synchronous (CPU pipelines, DALI 1.34)."""
    return pipe.run(cuda_stream) if cuda_stream is not None and uses_fresh_outputs(pipe) else pipe.run()
