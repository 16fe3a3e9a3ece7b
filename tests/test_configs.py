"""Every experiment composes and instantiates; the precision switch sets Trainer and data together."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
import pytorch_lightning as pl
from omegaconf import OmegaConf

from ssd_lightning.cli.train import instantiate_group, validate_config
from tests.conftest import CONFIG_DIR

EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
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


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_multi_gpu_experiments_validate_before_training(experiment, make_cfg):
    """A broken GPU val pipeline, NCCL gather or evaluator must fail in minute one, not at epoch 21."""
    cfg = make_cfg([f"experiment={experiment}"])
    if cfg.trainer.devices == 1 or cfg.task != "fit":
        return
    assert cfg.trainer.num_sanity_val_steps >= 1, experiment


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
