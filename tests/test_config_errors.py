"""Bad configuration: one clear message naming the key and what is accepted, non-zero exit, no stack trace."""

from __future__ import annotations

import re

import hydra
import pytest

from ssd_lightning.cli.config_checks import validate_config
from ssd_lightning.errors import ConfigError, user_errors_as_messages
from tests.helpers import run_train_py


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.batch_size=abc"], "data.batch_size='abc': must be a positive integer"),
        (["data.batch_size=0"], "data.batch_size=0: must be a positive integer"),
        (["data.eval_batch_size=-2"], "data.eval_batch_size=-2"),
        (["data=synthetic", "model.net.num_classes=null"], "model.net.num_classes=None: null reads it from"),
        (["model.trust_checkpoint=no"], "model.trust_checkpoint='no': must be true or false"),
        (["trainer.max_epochs=0"], "trainer.max_epochs=0"),
        (["eval_epochs=[3,1]"], "eval_epochs=[3, 1]: must be strictly increasing"),
        (["task=train"], "task='train': must be one of fit, validate"),
        (["seed=1.5"], "seed=1.5: must be an integer"),
    ],
)
def test_bad_values_name_the_key_and_what_is_accepted(overrides, expected, make_cfg):
    with pytest.raises(ConfigError) as info:
        validate_config(make_cfg(overrides), cuda_device_count=0)
    assert expected in str(info.value)
    assert str(info.value).startswith("1 config problem:")


def test_all_problems_are_reported_together(make_cfg):
    cfg = make_cfg(["data.batch_size=-1", "eval_epochs=[3,1]", "task=train"])
    with pytest.raises(ConfigError, match="3 config problems") as info:
        validate_config(cfg, cuda_device_count=0)
    for key in ("data.batch_size=-1", "eval_epochs=[3, 1]", "task='train'"):
        assert key in str(info.value)


# Checked where the value is used: the constructor Hydra calls for the group raises, and train.py prints one
# line naming the key (exit 2 for our ConfigError, 1 for the ValueError of a config-agnostic builder, whose
# key Hydra names as full_key). validate_config no longer looks at these keys.
_FAST_SSD = ["model.net.backbone=resnet18"]


@pytest.mark.parametrize(
    ("overrides", "group", "exit_code", "expected"),
    [
        (
            [*_FAST_SSD, "model.optimizer.lr=-0.1"],
            "model",
            2,
            ["model.optimizer.lr=-0.1: must be a number >= 0"],
        ),
        (
            [*_FAST_SSD, "model.optimizer.lr=fast"],
            "model",
            2,
            ["model.optimizer.lr='fast': must be a number >= 0"],
        ),
        (
            [*_FAST_SSD, "model.optimizer.weight_decay=-1"],
            "model",
            2,
            ["model.optimizer.weight_decay=-1: must be a number >= 0"],
        ),
        (
            [*_FAST_SSD, "model.scheduler.warmup_steps=-5"],
            "model",
            2,
            ["model.scheduler.warmup_steps=-5: must be an integer >= 0"],
        ),
        (
            [*_FAST_SSD, "model.scheduler.milestones=[54,43]"],
            "model",
            2,
            ["model.scheduler.milestones=[54, 43]: must be strictly increasing non-negative epochs"],
        ),
        ([*_FAST_SSD, "model.scheduler.gamma=2"], "model", 2, ["model.scheduler.gamma=2: must be in (0, 1]"]),
        (
            ["model=mobilenetv2", "model.optimizer.weight_decay=-1"],
            "model",
            2,
            ["model.optimizer.weight_decay=-1: must be a number >= 0"],
        ),
        (
            ["model=mobilenetv2", "model.net.num_classes=1"],
            "model",
            2,
            ["a classifier needs model.net.num_classes >= 2, got 1"],
        ),
        (
            ["model.net.backbone=resnet51"],
            "model",
            1,
            ["unknown backbone 'resnet51'; expected one of ['resnet18', ", "full_key: model.net"],
        ),
        (
            [*_FAST_SSD, "model.net.num_classes=1"],
            "model",
            1,
            ["num_classes counts the background too and must be >= 2, got 1", "full_key: model.net"],
        ),
        (
            [*_FAST_SSD, "model.net.background_prior=1"],
            "model",
            1,
            ["background_prior must be in (0, 1) or None, got 1", "full_key: model.net"],
        ),
        (
            [*_FAST_SSD, "model.net.background_prior=abc"],
            "model",
            1,
            ["background_prior must be in (0, 1) or None, got 'abc'", "full_key: model.net"],
        ),
        (
            [*_FAST_SSD, "model.net.num_classes=2.5"],
            "model",
            1,
            ["num_classes must be an integer (background included), got 2.5", "full_key: model.net"],
        ),
        (
            [*_FAST_SSD, "model.net.zero_init_residual=maybe"],
            "model",
            1,
            ["zero_init_residual must be True or False, got 'maybe'", "full_key: model.net"],
        ),
        (["data.num_threads=0"], "data", 1, ["num_threads must be a positive int, got 0", "full_key: data"]),
    ],
)
def test_bad_values_fail_where_they_are_used(
    overrides, group, exit_code, expected, make_cfg, capsys, monkeypatch
):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # the one line a user sees
    cfg = make_cfg(overrides)
    validate_config(cfg, cuda_device_count=0)  # not its business any more
    with pytest.raises(SystemExit) as info, user_errors_as_messages():
        hydra.utils.instantiate(cfg[group])
    assert info.value.code == exit_code
    printed = capsys.readouterr().err
    assert printed.startswith("Error: ") and "Traceback" not in printed, printed
    for text in expected:
        assert text in printed, printed


