"""A resumable iterable over a DALI pipeline, safe under Lightning (:class:`DALILoader`).

``len()`` is known up front and equal every epoch (in training, on every rank); every ``iter()`` starts a
complete epoch. ``mode="train"`` drops (``floor(floor(N/n) / B)`` full batches per rank) and resumes
exactly (:meth:`DALILoader.state_dict`); ``mode="eval"`` pads and trims (every sample of the shard once;
ranks may differ by one batch). A yielded batch is never overwritten while anyone holds it. How (reader
epochs, anchors, buffer pool): docs/internals.md.
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

__all__ = ["DALILoader"]

Batch = dict[str, Tensor]
_STATE_FORMAT = 1


class DALILoader:
    """Iterable of dict batches from a DALI pipeline, safe to return from a LightningDataModule hook.

    ``pipeline_factory(**pipeline_kwargs)`` builds a fresh, not-yet-built pipeline (reader ``"Reader"``,
    ``pad_last_batch=True``, the fixed shard ``shard_id`` of ``num_shards``; ``pipeline_kwargs``:
    ``enable_checkpointing``, ``checkpoint``). ``output_names``: each output's key (one value per sample comes
    out as (N,)); ``on_error``: turns a pipeline's exception into a clearer one; ``dtypes``: an output's
    torch dtype where not DALI's (converted while copying; other int32 outputs become int64); ``pool_size``:
    CPU buffers kept for reuse per output (docs/internals.md, "Output buffers").
    """

    def __init__(
        self,
        pipeline_factory: Callable[..., Any],
        output_names: Sequence[str],
        *,
        mode: Literal["train", "eval"],
        shard_id: int = 0,
        num_shards: int = 1,
        on_error: Callable[[Exception], Exception] | None = None,
        dtypes: Mapping[str, torch.dtype] | None = None,
        pool_size: int = 4,
    ) -> None:
        self._factory = pipeline_factory
        self.output_names = list(output_names)
        self.mode, self.shard_id, self.num_shards = mode, shard_id, num_shards
        self._on_error = on_error or (lambda exc: exc)
        self._dtypes = dict(dtypes or {})
        self._pool_size = pool_size
        self._buffers: dict[str, list[Tensor]] = {}  # reusable CPU output buffers, least recently used first
        self._pipe = self._build()
        self.batch_size: int = int(self._pipe.max_batch_size)
        meta = self._pipe.reader_meta("Reader")
        if not meta.get("pad_last_batch", False):  # the shard arithmetic below relies on it
            raise ValueError("the pipeline's reader 'Reader' must be built with pad_last_batch=True")
        n = self.num_samples = int(meta["epoch_size"])  # whole dataset
        # DALI's split: shard s holds samples [floor(sN/n), floor((s+1)N/n)), padded to the largest shard's
        # batch count, so one reader epoch is this many batches on every shard (the extra ones pure padding)
        self.shard_samples = (shard_id + 1) * n // num_shards - shard_id * n // num_shards
        self._reader_batches = math.ceil(math.ceil(n / num_shards) / self.batch_size)
        self._real_batches = math.ceil(self.shard_samples / self.batch_size)
        self._len = (n // num_shards) // self.batch_size if mode == "train" else self._real_batches
        if self._len == 0 and mode == "train":
            raise ConfigError(
                f"{n} training samples cannot fill one batch of {self.batch_size} on each of {num_shards} "
                "rank(s); lower data.batch_size (per device) or use more data"
            )
        if self._len == 0:
            raise ConfigError(
                f"shard {shard_id} of {num_shards} is empty ({n} samples); use fewer ranks "
                "(trainer.devices, trainer.num_nodes)"
            )
        self._pos = 0  # batches already taken from the current reader epoch
        self._taken = 0  # batches yielded in the current (training) epoch
        self._resume = False  # load_state_dict() asked the next iter() to continue the saved epoch
        self._anchor: dict[int, bytes] | None = None  # every shard's checkpoint at this reader epoch's start
        self._restored_state: dict[str, Any] | None = None

    def _build(self, checkpoint: bytes | None = None):
        kwargs = {"enable_checkpointing": True, "checkpoint": checkpoint} if self.mode == "train" else {}
        pipe = self._factory(**kwargs)
        try:
            pipe.build()
        except Exception as exc:
            raise self._on_error(exc) from exc
        return pipe

    def __len__(self) -> int:
        return self._len

    def _run(self, copy: bool = True) -> Batch | None:
        device_id = getattr(self._pipe, "device_id", None)
        stream = torch.cuda.current_stream(device_id) if device_id is not None else None
        try:
            outputs = run_pipeline(self._pipe, stream)
        except Exception as exc:
            raise self._on_error(exc) from exc
        self._pos += 1
        if self._pos == self._reader_batches:
            self._pos = 0
            if self.mode == "train":
                self._anchor = self._gather(self._pipe.checkpoint())
        if not copy:
            return None
        batch = {
            name: self._to_torch(name, out) for name, out in zip(self.output_names, outputs, strict=True)
        }
        return {k: v.reshape(-1) if v.shape[1:] == (1,) else v for k, v in batch.items()}

    def _take_buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A pooled contiguous ``(shape, dtype)`` tensor that no tensor outside the pool shares."""
        pool = self._buffers.setdefault(key, [])
        for i, buf in enumerate(pool):
            if buf.shape == shape and buf.dtype == dtype and compat.storage_use_count(buf) == 1:
                pool.append(pool.pop(i))  # most recently used last
                return buf
        buf = torch.empty(shape, dtype=dtype)
        if len(pool) >= self._pool_size:
            pool.pop(0)  # forget the least recently used one (whoever still holds it keeps it)
        pool.append(buf)
        return buf

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
        out = self._take_buffer(name, tuple(dense.shape()), dst)
        if dst == src:
            feed_ndarray(dense, out)  # one memcpy in C++
        elif dst == torch.bfloat16:  # numpy has no bfloat16
            out.copy_(torch.from_numpy(np.asarray(dense)))
        else:  # numpy: single-threaded, so it does not fight DALI's workers for the cores
            np.copyto(out.numpy(), np.asarray(dense), casting="unsafe")
        return out.view(out.shape)  # a second tensor on the buffer: its storage use count marks it held

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
            yield batch

    def _eval_epoch(self) -> Iterator[Batch]:
        if self._reader_batches - self._pos <= 2:  # only padding (or nearly nothing) left: run it off
            self._discard_tail()
        elif self._pos != 0:  # a previous epoch was abandoned part-way: rebuilding is cheaper
            self._pipe = None  # release the old pipeline's threads and buffers before building another
            self._pipe, self._pos = self._build(), 0
        last_valid = self.shard_samples - (self._real_batches - 1) * self.batch_size
        for i in range(self._len):
            batch = self._run()
            if i == self._len - 1 and last_valid < self.batch_size:
                batch = {k: v[:last_valid] for k, v in batch.items()}
            yield batch

    def _gather(self, own: bytes) -> dict[int, bytes]:
        """``{shard_id: checkpoint}`` of every rank under DDP (one all_gather_object), else of this one."""
        ddp = self.num_shards > 1 and dist.is_available() and dist.is_initialized()
        if ddp and dist.get_world_size() == self.num_shards and dist.get_rank() == self.shard_id:
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
        if self.shard_id not in current and anchor is not None and self.shard_id not in anchor:
            raise ValueError(f"DALI loader state has no checkpoint for shard {self.shard_id}")
        self._pipe = None  # release the old pipeline's threads and buffers before building another
        if self.shard_id in current:
            self._pipe, self._pos = self._build(current[self.shard_id]), state["reader_batches"]
        else:  # another rank's state: this shard's anchor, then re-run (and discard) the epoch so far
            self._pipe, self._pos = self._build(None if anchor is None else anchor[self.shard_id]), 0
            for _ in range(state["reader_batches"]):
                self._run(copy=False)
        self._anchor = None if anchor is None else dict(anchor)
        self._taken, self._resume, self._restored_state = state["epoch_batches"], True, dict(state)
