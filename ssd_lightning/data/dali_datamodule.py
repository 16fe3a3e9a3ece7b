"""What every DALI LightningDataModule here shares: rank/shard lookup, argument checks, loader hooks."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from nvidia.dali import types

from ssd_lightning.data.coco_validation import find_undecodable_images
from ssd_lightning.data.dali_iterator import DALILoader
from ssd_lightning.errors import DataError

__all__ = ["DALIDataModule", "pipeline_device", "decode_error_reporter"]

_DALI_DTYPES = {"float32": types.FLOAT, "float16": types.FLOAT16, "bfloat16": types.FLOAT}  # see _loader


def pipeline_device(module: pl.LightningDataModule, device: str) -> tuple[str, int | None]:
    """(``"gpu"``, CUDA index) or (``"cpu"``, None): where this rank's DALI pipelines run. ``"auto"``
    follows the attached trainer's device (a CPU trainer gets CPU pipelines even on a GPU machine), else CUDA
    availability; ``"gpu"`` needs CUDA and, with a trainer, a trainer on a CUDA device."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
    root = getattr(getattr(getattr(module, "trainer", None), "strategy", None), "root_device", None)
    if root is None:  # no trainer
        root = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda_index = None
    if root.type == "cuda":
        cuda_index = torch.cuda.current_device() if root.index is None else root.index
    if device == "cpu" or (device == "auto" and cuda_index is None):
        return "cpu", None
    if not torch.cuda.is_available():
        raise ValueError("data.device='gpu' needs CUDA, which is not available; use 'auto' or 'cpu'")
    if cuda_index is None:
        raise ValueError(
            "data.device='gpu' but the trainer runs on the CPU (its batches would cross back from the GPU); "
            "use data.device=auto or a GPU trainer"
        )
    return "gpu", cuda_index


def decode_error_reporter(paths_fn, what: str):
    """``on_error`` for :class:`DALILoader`: name the files PIL cannot decode when DALI fails."""

    def report(exc: Exception) -> Exception:
        bad = find_undecodable_images(paths_fn())
        if bad:
            return DataError(
                f"DALI failed while reading {what}; these image files are corrupt or truncated: "
                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. Remove or re-encode them. "
                f"(DALI said: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r})"
            )
        return RuntimeError(f"DALI pipeline failed while reading {what}: {exc}")

    return report


class DALIDataModule(pl.LightningDataModule):
    """Base of the DALI datamodules: one sharded :class:`DALILoader` per split and rank.

    Subclasses implement ``_split(split)`` (read and check a split once; ``setup`` calls it) and
    ``make_loader(split, *, shard_id, num_shards)`` (through :meth:`_loader`), called with the trainer's
    global rank and world size; testing runs on the validation split (COCO and ImageNet publish no test
    labels). Arguments: ``image_size`` (square input side); ``batch_size`` PER DEVICE (the reference's
    ``--bs``); ``eval_batch_size`` (default ``batch_size``); ``num_threads`` (DALI CPU threads per pipeline);
    ``prefetch_queue_depth``; ``seed``: augmentation seed (offset by the global rank) and global shuffle
    seed (same on all ranks); ``device``: ``"auto"`` (:func:`pipeline_device`), ``"cpu"`` or ``"gpu"``;
    ``output_dtype`` of the images: ``"float32"``, ``"float16"`` or ``"bfloat16"``. Resuming:
    :meth:`state_dict` (the training loader's stream state) goes into every checkpoint and the next training
    loader continues from what :meth:`load_state_dict` restores, so a resumed run sees an uninterrupted
    one's batches (Lightning hands loader states back to them only mid-epoch).
    """

    _train_loader: DALILoader | None = None
    _train_state: dict[str, Any] | None = None

    def __init__(
        self,
        *,
        image_size: int,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_threads: int = 2,
        prefetch_queue_depth: int = 2,
        seed: int = 42,
        device: str = "auto",
        output_dtype: str = "float32",
    ) -> None:
        super().__init__()
        positive = dict(batch_size=batch_size, eval_batch_size=eval_batch_size or 1, num_threads=num_threads)
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
        if output_dtype not in _DALI_DTYPES:
            raise ValueError(f"output_dtype must be one of {sorted(_DALI_DTYPES)}, got {output_dtype!r}")
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_threads, self.prefetch_queue_depth, self.seed = num_threads, prefetch_queue_depth, seed
        self.device, self.output_dtype, self.image_size = device, output_dtype, image_size

    def _loader(
        self, split: str, pipeline, names, *, shard_id: int, num_shards: int, on_error, **graph_kwargs
    ) -> DALILoader:
        """The :class:`DALILoader` (outputs ``names``, ``on_error``) of ``pipeline`` (a ``@pipeline_def``) for
        one split and shard: the arguments every graph takes (augmentation seed offset per rank), then
        ``graph_kwargs``."""
        device, cuda_index = pipeline_device(self, self.device)
        shard = {"shard_id": shard_id, "num_shards": num_shards}
        kwargs = dict(
            batch_size=self.batch_size if split == "train" else self.eval_batch_size,
            device_id=cuda_index,
            num_threads=self.num_threads,
            prefetch_queue_depth=self.prefetch_queue_depth,
            **shard,
            seed=self.seed + 1009 * shard_id,  # different augmentation per rank
            device=device,
            dtype=_DALI_DTYPES[self.output_dtype],
            image_size=self.image_size,
            **graph_kwargs,
        )
        return DALILoader(
            lambda **pipeline_kwargs: pipeline(**kwargs, **pipeline_kwargs),
            names,
            mode="train" if split == "train" else "eval",
            **shard,
            on_error=on_error,
            # DALI has no bfloat16: images leave it as float32 and the loader converts while copying
            dtypes={"images": torch.bfloat16} if self.output_dtype == "bfloat16" else {},
        )

    def _sharded(self, split: str) -> DALILoader:
        """``make_loader`` for the attached trainer's global rank of its world size (0 of 1 without one)."""
        trainer = getattr(self, "trainer", None)
        rank, world = (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)
        return self.make_loader(split, shard_id=rank, num_shards=world)

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            self._split("train")
        if stage in (None, "fit", "validate", "test"):
            self._split("val")

    def train_dataloader(self) -> DALILoader:
        loader = self._sharded("train")
        if self._train_state:
            loader.load_state_dict(self._train_state)
            self._train_state = None
        self._train_loader = loader
        return loader

    def state_dict(self) -> dict[str, Any]:
        """``{"train": <training loader state>}`` once a training loader exists, else ``{}``."""
        return {} if self._train_loader is None else {"train": self._train_loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the training loader state for the next :meth:`train_dataloader` call to continue from."""
        self._train_state = state_dict.get("train")

    def val_dataloader(self) -> DALILoader:
        return self._sharded("val")

    def test_dataloader(self) -> DALILoader:
        return self.val_dataloader()