def test_the_shipped_configs_are_valid(make_cfg):
    assert validate_config(make_cfg([]), cuda_device_count=1) == []
    assert validate_config(make_cfg(["experiment=demo"]), cuda_device_count=0) == []
    assert validate_config(make_cfg(["experiment=mobilenetv2_demo"]), cuda_device_count=0) == []
    assert (
        validate_config(make_cfg(["model.net.num_classes=null"]), cuda_device_count=1) == []
    )  # from the data


@pytest.mark.parametrize(
    ("overrides", "cuda_devices", "expected"),
    [
        (
            ["experiment=ssd300_fp16_8gpu"],
            0,
            "trainer.devices=8: asks for that many GPUs but this machine has none",
        ),
        (["experiment=ssd300_fp16_8gpu"], 4, "trainer.devices=8: this machine has 4 CUDA devices"),
        (["trainer.accelerator=gpu"], 0, "trainer.accelerator='gpu': this machine has no CUDA device"),
    ],
)
def test_hardware_the_machine_lacks(overrides, cuda_devices, expected, make_cfg):
    with pytest.raises(ConfigError) as info:
        validate_config(make_cfg(overrides), cuda_device_count=cuda_devices)
    assert expected in str(info.value)


def test_hardware_that_is_there_passes(make_cfg):
    assert validate_config(make_cfg(["experiment=ssd300_fp16_8gpu"]), cuda_device_count=8) == []
    # CPU processes are not limited by GPUs
    assert validate_config(make_cfg(["trainer=ddp_cpu"]), cuda_device_count=0) == []


