"""``train(cfg)``: everything ``python train.py ...`` does, as a plain function returning metrics.

The root ``train.py`` is only the ``@hydra.main`` wrapper; tests call :func:`train` with composed configs.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
import warnings
import zipfile
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ssd_lightning import compat
from ssd_lightning.callbacks.interrupt import InterruptCheckpoint
from ssd_lightning.cli.benchmark import config_summary_from_cfg, run_benchmark_task
from ssd_lightning.cli.config_checks import check_writable_dir, validate_config
from ssd_lightning.cli.resolvers import register_resolvers
from ssd_lightning.cli.run_dir import (
    record_resolved_values,
    requeued_run,
    resolve_run_reference,
    save_run_config,
)
from ssd_lightning.cli.run_lock import own_run_dir, release_run_dirs
from ssd_lightning.errors import ConfigError, user_errors_as_messages
from ssd_lightning.io.checkpoint_io import AtomicCheckpointIO
from ssd_lightning.io.model_record import read_model_record
from ssd_lightning.io.weights import CheckpointReadError, read_checkpoint
from ssd_lightning.models import cpu_bf16

log = logging.getLogger(__name__)


register_resolvers()  # tests and scripts call train() without train.py


def _no_litlogger_tip(record: logging.LogRecord) -> bool:  # the ad for a hosted logger every Trainer prints
    return "litlogger" not in record.getMessage()


def _silence_known_harmless_warnings() -> None:
    # Lightning suggests more DataLoader workers; DALI iterators are no DataLoaders and run their own threads.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*The number of training batches \(\d+\) is smaller.*")
    # validate_config says it once, in our words
    warnings.filterwarnings("ignore", message=r".*AMP with fp16 is not supported on CPU.*")
    # Lightning's own use of a torch API deprecated in 2.10+; nothing a user can act on
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    # the summary's size estimate is all it concerns; the parameter counts are right
    warnings.filterwarnings("ignore", message=r".*is not supported by the model summary.*")
    logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(_no_litlogger_tip)  # added once


def instantiate_group(group: DictConfig | None) -> list:
    """Instantiate every entry of a ``callbacks``/``logger`` group that has a ``_target_``."""
    return [hydra.utils.instantiate(item) for item in (group or {}).values() if item and "_target_" in item]


def train(cfg: DictConfig) -> dict[str, float]:
    """Run ``cfg.task`` (``resume=``/``run_dir=``: :mod:`ssd_lightning.cli.run_dir`); return its metrics."""
    _silence_known_harmless_warnings()
    requeued = requeued_run(cfg)  # a scheduler restarted this job after a signal: continue in place
    if requeued is not None:
        OmegaConf.update(cfg, "resume", str(requeued), force_add=True)
    run_dir = cfg.paths.output_dir  # Hydra's run directory: the resumed run's own with resume=
    check_writable_dir(run_dir, "paths.output_dir")
    own_run_dir(run_dir)  # a second process in a folder that a live one trains in stops here
    try:
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        cfg = resolve_run_reference(cfg, overrides)
        return _run_task(cfg, resumed=bool(cfg.get("resume")) and requeued is None)
    finally:
        release_run_dirs()


def _run_task(cfg: DictConfig, resumed: bool) -> dict[str, float]:
    """:func:`train` in a run directory this process owns."""
    # a resumed run keeps the config it runs with in this invocation's .hydra/resume_<time>/ (a requeue runs
    # the config Hydra saved in .hydra/ again; Lightning's DDP children have no output_subdir)
    if resumed and HydraConfig.initialized() and HydraConfig.get().output_subdir:
        save_run_config(cfg, Path(cfg.paths.output_dir) / HydraConfig.get().output_subdir)
    for message in validate_config(cfg):
        log.warning(message)
    float32_precision = _float32_on_cpus_without_bf16(cfg)
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.get("matmul_precision"):
        torch.set_float32_matmul_precision(cfg.matmul_precision)  # TF32 on Ampere+ GPUs
        torch.backends.cudnn.allow_tf32 = cfg.matmul_precision != "highest"
    datamodule = hydra.utils.instantiate(cfg.data)
    if cfg.task == "inspect_data":  # looks at the data only: no model, no Trainer
        from ssd_lightning.cli.inspect_data import run_inspect_task

        return run_inspect_task(datamodule, cfg.paths.output_dir, **(cfg.get("inspect") or {}))
    resolved = {**float32_precision, **_num_classes_from_data(cfg, datamodule), **_model_from_checkpoint(cfg)}
    record_resolved_values(cfg, resolved)
    model = hydra.utils.instantiate(cfg.model)
    if cfg.get("compile"):
        # The network only, in place: the SSD decoder and losses have data-dependent shapes (graph breaks,
        # recompiles), and in-place compilation keeps the state_dict keys (checkpoints load either way).
        model.net.compile()
    trainer = _build_trainer(cfg)
    started = time.perf_counter()
    metrics = _run_job(cfg, trainer, model, datamodule)
    elapsed = time.perf_counter() - started
    _release_process_group()
    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))}
    if trainer.is_global_zero:
        _print_summary(cfg, trainer, metrics, elapsed)
    return metrics


def _build_trainer(cfg: DictConfig) -> pl.Trainer:
    """``cfg.trainer`` with the ``callbacks``/``logger`` groups and atomic checkpoint writes."""
    callbacks = instantiate_group(cfg.get("callbacks"))
    if cfg.trainer.get("enable_progress_bar") is False:  # the Trainer switch wins over callbacks.progress_bar
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.ProgressBar)]
    loggers = instantiate_group(cfg.get("logger"))
    trust = bool(OmegaConf.select(cfg, "model.trust_checkpoint", default=False))
    plugins = [
        *(hydra.utils.instantiate(cfg.trainer.get("plugins")) or []),
        AtomicCheckpointIO(trust_checkpoint=trust),
    ]
    trainer: pl.Trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, plugins=plugins
    )
    compat.check_installed(trainer)  # an unsupported Lightning/Hydra/torch fails here, in one line
    for logger in trainer.loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return trainer


def _run_job(
    cfg: DictConfig, trainer: pl.Trainer, model: pl.LightningModule, datamodule: pl.LightningDataModule
) -> dict:
    """``cfg.task`` on ``trainer``: its metrics; a signal's stop exits 128 + signal number."""
    try:
        if cfg.task == "fit":
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            return dict(trainer.callback_metrics)
        if cfg.task == "validate":
            results = trainer.validate(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            return dict(results[0]) if results else {}
        return run_benchmark_task(
            cfg.task,
            trainer=trainer,
            model=model,
            datamodule=datamodule,
            output_dir=cfg.paths.output_dir,
            config_summary=config_summary_from_cfg(cfg),
        )
    except SIGTERMException:
        _release_process_group()  # every rank stopped at the same step and saved: nobody waits for a peer
        interrupt = next((c for c in trainer.callbacks if isinstance(c, InterruptCheckpoint)), None)
        release_run_dirs()  # the requeued job may start before this process ends
        if interrupt is not None:
            interrupt.hand_over()  # SIGUSR1/SIGUSR2: the scheduler's requeue (submitit's handler exits here)
        # as shells report it: 130 after Ctrl-C, 143 after SIGTERM, 138/140 after SIGUSR1/SIGUSR2
        raise SystemExit(128 + signal.Signals[getattr(interrupt, "stopped_by", None) or "SIGTERM"]) from None
    except Exception:
        _stop_other_ranks(trainer)
        raise


def _float32_on_cpus_without_bf16(cfg: DictConfig) -> dict[str, str]:
    """bf16/fp16 on a CPU without native bf16 kernels: float32 instead (10-15x faster there), unless
    ``cpu_bf16=always``; returns the keys set."""
    precision = str(OmegaConf.select(cfg, "trainer.precision", default=""))
    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator", default="auto"))
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if cfg.get("cpu_bf16", "auto") == "always" or not on_cpu or precision not in ("bf16-mixed", "16-mixed"):
        return {}
    if cpu_bf16.cpu_has_native_bf16():
        return {}
    values = {"trainer.precision": "32-true"}
    if OmegaConf.select(cfg, "data.output_dtype") is not None:
        values["data.output_dtype"] = "float32"
    for key, value in values.items():  # force_add: also past the struct flag
        OmegaConf.update(cfg, key, value, force_add=True)
    log.warning(
        "precision %s: this CPU has no native bf16 kernels (%s; bf16 runs 10-15x slower than float32 on "
        "such CPUs), so this run is float32 (precision=fp32). cpu_bf16=always keeps bf16",
        precision,
        torch.backends.cpu.get_cpu_capability(),
    )
    return values


def _num_classes_from_data(cfg: DictConfig, datamodule: pl.LightningDataModule) -> dict[str, int]:
    """``model.net.num_classes=null``: the data's class count; returns the keys set."""
    if OmegaConf.select(cfg, "model.net.num_classes", default=0) is not None:
        return {}
    cfg.model.net.num_classes = int(datamodule.num_classes)  # the key exists: no struct flag in the way
    log.info("model.net.num_classes=null: %d, from the data", cfg.model.net.num_classes)
    return {"model.net.num_classes": cfg.model.net.num_classes}


_MODULE_OF_KIND = {
    "detector": "ssd_lightning.modules.ssd.SSDLitModule",
    "classifier": "ssd_lightning.modules.classifier.ClassifierLitModule",
}


def _model_from_checkpoint(cfg: DictConfig) -> dict[str, object]:
    """``ckpt_path=<file>``: its recorded network, EMA setting and unset decoder keys; the keys changed."""
    path = cfg.get("ckpt_path")
    if not path or "://" in str(path) or not Path(str(path)).expanduser().is_file():
        return {}  # "last"/"best" (Lightning's own), a URL, or a missing file: Lightning's to resolve
    trust = bool(OmegaConf.select(cfg, "model.trust_checkpoint", default=False))
    try:
        checkpoint = read_checkpoint(path, trust_checkpoint=trust, what="ckpt_path")
    except CheckpointReadError as e:
        raise CheckpointReadError(f"{e}{_other_complete_checkpoints(Path(path))}") from e.__cause__
    record = read_model_record(checkpoint, source=f"ckpt_path={path}")
    if record is None:
        return {}
    module = OmegaConf.select(cfg, "model._target_")
    if module != _MODULE_OF_KIND[record["kind"]]:
        raise ConfigError(
            f"ckpt_path={path} is a {record['kind']} ({record['architecture']['builder']}) but model= "
            f"builds {module}: pick the model of that kind (model=ssd300 / model=mobilenetv2, or an "
            "experiment= of it)"
        )
    values: dict[str, object] = {
        f"model.net.{k}": v for k, v in record["architecture"]["args"].items() if v is not None
    }
    hparams = checkpoint.get("hyper_parameters") or {}
    if hparams.get("ema_decay") is not None and OmegaConf.select(cfg, "model.ema_decay") is None:
        values["model.ema_decay"] = hparams["ema_decay"]
        if "use_ema" in hparams:
            values["model.use_ema"] = hparams["use_ema"]
    for key, value in (record.get("decoder") or {}).items():
        if OmegaConf.select(cfg, f"model.decoder.{key}", default=0) is None:
            values[f"model.decoder.{key}"] = value
    changed = {k: v for k, v in values.items() if OmegaConf.select(cfg, k) != v}
    for key, value in values.items():  # force_add: also past the struct flag
        OmegaConf.update(cfg, key, value, force_add=True)
    if changed:
        log.info(
            "ckpt_path=%s: the model it records: %s", path, ", ".join(f"{k}={v}" for k, v in changed.items())
        )
    return changed


def _other_complete_checkpoints(path: Path) -> str:
    """For an unreadable ``path``'s message: the complete checkpoints (zip files) beside it, newest first."""
    others = sorted(path.parent.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    complete = [p for p in others if p.resolve() != path.resolve() and zipfile.is_zipfile(p)]
    if not complete:
        return ""
    names = ", ".join(p.name for p in complete)
    return f" Complete checkpoints beside it: {names}; continue from one with ckpt_path={complete[0]}"


def _stop_other_ranks(trainer: pl.Trainer) -> None:
    """This process failed: end the ranks Lightning's launcher started from it (torchrun/SLURM do it too)."""
    for proc in compat.take_launched_processes(trainer):  # out of the observer's list before they die
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _release_process_group() -> None:
    """Destroy this rank's process group after a finished task (Lightning does only for NCCL; a live gloo
    group aborts the interpreter's shutdown with SIGABRT); not after failures (a peer may still wait)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(cfg: DictConfig) -> float | None:
    """What ``python train.py`` runs: :func:`train`, with input errors printed as one clear message."""
    with user_errors_as_messages():
        metrics = train(cfg)
    # the returned value is what Hydra sweepers optimise
    return metrics.get(cfg.get("optimized_metric") or "", None)


def _print_summary(cfg: DictConfig, trainer: pl.Trainer, metrics: dict[str, float], elapsed: float) -> None:
    lines = [f"{cfg.task} finished in {elapsed / 60:.1f} min. Outputs in {Path(cfg.paths.output_dir)}"]
    key = cfg.get("optimized_metric")
    if key and key in metrics:
        lines.append(f"  {key} = {metrics[key]:.4f}")
    if ckpt := getattr(trainer.checkpoint_callback, "last_model_path", ""):
        lines.append(f"  last checkpoint: {ckpt}")
    lines += [f"  {type(logger).__name__}: {logger.log_dir}" for logger in trainer.loggers]
    log.info("\n".join(lines))
