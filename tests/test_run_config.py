"""Run directories written before classes moved still resume, evaluate and predict (io/run_config.py)."""

from __future__ import annotations

import hydra
import pytest
from omegaconf import OmegaConf

from ssd_lightning.cli.run_dir import stored_config
from ssd_lightning.io.run_config import MOVED_TARGETS, update_moved_targets

pytestmark = pytest.mark.no_dali

OLD = """
logger:
  csv:
    _target_: ssd_lightning.loggers.ContinuingCSVLogger
    save_dir: ${paths.output_dir}
    name: csv
    version: ''
model:
  net:
    _target_: ssd_lightning.models.mobilenet_v2
    num_classes: 3
    width_mult: 0.5
    pretrained_path: null
    trust_checkpoint: false
  other: {_target_: ssd_lightning.models.ssd300}
paths:
  output_dir: OUT
"""


def test_moved_targets_point_at_importable_classes():
    for new in MOVED_TARGETS.values():
        assert callable(hydra.utils.get_object(new)), new
    with pytest.raises(ImportError):
        hydra.utils.get_object("ssd_lightning.loggers.ContinuingCSVLogger")
    with pytest.raises(TypeError, match="pretrained_path"):  # the pure builder reads no files
        hydra.utils.get_object("ssd_lightning.models.mobilenet_v2")(pretrained_path=None)


def test_an_old_run_config_instantiates_after_the_update(tmp_path):
    cfg = OmegaConf.create(OLD.replace("OUT", str(tmp_path)))
    assert update_moved_targets(cfg) == ["logger.csv._target_", "model.net._target_"]
    assert cfg.model.other._target_ == "ssd_lightning.models.ssd300"  # not moved: untouched
    assert OmegaConf.to_container(cfg)["logger"]["csv"]["save_dir"] == "${paths.output_dir}"  # unresolved
    logger = hydra.utils.instantiate(cfg.logger.csv)
    assert type(logger).__name__ == "ContinuingCSVLogger"
    net = hydra.utils.instantiate(cfg.model.net)
    assert net.classifier[-1].out_features == 3
    assert update_moved_targets(cfg) == []


def test_resume_reads_an_old_run_config_with_the_current_classes(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(OLD.replace("OUT", str(tmp_path)))
    cfg = stored_config(tmp_path, "resume")
    assert cfg.logger.csv._target_ == MOVED_TARGETS["ssd_lightning.loggers.ContinuingCSVLogger"]
    assert cfg.model.net._target_ == "ssd_lightning.modules.nets.build_mobilenet_v2"
