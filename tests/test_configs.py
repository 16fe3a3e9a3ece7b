"""Every experiment composes, instantiates and states only its differences; the precision switch sets
Trainer and data together; every key a user may override is declared in its group."""

from __future__ import annotations

import inspect
from functools import cache
from pathlib import Path

import hydra
import pytest
import pytorch_lightning as pl
import yaml
from omegaconf import OmegaConf, open_dict

from ssd_lightning.cli.train import instantiate_group, validate_config
from tests.helpers import CONFIG_DIR, compose_config

EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
EXPERIMENTS_AND_BASES = sorted(
    p.relative_to(CONFIG_DIR / "experiment").with_suffix("").as_posix()
    for p in (CONFIG_DIR / "experiment").rglob("*.yaml")
)
# Tiny overrides so any experiment instantiates on a 2-core CPU box.
CPU_OVERRIDES = [
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.num_nodes=1",
    "trainer.strategy=auto",
]


def test_experiment_catalogue_is_not_empty():
    assert "demo" in EXPERIMENTS and "ssd300_eval" in EXPERIMENTS


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(experiment, make_cfg):
    cfg = make_cfg([f"experiment={experiment}", *CPU_OVERRIDES])
    for key in ("weights_backbone", "weights"):  # nothing downloads here
        if key in cfg.model.net:
            cfg.model.net[key] = None
    if cfg.model.net.num_classes is None:  # the own-data recipes: train.py reads it from the data
        cfg.model.net.num_classes = 5
    OmegaConf.resolve(cfg)  # every interpolation resolves
    validate_config(cfg)
    datamodule = hydra.utils.instantiate(cfg.data)
    assert isinstance(datamodule, pl.LightningDataModule)
    assert datamodule.batch_size == cfg.data.batch_size
    module = hydra.utils.instantiate(cfg.model)
    assert isinstance(module, pl.LightningModule)
    for callback in instantiate_group(cfg.get("callbacks")):
        assert isinstance(callback, pl.Callback)
    trainer = hydra.utils.instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
    assert isinstance(trainer, pl.Trainer)


@pytest.mark.parametrize(
    ("switch", "trainer_precision", "dtype"),
    [("fp16", "16-mixed", "float16"), ("fp32", "32-true", "float32"), ("bf16", "bf16-mixed", "bfloat16")],
)
def test_precision_switch_sets_trainer_and_data_together(switch, trainer_precision, dtype, make_cfg):
    cfg = make_cfg([f"precision={switch}"])
    assert cfg.trainer.precision == trainer_precision
    assert cfg.data.output_dtype == dtype


def test_experiment_overrides_only_what_it_states(make_cfg):
    base = make_cfg([])
    demo = make_cfg(["experiment=demo"])
    assert base.model.optimizer.momentum == 0.9 and base.model.net.backbone == "resnet50"
    assert demo.model.net.backbone == "mobilenet_v2"
    assert "momentum" not in demo.model.optimizer  # optimizer group swapped, not merged into SGD's keys
    assert demo.model.decoder == base.model.decoder  # untouched keys inherited
    assert base.model.net.width_mult == 1.0 and base.eval_epochs == [21, 31, 37, 42, 48, 53, 59, 64]


def test_demo_recipe(make_cfg):
    """The demo of README's "What make train does": half-width MobileNetV2, 3,400 training images of 1-9
    shapes, 4 epochs of a cosine LR ending at 10 % of its peak, evaluated after every one; the held-out
    split's settings as before (200 images, seed 0, shapes 15-75 % of the short side)."""
    demo = make_cfg(["experiment=demo"])
    assert demo.model.net.width_mult == 0.5 and demo.model.net.backbone == "mobilenet_v2"
    assert (demo.data.num_train, demo.data.max_objects_train) == (3400, 9)
    assert (demo.data.num_val, demo.data.dataset_seed, demo.data.min_scale, demo.data.max_scale) == (
        200, 0, 0.15, 0.75,
    )  # fmt: skip
    assert demo.trainer.max_epochs == 4 and list(demo.eval_epochs) == [0, 1, 2]  # + the last, always
    assert (demo.model.scheduler.name, demo.model.scheduler.min_factor) == ("cosine", 0.1)
    assert demo.callbacks.eval_schedule.always_last
    # the demo on the user's own COCO-layout data (README): no shapes-only key reaches CocoDALIDataModule
    own = make_cfg(["experiment=demo", "data=coco"])
    assert own.data._target_.endswith("CocoDALIDataModule") and own.data.augment is False
    assert not {"num_train", "max_objects_train", "min_scale", "dataset_seed"} & set(own.data)


def test_save_switch_keeps_every_epoch(make_cfg):
    assert make_cfg(["save=true"]).callbacks.model_checkpoint.save_top_k == -1
    assert make_cfg(["save=false"]).callbacks.model_checkpoint.save_top_k == 1  # newest only


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task=train"], "task='train'"),
        (["eval_epochs=[3,1]"], "eval_epochs"),
        (["data.batch_size=-4"], "data.batch_size"),
    ],
)
def test_bad_values_are_named(overrides, message, make_cfg):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        validate_config(make_cfg(overrides))


