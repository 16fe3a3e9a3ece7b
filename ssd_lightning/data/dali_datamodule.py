"""What every DALI LightningDataModule here shares: rank/shard lookup, argument checks, loader hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch

from ssd_lightning.data.coco_validation import find_undecodable_images
from ssd_lightning.data.dali_iterator import Batch, DALILoader
from ssd_lightning.data.dali_pipelines import dali_output_dtype
from ssd_lightning.errors import DataError

__all__ = ["DALIDataModule", "rank_info", "pipeline_device", "decode_error_reporter"]


def rank_info(module: pl.LightningDataModule) -> tuple[int, int]:
    """(global rank, world size) of the attached trainer; (0, 1) without one."""
    trainer = getattr(module, "trainer", None)
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


def pipeline_device(module: pl.LightningDataModule, device: str) -> tuple[str, int | None]:
    """(``"gpu"``, CUDA index) or (``"cpu"``, None): where this rank's DALI pipelines run.

    ``device="auto"`` follows the attached trainer's device: a trainer on a CUDA device gets GPU pipelines on
    that device, a CPU trainer gets CPU pipelines even on a GPU machine (``trainer=cpu``, ``ddp_cpu`` with
    more ranks than GPUs). Without a trainer, CUDA availability decides. ``"gpu"`` needs CUDA and, with a
    trainer, a trainer on a CUDA device.
    """
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
    trainer = getattr(module, "trainer", None)
    root = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if root is not None and root.type == "cuda":
        cuda_index = root.index if root.index is not None else torch.cuda.current_device()
    elif root is None and torch.cuda.is_available():
        cuda_index = torch.cuda.current_device()
    else:
        cuda_index = None
    if device == "auto":
        device = "cpu" if cuda_index is None else "gpu"
    if device == "cpu":
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

    Subclasses call :meth:`_set_loader_args` in ``__init__`` and implement ``_split(split)`` (read and check
    a split once; ``setup`` calls it) and ``make_loader(split, *, shard_id, num_shards)`` (through
    :meth:`_loader`); the loaders are built when Lightning asks for them (after ``setup``), sharded by the
    trainer's global rank and world size.
    Testing runs on the validation split (COCO and ImageNet publish no test labels).

    Resuming: :meth:`state_dict` is the training loader's stream state (see
    :mod:`ssd_lightning.data.dali_iterator`), which Lightning writes into every checkpoint; after
    ``trainer.fit(..., ckpt_path=...)`` restores it through :meth:`load_state_dict`, the next training loader
    continues from it, so the resumed run sees exactly the batches of an uninterrupted one. This is the path
    that also covers end-of-epoch checkpoints: Lightning hands loader states back to the loaders themselves
    only when it restarts mid-epoch.
    """

    _train_loader: DALILoader | None = None
    _train_state: dict[str, Any] | None = None

    def _set_loader_args(self, args: dict[str, Any]) -> None:
        """Check (``ValueError``) and keep the arguments every DALI datamodule takes, read by name from
        ``args`` (the subclass ``__init__``'s ``locals()``)."""
        for name in ("batch_size", "eval_batch_size", "num_threads"):
            value = (args[name] or 1) if name == "eval_batch_size" else args[name]
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if args["device"] not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {args['device']!r}")
        self._dali_dtype, self._cast = dali_output_dtype(args["output_dtype"])
        self.batch_size: int = args["batch_size"]
        self.eval_batch_size: int = args["eval_batch_size"] or self.batch_size
        self.num_threads: int = args["num_threads"]
        self.prefetch_queue_depth: int = args["prefetch_queue_depth"]
        self.seed: int = args["seed"]
        self.device: str = args["device"]
        self.output_dtype: str = args["output_dtype"]
        self.image_size: int = args["image_size"]

    def _loader(
        self,
        split: str,
        pipeline: Callable[..., Any],
        names: list[str],
        *,
        shard_id: int,
        num_shards: int,
        postprocess: Callable[[Batch], Batch],
        on_error: Callable[[Exception], Exception],
        **graph_kwargs: Any,
    ) -> DALILoader:
        """The :class:`DALILoader` of ``pipeline`` (a ``@pipeline_def``) for one split and shard: the
        arguments every graph takes (augmentation seed offset per rank), then ``graph_kwargs``."""
        device, cuda_index = pipeline_device(self, self.device)
        kwargs = {
            "batch_size": self.batch_size if split == "train" else self.eval_batch_size,
            "num_threads": self.num_threads,
            "device_id": cuda_index,
            "prefetch_queue_depth": self.prefetch_queue_depth,
            "seed": self.seed + 1009 * shard_id,  # different augmentation per rank
            "shard_id": shard_id,
            "num_shards": num_shards,
            "device": device,
            "dtype": self._dali_dtype,
            "image_size": self.image_size,
            **graph_kwargs,
        }
        return DALILoader(
            lambda **pipeline_kwargs: pipeline(**kwargs, **pipeline_kwargs),
            names,
            mode="train" if split == "train" else "eval",
            shard_id=shard_id,
            num_shards=num_shards,
            postprocess=postprocess,
            on_error=on_error,
            # images leave DALI as float32 when bfloat16 is asked for; the loader converts while copying
            dtypes={} if self._cast is None else {"images": self._cast},
        )

    def _split(self, split: str) -> Any:
        raise NotImplementedError

    def make_loader(self, split: str, *, shard_id: int = 0, num_shards: int = 1) -> DALILoader:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            self._split("train")
        if stage in (None, "fit", "validate", "test"):
            self._split("val")

    def train_dataloader(self) -> DALILoader:
        rank, world = rank_info(self)
        # the loader state_dict() reports, continuing from a state restored earlier
        loader = self.make_loader("train", shard_id=rank, num_shards=world)
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
        rank, world = rank_info(self)
        return self.make_loader("val", shard_id=rank, num_shards=world)

    def test_dataloader(self) -> DALILoader:
        return self.val_dataloader()
