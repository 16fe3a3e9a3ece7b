"""A small Lightning-safe iterable over a DALI pipeline.

It runs the pipeline directly (no ``DALIGenericIterator``) and pins the pitfalls of DALI under Lightning:

* ``len()`` is known up front, equal every epoch, and (in training) equal on every rank;
* every ``iter()`` starts a complete epoch, also after an epoch was abandoned part-way (sanity-check
  validation, ``limit_*_batches``, ``trainer.validate`` after ``fit``);
* each batch is copied into fresh torch tensors, so a batch Lightning still holds is never overwritten;
* reader epochs stay aligned with the shard, so no sample is lost or repeated across epochs.

Last-batch policy. Every reader is built with ``pad_last_batch=True`` and a fixed shard, so one reader epoch
on shard ``s`` of ``n`` holds ``shard_size = floor((s+1)N/n) - floor(sN/n)`` real samples in
``ceil(shard_size / B)`` batches, the last one padded with copies of the shard's last sample; DALI then
adds whole padding batches so that every shard runs ``ceil(ceil(N/n) / B)`` batches per reader epoch.

* ``mode="train"``: DROP. An epoch is ``floor(floor(N/n) / B)`` full batches on every rank (the smallest
  shard decides, so DDP ranks step together); the remaining (at most two) batches of the reader epoch are
  run and discarded before the next epoch, so every epoch starts at the start of a fresh reader epoch (a
  fresh global permutation when shuffling). If an epoch is abandoned, the next continues the stream.
* ``mode="eval"``: PAD-AND-TRIM. An epoch is ``ceil(shard_size / B)`` batches; the padding is cut from the
  last batch (so N can be smaller there) and every sample of the shard is yielded exactly once. Ranks may
  differ by one batch: validation steps must not use per-step collectives (``sync_dist`` logging in the
  step); gather at epoch end. If an epoch is abandoned, the pipeline is rebuilt (evaluation has no state).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from nvidia.dali.plugin.pytorch import feed_ndarray
from nvidia.dali.plugin.pytorch.torch_utils import to_torch_type
from nvidia.dali.tensors import TensorListGPU
from torch import Tensor

__all__ = ["DALILoader", "shard_size"]

Batch = dict[str, Tensor]


def shard_size(num_samples: int, shard_id: int, num_shards: int) -> int:
    """Samples in shard ``shard_id`` under DALI's split ``[floor(sN/n), floor((s+1)N/n))``."""
    return (shard_id + 1) * num_samples // num_shards - shard_id * num_samples // num_shards


class DALILoader:
    """Iterable of dict batches from a DALI pipeline, safe to return from a LightningDataModule hook.

    Args:
        pipeline_factory: builds a fresh, not-yet-built pipeline whose reader is named ``reader_name``
            and uses ``pad_last_batch=True`` and a fixed shard.
        output_names: dict key for each pipeline output, in order.
        mode: ``"train"`` (drop policy) or ``"eval"`` (pad-and-trim policy); see the module docstring.
        shard_id, num_shards: this rank's shard (the same values the pipeline's reader got).
        postprocess: applied to each dict of tensors after copying (dtype casts, renaming).
        on_error: turns an exception raised by the pipeline into a clearer one (e.g. naming a bad file).
        reader_name: name of the reader operator.
    """

    def __init__(
        self,
        pipeline_factory: Callable[[], Any],
        output_names: Sequence[str],
        *,
        mode: Literal["train", "eval"],
        shard_id: int = 0,
        num_shards: int = 1,
        postprocess: Callable[[Batch], Batch] | None = None,
        on_error: Callable[[Exception], Exception] | None = None,
        reader_name: str = "Reader",
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
                raise ValueError(
                    f"{self.num_samples} training samples cannot fill one batch of {self.batch_size} on each "
                    f"of {num_shards} rank(s); lower batch_size or use more data"
                )
        else:
            self._len = self._real_batches
            if self._len == 0:
                raise ValueError(
                    f"shard {shard_id} of {num_shards} is empty ({self.num_samples} samples); use fewer ranks"
                )
        self._pos = 0  # batches already taken from the current reader epoch

    def _build(self):
        pipe = self._factory()
        try:
            pipe.build()
        except Exception as exc:
            raise self._wrap(exc) from exc
        return pipe

    def _wrap(self, exc: Exception) -> Exception:
        return self._on_error(exc) if self._on_error is not None else exc

    def __len__(self) -> int:
        return self._len

    def _run(self, copy: bool = True) -> Batch | None:
        try:
            outputs = self._pipe.run()
        except Exception as exc:
            raise self._wrap(exc) from exc
        self._pos += 1
        if self._pos == self._reader_batches:
            self._pos = 0
        if not copy:
            return None
        return {name: self._to_torch(out) for name, out in zip(self.output_names, outputs, strict=True)}

    @staticmethod
    def _to_torch(tensor_list) -> Tensor:
        """Copy a dense DALI TensorList into a fresh torch tensor (int32 becomes int64).

        DALI reuses its output buffers a few batches later, so every batch is copied out: a batch
        Lightning still holds is never overwritten by the next one. CPU: ``Tensor.clone`` of a zero-copy
        view (a parallel copy); GPU: ``feed_ndarray`` into fresh CUDA memory on the current stream.
        """
        dense = tensor_list.as_tensor()  # zero-copy for the dense batches these pipelines produce
        if isinstance(tensor_list, TensorListGPU):
            device = torch.device("cuda", tensor_list.device_id())
            out = torch.empty(dense.shape(), dtype=to_torch_type[dense.dtype], device=device)
            feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
        else:
            out = torch.from_numpy(np.asarray(dense)).clone()
        return out.long() if out.dtype == torch.int32 else out

    def __iter__(self) -> Iterator[Batch]:
        if self.mode == "eval":
            return self._eval_epoch()
        return self._train_epoch()

    def _train_epoch(self) -> Iterator[Batch]:
        for _ in range(self._len):
            if self._pos >= self._len:  # tail batches of this reader epoch: run and discard
                while self._pos != 0:
                    self._run(copy=False)
            yield self._finish(self._run())

    def _eval_epoch(self) -> Iterator[Batch]:
        if self._reader_batches - self._pos <= 2:  # only padding (or nearly nothing) left: run it off
            while self._pos != 0:
                self._run(copy=False)
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
