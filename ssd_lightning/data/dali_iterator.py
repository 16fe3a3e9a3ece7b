"""A resumable iterable over a DALI pipeline, safe under Lightning (:class:`DALILoader`).

Contract:

* ``len()`` is known up front and equal every epoch (in training, on every rank); every ``iter()`` starts a
  complete epoch, also after one was abandoned part-way.
* Readers use ``pad_last_batch=True`` and a fixed shard. ``mode="train"`` drops: an epoch is
  ``floor(floor(N/n) / B)`` full batches on every rank, and the rest of the reader epoch is run and
  discarded, so each epoch starts a fresh reader epoch. ``mode="eval"`` pads and trims: every sample of the
  shard is yielded exactly once (ranks may differ by one batch: gather at epoch end, no per-step
  collectives in validation).
* Training loaders are resumable: :meth:`DALILoader.state_dict` holds the position in the epoch and DALI
  checkpoints (this process's, and every shard's at the start of the reader epoch, exchanged once per
  reader epoch); :meth:`DALILoader.load_state_dict` continues with the same samples and augmentations. A
  state from another shard count or dataset is ignored with a warning.
* A yielded batch is never overwritten while anyone holds it: CPU outputs are DALI's own fresh buffers or
  copies into pooled buffers reused only when nothing outside the pool shares their storage; GPU outputs
  are copied into fresh CUDA memory on the current stream.

How (reader epochs, anchors, buffer pool): docs/internals.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from nvidia.dali.tensors import TensorListGPU
from torch import Tensor

from ssd_lightning import compat
from ssd_lightning.data.dali_compat import feed_ndarray, run_pipeline, to_torch_type, uses_fresh_outputs
from ssd_lightning.errors import ConfigError

__all__ = ["DALILoader", "shard_size"]

Batch = dict[str, Tensor]
_STATE_FORMAT = 1


def shard_size(num_samples: int, shard_id: int, num_shards: int) -> int:
    """Samples in shard ``shard_id`` under DALI's split ``[floor(sN/n), floor((s+1)N/n))``."""
    return (shard_id + 1) * num_samples // num_shards - shard_id * num_samples // num_shards