def test_output_dir_is_the_run_dir(make_cfg, tmp_path):
    cfg = make_cfg([])
    assert Path(cfg.paths.output_dir) == tmp_path
    assert cfg.callbacks.model_checkpoint.dirpath == f"{tmp_path}/checkpoints"


def test_multi_gpu_experiments_validate_before_training(make_cfg):
    """A broken GPU val pipeline, NCCL gather or evaluator must fail in minute one, not at epoch 21."""
    multi_gpu = []
    for experiment in EXPERIMENTS:
        cfg = make_cfg([f"experiment={experiment}"])
        if cfg.trainer.devices != 1 and cfg.task == "fit":
            multi_gpu.append(experiment)
            assert cfg.trainer.num_sanity_val_steps >= 1, experiment
    assert "ssd300_fp16_8gpu" in multi_gpu and "mobilenetv2_imagenet_8gpu" in multi_gpu, multi_gpu


def test_ddp_configs_pass_the_ddp_options_to_lightning(make_cfg):
    """trainer=ddp and trainer=ddp_cpu build the same DDPStrategy (gradients as bucket views)."""
    for group in ("ddp", "ddp_cpu"):
        cfg = make_cfg([f"trainer={group}", "trainer.accelerator=cpu", "trainer.devices=2"])
        trainer = hydra.utils.instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
        assert isinstance(trainer.strategy, pl.strategies.DDPStrategy)
        assert trainer.strategy._ddp_kwargs == {
            "gradient_as_bucket_view": True,
            "find_unused_parameters": False,
        }
    assert make_cfg(["trainer=ddp", "trainer.strategy=ddp_spawn"]).trainer.strategy == "ddp_spawn"


def test_coco_paths_are_overridable_and_default_to_the_root(make_cfg):
    """`data.train_images` & co. exist in configs/data/coco.yaml; null derives them from `data.root`."""
    cfg = make_cfg(
        ["data=coco", "data.root=/c", "data.val_images=/v/imgs", "data.val_annotations=/v/ann.json"]
    )
    dm = hydra.utils.instantiate(cfg.data)
    assert (str(dm.val_images), str(dm.val_annotations)) == ("/v/imgs", "/v/ann.json")
    assert str(dm.train_images) == "/c/train2017"
    assert str(dm.train_annotations) == "/c/annotations/instances_train2017.json"


def test_recipes_keep_the_references_settings(make_cfg):
    """torchvision's MobileNetV2 run decayed every parameter; NVIDIA's A100 FP32 SSD script stays NHWC."""
    from ssd_lightning.models import mobilenet_v2
    from ssd_lightning.optim import param_groups

    model = make_cfg(["experiment=mobilenetv2_imagenet_8gpu"]).model
    groups = param_groups(
        mobilenet_v2(num_classes=10),
        model.optimizer.weight_decay,
        norm_weight_decay=model.norm_weight_decay,
        bias_weight_decay=model.bias_weight_decay,
        depthwise_weight_decay=model.depthwise_weight_decay,
    )
    assert {g["weight_decay"] for g in groups} == {4e-5}
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(
        p.numel() for p in mobilenet_v2(num_classes=10).parameters()
    )
    assert make_cfg(["experiment=ssd300_a100_fp32_8gpu"]).model.channels_last is True


@pytest.mark.parametrize(
    ("weights", "expected"), [(None, 256), ("IMAGENET1K_V1", 256), ("IMAGENET1K_V2", 232), ("DEFAULT", 232)]
)
def test_imagenet_eval_resize_follows_the_weights(make_cfg, weights, expected):
    """torchvision evaluates V1 weights at 256 -> 224, V2 weights at 232 -> 224; an explicit number wins."""
    weights_override = "null" if weights is None else weights
    cfg = make_cfg(["experiment=mobilenetv2_imagenet_8gpu", f"model.net.weights={weights_override}"])
    assert cfg.data.val_resize == expected
    assert cfg.data.image_size == 224
    cfg = make_cfg(["experiment=mobilenetv2_imagenet_8gpu", "data.val_resize=240"])
    assert cfg.data.val_resize == 240


# --- configs/ state each value once ---------------------------------------------------------------------
# Keys an experiment sets that its group does not declare yet (a model/*.yaml change, not this folder's)
UNDECLARED_MODEL_KEYS: set[str] = set()


@cache
def _raw(overrides: tuple[str, ...]) -> tuple[dict, dict]:
    """The composed config of ``overrides`` (interpolations kept) and its config group choices."""
    cfg = compose_config(list(overrides))
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=False), choices


def _leaves(node: dict, prefix: str = "") -> dict[str, object]:
    """``{"a.b.c": value}`` of every leaf of a nested dict (a null or a list is a leaf)."""
    out = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        out.update(_leaves(value, f"{path}.") if isinstance(value, dict) and value else {path: value})
    return out


