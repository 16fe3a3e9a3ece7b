"""A run directory as the unit users continue and evaluate: ``resume=<run dir>`` and ``run_dir=<run dir>``.

* ``resume=<dir>`` continues that run in place from ``last.ckpt``, with the config it last ran with plus
  this command line's overrides (kept in ``.hydra/resume_<time>/run_config.yaml`` for the next resume).
* ``run_dir=<dir>`` (``task=validate``) evaluates it with its config and ``best.ckpt`` (else ``last.ckpt``),
  writing to ``<dir>/<task>/<time>/``. ``ckpt_path=<file>`` wins over the checkpoint either would pick.
* A job a scheduler restarts continues as ``resume=`` would (:func:`requeued_run`).
"""

from __future__ import annotations

import functools
import logging
from datetime import datetime
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from ssd_lightning.cli.sweep_summary import launcher_rank
from ssd_lightning.errors import ConfigError
from ssd_lightning.io.atomic import atomic_write_text
from ssd_lightning.io.run_config import update_moved_targets

log = logging.getLogger(__name__)

CONFIG_GROUPS_DIR = Path(__file__).resolve().parents[2] / "configs"
# keys of this invocation that are not applied to the stored config
_INVOCATION_KEYS = ("resume", "run_dir")
# what a resumed invocation saved: the config it ran with (.hydra/resume_<time>/run_config.yaml)
RUN_CONFIG = "run_config.yaml"


@functools.cache
def _invocation_time() -> str:
    """This process's start, fixed at first use (Hydra resolves its directory keys more than once)."""
    return f"{datetime.now():%Y-%m-%d_%H-%M-%S}"


def output_dir_for(resume: str | None, run_dir: str | None, task: str, default: str) -> str:
    """Hydra's run directory: the resumed run's, ``<run_dir>/<task>/<time>`` (run_dir=), or ``default``."""
    if resume:
        return str(Path(str(resume)).expanduser())
    if run_dir:
        return f"{Path(str(run_dir)).expanduser()}/{task}/{_invocation_time()}"
    return default


def hydra_subdir_for(resume: str | None) -> str:
    """Where Hydra saves this invocation's config: ``.hydra``, or ``.hydra/resume_<time>`` when resuming."""
    return f".hydra/resume_{_invocation_time()}" if resume else ".hydra"


def log_name_for(resume: str | None, task_name: str) -> str:
    """The run's log file name (``<task_name>.log``): a resumed run keeps appending to its own."""
    stored = Path(str(resume)).expanduser() / ".hydra" / "config.yaml" if resume else None
    if stored is not None and stored.is_file():
        task_name = OmegaConf.load(stored).get("task_name") or task_name
    return f"{task_name}.log"


def latest_config_file(run: Path) -> Path:
    """The newest ``.hydra/resume_<time>/run_config.yaml``, else ``.hydra/config.yaml`` (the first start)."""
    resumed = sorted((run / ".hydra").glob(f"resume_*/{RUN_CONFIG}"))
    return resumed[-1] if resumed else run / ".hydra" / "config.yaml"


def stored_config(run: Path, key: str) -> DictConfig:
    file = latest_config_file(run)
    if not file.is_file():
        raise ConfigError(
            f"{key}={run}: {file} not found; {key} takes a run directory written by train.py "
            "(it holds .hydra/ and checkpoints/), e.g. outputs/demo/<date>_<time>"
        )
    cfg = OmegaConf.load(file)
    if moved := update_moved_targets(cfg):
        log.info(
            f"{file}: {len(moved)} point(s) at classes that have moved since the run was written: {moved}"
        )
    return cfg


def apply_overrides(
    cfg: DictConfig, overrides: list[str], key: str, choices: dict[str, str] | None = None
) -> DictConfig:
    """Apply overrides to a stored config; a config group choice only if the run had it (skipped)."""
    choices = choices or {}
    own = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in _INVOCATION_KEYS]
    own = [o for o in own if not o.lstrip("+~").startswith("hydra.")]
    for override in OverridesParser.create().parse_overrides(own):
        name = override.key_or_group
        if "." not in name and (CONFIG_GROUPS_DIR / name).is_dir() or "/" in name:
            if name in choices and str(override.value()) == str(choices[name]):
                continue
            had = f" (the run has {name}={choices[name]})" if name in choices else ""
            raise ConfigError(
                f"{key}= takes the run's own config, so the config group choice {override.input_line!r} "
                f"cannot be applied to it{had}; set the keys it would change instead ({name}.<key>=<value>)"
            )
        if override.is_sweep_override():
            raise ConfigError(f"{key}= runs one job: {override.input_line!r} is a sweep")
        with open_dict(cfg):
            if override.is_delete():
                parent, _, leaf = name.rpartition(".")
                node = OmegaConf.select(cfg, parent) if parent else cfg
                if node is not None and leaf in node:
                    del node[leaf]
            else:
                OmegaConf.update(cfg, name, override.value(), merge=True, force_add=True)
    return cfg


