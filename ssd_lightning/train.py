"""``train(cfg)``: everything ``python train.py ...`` does, as a plain function returning metrics.

The root ``train.py`` is only the ``@hydra.main`` wrapper; tests call :func:`train` in-process with configs
composed by Hydra's compose API.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from ssd_lightning.benchmark import config_summary_from_cfg, run_benchmark_task

log = logging.getLogger(__name__)

TASKS = ("fit", "validate", "benchmark_training", "benchmark_inference")


def register_resolvers() -> None:
    """OmegaConf resolvers used by configs/ (``${if:cond,a,b}``)."""
    OmegaConf.register_new_resolver("if", lambda cond, a, b: a if cond else b, replace=True)


register_resolvers()


def _silence_known_harmless_warnings() -> None:
    # Lightning suggests more DataLoader workers; DALI iterators are no DataLoaders and run their own threads.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*The number of training batches \(\d+\) is smaller.*")


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every entry of a ``callbacks``/``logger`` group that has a ``_target_``."""
    if not group:
        return []
    return [hydra.utils.instantiate(entry) for entry in group.values() if entry and "_target_" in entry]


def validate_config(cfg: DictConfig) -> None:
    """Cheap checks that name the key and the accepted values, before anything heavy starts."""
    if cfg.task not in TASKS:
        raise ValueError(f"task={cfg.task!r} is not one of {TASKS}")
    epochs = list(cfg.get("eval_epochs") or [])
    if any(e < 0 for e in epochs) or epochs != sorted(set(epochs)):
        raise ValueError(f"eval_epochs must be increasing non-negative 0-based epochs, got {epochs}")
    max_epochs = cfg.trainer.get("max_epochs")
    if (
        cfg.task == "fit"
        and max_epochs is not None
        and max_epochs > 0
        and epochs
        and epochs[-1] >= max_epochs
    ):
        raise ValueError(
            f"eval_epochs={epochs} has epoch {epochs[-1]} but trainer.max_epochs={max_epochs} "
            f"(epochs are 0-based, so the last one is {max_epochs - 1})"
        )
    if cfg.data.get("batch_size") is not None and cfg.data.batch_size <= 0:
        raise ValueError(
            f"data.batch_size must be a positive per-device batch size, got {cfg.data.batch_size}"
        )


def train(cfg: DictConfig) -> dict[str, float]:
    """Run ``cfg.task`` (fit, validate or a benchmark) and return the final metrics as plain floats."""
    _silence_known_harmless_warnings()
    validate_config(cfg)
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.get("matmul_precision"):
        torch.set_float32_matmul_precision(cfg.matmul_precision)  # TF32 on Ampere+ GPUs
        torch.backends.cudnn.allow_tf32 = cfg.matmul_precision != "highest"

    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    if cfg.get("compile"):
        model = torch.compile(model)  # Lightning unwraps it for checkpoints and hooks
    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"))
    trainer: pl.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    for logger in trainer.loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    started = time.perf_counter()
    if cfg.task == "fit":
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics = dict(trainer.callback_metrics)
    elif cfg.task == "validate":
        results = trainer.validate(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics = dict(results[0]) if results else {}
    else:
        metrics = run_benchmark_task(
            cfg.task,
            trainer=trainer,
            model=model,
            datamodule=datamodule,
            output_dir=cfg.paths.output_dir,
            config_summary=config_summary_from_cfg(cfg),
        )
    elapsed = time.perf_counter() - started

    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))}
    if trainer.is_global_zero:
        _print_summary(cfg, trainer, metrics, elapsed)
    return metrics


def _print_summary(cfg: DictConfig, trainer: pl.Trainer, metrics: dict[str, float], elapsed: float) -> None:
    out = Path(cfg.paths.output_dir)
    lines = [f"{cfg.task} finished in {elapsed / 60:.1f} min. Outputs in {out}"]
    key = cfg.get("optimized_metric")
    if key and key in metrics:
        lines.append(f"  {key} = {metrics[key]:.4f}")
    ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") if trainer.checkpoint_callback else ""
    if ckpt:
        lines.append(f"  last checkpoint: {ckpt}")
    for logger in trainer.loggers:
        lines.append(f"  {type(logger).__name__}: {logger.log_dir}")
    log.info("\n".join(lines))