class _BufferPool:
    """Reusable CPU output buffers: one is handed out only while no tensor outside the pool shares it."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"pool_size must be >= 1, got {size}")
        self.size = size
        self._buffers: dict[str, list[Tensor]] = {}

    def take(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """A contiguous ``(shape, dtype)`` tensor nobody else references (its contents are garbage)."""
        shape = tuple(shape)
        pool = self._buffers.setdefault(key, [])
        for i, buf in enumerate(pool):
            if buf.shape == shape and buf.dtype == dtype and compat.storage_use_count(buf) == 1:
                pool.append(pool.pop(i))  # most recently used last
                return buf
        buf = torch.empty(shape, dtype=dtype)
        if len(pool) >= self.size:
            pool.pop(0)  # forget the least recently used one (whoever still holds it keeps it)
        pool.append(buf)
        return buf


class DALILoader:
    """Iterable of dict batches from a DALI pipeline, safe to return from a LightningDataModule hook.

    Args:
        pipeline_factory: ``factory(**pipeline_kwargs)`` builds a fresh, not-yet-built pipeline whose reader
            is named ``reader_name`` and uses ``pad_last_batch=True`` and a fixed shard; ``pipeline_kwargs``
            (``enable_checkpointing``, ``checkpoint``) go to the pipeline's constructor.
        output_names: dict key for each pipeline output, in order.
        mode: ``"train"`` (drop policy, resumable) or ``"eval"`` (pad-and-trim policy); see the module
            docstring.
        shard_id, num_shards: this rank's shard (the same values the pipeline's reader got).
        postprocess: applied to each dict of tensors after copying (renaming, reshaping; cheap views).
        on_error: turns an exception raised by the pipeline into a clearer one (e.g. naming a bad file).
        reader_name: name of the reader operator.
        dtypes: torch dtype of an output when it differs from DALI's (converted during the single copy);
            int32 outputs not named here become int64.
        pool_size: CPU buffers kept for reuse per output (docs/internals.md, "Output buffers").
    """

    def __init__(
        self,
        pipeline_factory: Callable[..., Any],
        output_names: Sequence[str],
        *,
        mode: Literal["train", "eval"],
        shard_id: int = 0,
        num_shards: int = 1,
        postprocess: Callable[[Batch], Batch] | None = None,
        on_error: Callable[[Exception], Exception] | None = None,
        reader_name: str = "Reader",
        dtypes: Mapping[str, torch.dtype] | None = None,
        pool_size: int = 4,
    ) -> None:
        if mode not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id must be in [0, num_shards={num_shards}), got {shard_id}")
        self._factory = pipeline_factory
        self.output_names = list(output_names)
        self.mode = mode
        self.shard_id, self.num_shards = shard_id, num_shards
        self._postprocess = postprocess
        self._on_error = on_error
        self._reader_name = reader_name
        self._dtypes = dict(dtypes or {})
        self._pool = _BufferPool(pool_size)
        self._pipe = self._build()
        meta = self._pipe.reader_meta(reader_name)
        if not meta.get("pad_last_batch", False):
            raise ValueError(f"reader {reader_name!r} must be built with pad_last_batch=True")
        self.batch_size: int = int(self._pipe.max_batch_size)
        self.num_samples: int = int(meta["epoch_size"])  # whole dataset, all shards
        self.shard_samples = shard_size(self.num_samples, shard_id, num_shards)
        # DALI pads every shard to the largest shard's batch count, so one reader epoch is this many
        # batches on every shard; the ones after this shard's real samples are pure padding.
        self._reader_batches = math.ceil(math.ceil(self.num_samples / num_shards) / self.batch_size)
        self._real_batches = math.ceil(self.shard_samples / self.batch_size)
        if mode == "train":
            self._len = (self.num_samples // num_shards) // self.batch_size
            if self._len == 0:
                raise ConfigError(
                    f"{self.num_samples} training samples cannot fill one batch of {self.batch_size} on each "
                    f"of {num_shards} rank(s); lower data.batch_size (per device) or use more data"
                )
        else:
            self._len = self._real_batches
            if self._len == 0:
                raise ConfigError(
                    f"shard {shard_id} of {num_shards} is empty ({self.num_samples} samples); use fewer "
                    "ranks (trainer.devices, trainer.num_nodes)"
                )
        self._pos = 0  # batches already taken from the current reader epoch
        self._taken = 0  # batches yielded in the current (training) epoch
        self._resume = False  # load_state_dict() asked the next iter() to continue the saved epoch
        self._anchor: dict[int, bytes] | None = None  # every shard's checkpoint at this reader epoch's start
        self._restored_state: dict[str, Any] | None = None

    def _build(self, checkpoint: bytes | None = None):
        kwargs: dict[str, Any] = {}
        if self.mode == "train":
            kwargs["enable_checkpointing"] = True
            if checkpoint is not None:
                kwargs["checkpoint"] = checkpoint
        pipe = self._factory(**kwargs)
        try:
            pipe.build()
        except Exception as exc:
            raise self._wrap(exc) from exc
        return pipe

    def _wrap(self, exc: Exception) -> Exception:
        return self._on_error(exc) if self._on_error is not None else exc

    def __len__(self) -> int:
        return self._len

    # ----------------------------------------------------------------- running and copying out
    def _run(self, copy: bool = True) -> Batch | None:
        device_id = getattr(self._pipe, "device_id", None)
        stream = torch.cuda.current_stream(device_id) if device_id is not None else None
        try:
            outputs = run_pipeline(self._pipe, stream)
        except Exception as exc:
            raise self._wrap(exc) from exc
        self._pos += 1
        if self._pos == self._reader_batches:
            self._pos = 0
            if self.mode == "train":
                self._anchor = self._gather(self._pipe.checkpoint())
        if not copy:
            return None
        return {name: self._to_torch(name, out) for name, out in zip(self.output_names, outputs, strict=True)}

    def _to_torch(self, name: str, tensor_list) -> Tensor:
        """A torch tensor of one output that stays valid after later runs (see the module docstring)."""
        dense = tensor_list.as_tensor()  # zero-copy for the dense batches these pipelines produce
        src = to_torch_type[dense.dtype]
        dst = self._dtypes.get(name, torch.int64 if src == torch.int32 else src)
        if isinstance(tensor_list, TensorListGPU):
            device = torch.device("cuda", tensor_list.device_id())
            out = torch.empty(dense.shape(), dtype=src, device=device)
            feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
            return out.to(dst)
        if dst == src and uses_fresh_outputs(self._pipe):
            return torch.from_dlpack(dense)  # owns a reference to DALI's buffer, which DALI never reuses
        out = self._pool.take(name, dense.shape(), dst)
        if dst == src:
            feed_ndarray(dense, out)  # one memcpy in C++
        elif dst == torch.bfloat16:  # numpy has no bfloat16
            out.copy_(torch.from_numpy(np.asarray(dense)))
        else:  # numpy: single-threaded, so it does not fight DALI's workers for the cores
            np.copyto(out.numpy(), np.asarray(dense), casting="unsafe")
        return out.view(out.shape)  # a second tensor on the buffer: its storage use count marks it held

    # ----------------------------------------------------------------- epochs
    def __iter__(self) -> Iterator[Batch]:
        return self._eval_epoch() if self.mode == "eval" else self._train_epoch()

    def _discard_tail(self) -> None:
        while self._pos != 0:
            self._run(copy=False)

    def _train_epoch(self) -> Iterator[Batch]:
        if not self._resume or self._taken >= self._len:  # a new epoch (a restored one may be complete)
            self._taken = 0
        self._resume = False
        while self._taken < self._len:
            if self._pos >= self._len:  # only tail batches left in this reader epoch (an abandoned epoch)
                self._discard_tail()
            batch = self._run()
            self._taken += 1
            if self._taken == self._len and self._pos >= self._len:
                self._discard_tail()  # now: a checkpoint saved at the epoch's end then has nothing to replay
            yield self._finish(batch)

    def _eval_epoch(self) -> Iterator[Batch]:
        if self._reader_batches - self._pos <= 2:  # only padding (or nearly nothing) left: run it off
            self._discard_tail()
        elif self._pos != 0:  # a previous epoch was abandoned part-way: rebuilding is cheaper
            del self._pipe
            self._pipe = self._build()
            self._pos = 0
        last_valid = self.shard_samples - (self._real_batches - 1) * self.batch_size
        for i in range(self._len):
            batch = self._run()
            if i == self._len - 1 and last_valid < self.batch_size:
                batch = {k: v[:last_valid] for k, v in batch.items()}
            yield self._finish(batch)

    def _finish(self, batch: Batch) -> Batch:
        return self._postprocess(batch) if self._postprocess is not None else batch

    # ----------------------------------------------------------------- resuming
    def _gather(self, own: bytes) -> dict[int, bytes]:
        """``{shard_id: checkpoint}`` of every rank under DDP (one all_gather_object), else of this one."""
        if (
            self.num_shards > 1
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() == self.num_shards
            and dist.get_rank() == self.shard_id
        ):
            gathered: list[Any] = [None] * self.num_shards
            dist.all_gather_object(gathered, (self.shard_id, own))
            return dict(gathered)
        return {self.shard_id: own}

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is (docs/internals.md, "Resuming"); ``{}`` for evaluation loaders."""
        if self.mode != "train":
            return {}
        return {
            "format": _STATE_FORMAT,
            "num_samples": self.num_samples,
            "num_shards": self.num_shards,
            "batch_size": self.batch_size,
            "epoch_batches": self._taken,
            "reader_batches": self._pos,
            "anchor": None if self._anchor is None else dict(self._anchor),
            "current": {self.shard_id: self._pipe.checkpoint()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, possibly another rank's): the next ``iter()``
        yields the rest of the saved epoch, or the next epoch when the saved one was complete."""
        if self.mode != "train" or not state:
            return
        if self._resume and state == self._restored_state:  # the same state again (datamodule, then loop)
            return
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown DALILoader state format {state.get('format')!r}")
        saved = (state["num_samples"], state["num_shards"], state["batch_size"])
        if saved != (self.num_samples, self.num_shards, self.batch_size):
            warnings.warn(
                f"DALI loader state was saved for (samples, shards, batch size) = {saved}, this loader has "
                f"{(self.num_samples, self.num_shards, self.batch_size)}: the sample order cannot be "
                "restored, starting from a fresh pipeline",
                stacklevel=2,
            )
            return
        anchor, current = state["anchor"], state["current"]
        if self.shard_id in current:
            self._pipe = None  # release the old pipeline's threads and buffers before building another
            self._pipe = self._build(current[self.shard_id])
            self._pos = state["reader_batches"]
        else:
            if anchor is not None and self.shard_id not in anchor:
                raise ValueError(f"DALI loader state has no checkpoint for shard {self.shard_id}")
            self._pipe = None
            self._pipe = self._build(None if anchor is None else anchor[self.shard_id])
            self._pos = 0
            for _ in range(state["reader_batches"]):  # mid-epoch on another rank: re-run, discard
                self._run(copy=False)
        self._anchor = None if anchor is None else dict(anchor)
        self._taken = state["epoch_batches"]
        self._resume = True
        self._restored_state = dict(state)