def requeued_run(cfg: DictConfig) -> Path | None:
    """This job's run directory when it restarts an interrupted fit (``checkpoints/interrupted.json`` names
    this scheduler job id, which a requeue keeps and a new submission changes), else None."""
    # imported here: the config resolvers import this module without Lightning
    from ssd_lightning.callbacks.interrupt import read_interruption, scheduler_job_id

    if cfg.get("task") != "fit" or cfg.get("resume") or cfg.get("run_dir") or cfg.get("ckpt_path"):
        return None
    job_id = scheduler_job_id()
    if job_id is None:
        return None
    run = Path(str(cfg.paths.output_dir)).expanduser()
    record = read_interruption(run / "checkpoints")
    if not record or record.get("job_id") != job_id:
        return None
    if not (run / "checkpoints" / "last.ckpt").is_file() or not latest_config_file(run).is_file():
        log.warning("%s: the interrupted run left no last.ckpt or config; starting over", run)
        return None
    if launcher_rank() == 0:
        log.warning(
            "Requeued job %s: continuing %s from checkpoints/last.ckpt (stopped by %s at epoch %s, step %s), "
            "as resume=%s", job_id, run, record.get("signal"), record.get("epoch"), record.get("step"), run,
        )  # fmt: skip
    return run


def resolve_run_reference(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """``cfg``, or for ``resume=``/``run_dir=`` that run's config with ``overrides`` on top, its checkpoint
    as ``ckpt_path`` (unless given) and this invocation's output directory."""
    resume, run_dir = cfg.get("resume"), cfg.get("run_dir")
    if not resume and not run_dir:
        return cfg
    if resume and run_dir:
        raise ConfigError(
            "resume= and run_dir= both given: resume=<dir> continues a run, run_dir=<dir> evaluates it"
        )
    key = "resume" if resume else "run_dir"
    run = Path(str(resume or run_dir)).expanduser()
    if resume and cfg.get("task") not in (None, "fit"):
        raise ConfigError(f"resume= continues training (task=fit); to evaluate a run use run_dir={run}")
    if resume and Path(str(cfg.paths.output_dir)).expanduser().resolve() != run.resolve():
        raise ConfigError(
            f"resume={run} continues the run in its own directory, but this run writes to "
            f"{cfg.paths.output_dir}; drop hydra.run.dir / paths.output_dir (or set them to {run})"
        )
    hydra_file = run / ".hydra" / "hydra.yaml"  # the group choices the run was composed with
    choices = (
        OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.choices") if hydra_file.is_file() else {}
    )
    merged = apply_overrides(stored_config(run, key), overrides, key, dict(choices or {}))
    if run_dir and merged.get("task") == "fit":
        raise ConfigError(f"run_dir={run} evaluates a run: add task=validate (resume={run} continues it)")
    merged.resume = str(run) if resume else None
    merged.run_dir = str(run) if run_dir else None
    merged.paths.output_dir = cfg.paths.output_dir  # this invocation's (for resume= the run's own)
    if not any(o.lstrip("+").startswith("ckpt_path=") for o in overrides):  # else the given one wins
        names = ("last.ckpt",) if resume else ("best.ckpt", "last.ckpt")
        found = [run / "checkpoints" / n for n in names if (run / "checkpoints" / n).is_file()]
        if not found:
            raise ConfigError(
                f"{key}={run}: no {' or '.join(names)} in {run / 'checkpoints'}; the run saved no "
                "checkpoint yet (it saves one every epoch and on SIGTERM/Ctrl-C)"
            )
        merged.ckpt_path = str(found[0])
    csv = OmegaConf.select(merged, "logger.csv")
    if resume and csv is not None and csv.get("_target_") == "pytorch_lightning.loggers.CSVLogger":
        csv._target_ = "ssd_lightning.io.loggers.ContinuingCSVLogger"  # keeps metrics.csv
    log.info("%s=%s: the run's own config and checkpoint %s", key, run, merged.ckpt_path)
    return merged


def save_run_config(cfg: DictConfig, folder: Path) -> None:
    """Keep the config a resumed run runs with as ``<folder>/run_config.yaml``, for the next resume."""
    if launcher_rank() == 0:
        atomic_write_text(folder / RUN_CONFIG, OmegaConf.to_yaml(cfg))


def record_resolved_values(cfg: DictConfig, values: dict[str, object]) -> None:
    """Write values decided at run time into the config this invocation saved (rank 0)."""
    if not values or launcher_rank() != 0 or not HydraConfig.initialized():
        return
    subdir = HydraConfig.get().output_subdir
    output_dir = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", default=None)
    if not subdir or not output_dir:  # a config composed without a run (tests' compose API)
        return
    folder = Path(output_dir) / subdir
    for file in filter(Path.is_file, (folder / "config.yaml", folder / RUN_CONFIG)):
        saved = OmegaConf.load(file)
        for key, value in values.items():
            OmegaConf.update(saved, key, value, force_add=True)
        atomic_write_text(file, OmegaConf.to_yaml(saved))