def _lookup(cfg: dict, path: str) -> tuple[bool, object]:
    node = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _experiment_layers(name: str) -> tuple[tuple[str, ...], list[tuple[str, str]], dict]:
    """What ``experiment/<name>.yaml`` builds on (its parent experiments as overrides), its group overrides
    and its own body."""
    raw = yaml.safe_load((CONFIG_DIR / "experiment" / f"{name}.yaml").read_text()) or {}
    parents, groups = [], []
    for entry in raw.pop("defaults", []):
        if isinstance(entry, str):
            if entry != "_self_":
                parents.append(f"experiment={entry}")
        else:
            ((key, value),) = entry.items()
            groups.append((key.removeprefix("override /"), None if value is None else str(value)))
    return tuple(parents), groups, raw


@pytest.mark.parametrize("experiment", EXPERIMENTS_AND_BASES)
def test_experiments_state_only_their_differences(experiment):
    """Every value an experiment sets differs from what it builds on (groups, defaults, parent experiment),
    every group it picks differs from the one it would get, and every key it sets is declared below it."""
    parents, groups, body = _experiment_layers(experiment)
    _, inherited_choices = _raw(parents)
    for group, choice in groups:
        assert inherited_choices.get(group) != choice, f"{experiment}: {group}={choice} is inherited"
    below, _ = _raw((*parents, *(f"~{g}" if c is None else f"{g}={c}" for g, c in groups)))
    trainer_args = inspect.signature(pl.Trainer.__init__).parameters
    for path, value in _leaves(body).items():
        declared, inherited = _lookup(below, path)
        # trainer/*.yaml declares what the recipes choose; Lightning's signature declares the other arguments
        lightning_arg = path.startswith("trainer.") and path.split(".")[1] in trainer_args
        assert declared or lightning_arg or path in UNDECLARED_MODEL_KEYS, f"{experiment}: {path} undeclared"
        assert not declared or inherited != value, f"{experiment}: {path}={value!r} restates what it inherits"


def test_logger_choices(make_cfg):
    """logger=default is CSV + TensorBoard, logger=csv the CSV logger alone, with the same settings."""
    both, csv = make_cfg(["logger=default"]).logger, make_cfg(["logger=csv"]).logger
    assert list(both) == ["csv", "tensorboard"] and list(csv) == ["csv"]
    assert both.csv == csv.csv and csv.csv._target_ == "ssd_lightning.io.loggers.ContinuingCSVLogger"
    assert both.tensorboard.default_hp_metric is False


def test_callback_sets_bring_their_own_run_settings(make_cfg):
    """callbacks=classification: the training set, validation every epoch, top-1 returned and monitored;
    callbacks=benchmark: the throughput callback alone, its iteration counts at the top level."""
    training, classification = make_cfg(["callbacks=training"]), make_cfg(["callbacks=classification"])
    assert OmegaConf.to_container(classification.callbacks) == OmegaConf.to_container(training.callbacks)
    assert {"coco_map", "eval_schedule"} <= set(make_cfg([]).callbacks) - set(classification.callbacks)
    assert classification.optimized_metric == "val/acc1" and classification.eval_epochs is None
    assert classification.callbacks.best_checkpoint.monitor == "val/acc1"
    own_metric = make_cfg(["callbacks=classification", "optimized_metric=val/loss"])
    assert own_metric.callbacks.best_checkpoint.monitor == "val/loss"
    bench = make_cfg(["callbacks=benchmark", "benchmark_warmup=3", "include_data_loading=true"])
    assert list(bench.callbacks) == ["throughput"] and bench.optimized_metric == "images_per_second_median"
    assert (bench.callbacks.throughput.warmup, bench.callbacks.throughput.iterations) == (3, 200)
    assert bench.callbacks.throughput.include_data_loading is True


def _init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword parameters ``cls(...)`` takes, following ``**kwargs`` up to the bases' ``__init__``."""
    parameters: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        found = inspect.signature(klass.__init__).parameters
        for name, parameter in found.items():
            parameters.setdefault(name, parameter)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in found.values()):
            break
    return parameters


@pytest.mark.parametrize(
    ("group", "keys"),
    [
        ("coco", {"augment": True, "shuffle": True, "include_crowd": True, "check_files": True}),
        ("shapes", {"augment": True, "shuffle": True}),
        ("imagenet", {"train_dir": None, "val_dir": None, "shuffle": True, "check_files": True}),
    ],
)
def test_data_options_are_declared_with_the_datamodules_defaults(group, keys, make_cfg):
    """What a user may override is in the data group (no `+`), with the value the datamodule would use."""
    data = make_cfg([f"data={group}"]).data
    parameters = _init_parameters(hydra.utils.get_class(data._target_))
    for key, value in keys.items():
        assert data[key] == value, key
        assert parameters[key].default == value, key
    assert make_cfg([f"data={group}", "data.shuffle=false"]).data.shuffle is False