def test_fp16_on_a_cpu_is_a_warning_not_an_error(make_cfg):
    warnings = validate_config(make_cfg(["trainer=cpu", "precision=fp16"]), cuda_device_count=0)
    assert len(warnings) == 1 and "runs as bf16-mixed" in warnings[0]
    assert validate_config(make_cfg(["precision=fp16"]), cuda_device_count=1) == []


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_runs_float32(native, make_cfg, monkeypatch, caplog):
    from ssd_lightning.cli.train import _float32_on_cpus_without_bf16
    from ssd_lightning.models import cpu_bf16

    monkeypatch.setattr(cpu_bf16, "cpu_has_native_bf16", lambda: native)
    cfg = make_cfg(["experiment=demo"])  # precision bf16 on the CPU
    changed = _float32_on_cpus_without_bf16(cfg)
    if native:
        assert changed == {} and cfg.trainer.precision == "bf16-mixed" and cfg.data.output_dtype == "bfloat16"
    else:
        assert changed == {"trainer.precision": "32-true", "data.output_dtype": "float32"}
        assert (cfg.trainer.precision, cfg.data.output_dtype) == ("32-true", "float32")
        assert "no native bf16 kernels" in caplog.text and "cpu_bf16=always keeps bf16" in caplog.text
    kept = make_cfg(["experiment=demo", "cpu_bf16=always"])
    assert _float32_on_cpus_without_bf16(kept) == {} and kept.trainer.precision == "bf16-mixed"
    fp32 = make_cfg(["experiment=demo", "precision=fp32"])
    assert _float32_on_cpus_without_bf16(fp32) == {}
    gpu = make_cfg(["experiment=ssd300_fp16_1gpu", "trainer.accelerator=gpu"])  # not a CPU run: untouched
    assert _float32_on_cpus_without_bf16(gpu) == {} and gpu.trainer.precision == "16-mixed"


# -- the command line, as a user sees it ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "exit_code", "expected"),
    [
        # Hydra's own checks (composition): misspelled key, unknown group option
        (["data.batch_sze=8"], 1, "Key 'batch_sze' is not in struct"),
        (["model=resnet"], 1, "Could not find 'model/resnet'"),
        # ours (validate_config), before anything heavy starts
        (["experiment=demo", "data.batch_size=-8", "eval_epochs=[3,1]"], 2, "2 config problems"),
        # the constructor that uses the value, before any data is prepared
        (
            ["data=synthetic", "model.net.backbone=resnet18", "model.optimizer.weight_decay=-1"],
            2,
            "Error: model.optimizer.weight_decay=-1: must be a number >= 0",
        ),
        (["experiment=ssd300_fp16_8gpu"], 2, "trainer.devices=8: asks for that many GPUs"),
    ],
)
def test_cli_prints_one_message_and_fails(args, exit_code, expected, tmp_path):
    if "trainer.devices=8" in expected:
        import torch

        if torch.cuda.device_count() >= 8:
            pytest.skip("this machine has 8 GPUs")
    result = run_train_py(*args, f"paths.output_dir={tmp_path}")
    assert result.returncode == exit_code, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 15, result.stderr  # a message, not a stack trace


@pytest.mark.slow
def test_cli_incomplete_demo_dataset_is_one_line(tmp_path):
    """A left-over, incomplete data/shapes (an interrupted generation): one Error line saying to delete it."""
    (tmp_path / "data" / "shapes" / "train2017").mkdir(parents=True)
    result = run_train_py(
        "experiment=demo", f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / 'o'}"
    )
    assert result.returncode == 1, result.stderr
    assert "is not a complete shapes detection dataset" in result.stderr and "delete" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 15, result.stderr


@pytest.mark.slow
def test_cli_read_only_output_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    result = run_train_py(
        "experiment=demo", f"paths.output_dir={blocker}/run", "hydra.run.dir=" + str(tmp_path / "h")
    )
    assert result.returncode == 1, result.stderr
    assert f"paths.output_dir={blocker}/run is not writable" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.dali
@pytest.mark.slow
def test_cli_batch_larger_than_the_training_split_is_one_line(tmp_path):
    """Fewer training images than one batch per rank: found when the DALI reader opens; one line."""
    result = run_train_py(
        "experiment=demo",
        "data.num_train=12",
        "data.num_val=4",
        "data.batch_size=32",
        f"paths.data_dir={tmp_path / 'data'}",
        f"paths.output_dir={tmp_path / 'o'}",
    )
    assert result.returncode == 2, result.stderr
    assert re.search(
        r"^Error: \d+ training samples cannot fill one batch of 32 on each of 1 rank\(s\); "
        r"lower data.batch_size \(per device\)",
        result.stderr,
        re.M,
    ), result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 15, result.stderr
