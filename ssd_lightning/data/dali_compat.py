"""Every difference between the supported DALI lines (1.34.0 for CUDA 11, 2.x for CUDA 12/13), in one place.

Features are detected (operator schemas, constructor signatures), never inferred from version numbers. Each
function answers one question or returns the keyword arguments that bridge one difference: the readers'
shuffle seed (:func:`reader_shuffle_kwargs`), the executor and its output buffers
(:func:`uses_fresh_outputs`, :func:`run_pipeline`), EXIF orientation in the decoders
(:func:`decoders_apply_exif_orientation`); ``feed_ndarray`` and ``to_torch_type`` come from
``nvidia.dali.plugin.pytorch``, where both lines have them. What 1.34 lacks and what the project does
instead: docs/internals.md.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import nvidia.dali
from nvidia.dali import backend
from nvidia.dali.pipeline import Pipeline
from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

__all__ = [
    "DALI_VERSION",
    "DEFAULT_SHUFFLE_SEED",
    "HAS_EXEC_DYNAMIC",
    "HAS_SHUFFLE_SEED",
    "decoders_apply_exif_orientation",
    "feed_ndarray",
    "reader_shuffle_kwargs",
    "run_pipeline",
    "to_torch_type",
    "uses_fresh_outputs",
]

DALI_VERSION: str = nvidia.dali.__version__


@functools.cache
def decoders_apply_exif_orientation() -> bool:
    """Whether this DALI's image decoders turn images upright by their EXIF orientation.

    True on the 2.x line (``adjust_orientation``, on by default, in the decoders' schema); False on 1.34,
    whose decoders return the stored pixels. Detected from the schema, not the version number.
    """
    schema = backend.GetSchema("decoders__Image")
    return schema.HasArgument("adjust_orientation") and (
        schema.GetArgumentDefaultValueString("adjust_orientation") == "True"
    )


DEFAULT_SHUFFLE_SEED = 42  # the datamodules' default ``seed``: no warning for it on DALI 1.34

HAS_SHUFFLE_SEED: bool = backend.GetSchema("readers__COCO").HasArgument("shuffle_after_epoch_seed")
HAS_EXEC_DYNAMIC: bool = "exec_dynamic" in inspect.signature(Pipeline.__init__).parameters


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
    """True when ``pipe`` allocates every iteration's outputs afresh (the dynamic executor), so a tensor
    viewing them stays valid after later runs; False when DALI reuses its output buffers."""
    return bool(getattr(pipe, "exec_dynamic", False))


def run_pipeline(pipe: Pipeline, cuda_stream: Any = None) -> tuple:
    """One iteration's outputs.

    With the dynamic executor and a ``cuda_stream`` (torch's current stream), GPU outputs are bound to that
    stream: work queued on it waits for DALI on the device, and the host does not wait at all, as with
    DALI's own PyTorch iterator. Otherwise (CPU pipelines, DALI 1.34) the outputs are host-synchronous.
    """
    if cuda_stream is not None and uses_fresh_outputs(pipe):
        return pipe.run(cuda_stream)
    return pipe.run()
