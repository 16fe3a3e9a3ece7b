"""Detect objects in your own images with a trained SSD300.

python predict.py ckpt_path=outputs/demo/<run>/checkpoints/last.ckpt input=photos/ output=predictions
python predict.py nvidia_checkpoint=nvidia_ssdpyt_amp.pt input='photos/*.jpg' output=predictions
python predict.py onnx=model_e2e.onnx input=photos/    # scripts/export_onnx.py ... end_to_end=true

Writes <output>/<image stem>.jpg (boxes with score >= draw_score_thresh) and <output>/predictions.json
(COCO results format plus file_name). Unreadable files are skipped with a message; the exit status is
non-zero only if no image could be processed. Settings: configs/predict.yaml.
"""

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from ssd_lightning.inference.detector import load_detector_from_settings
from ssd_lightning.inference.predict import collect_inputs, predict_images

log = logging.getLogger("predict")


@hydra.main(version_base="1.3", config_path="configs", config_name="predict")
def main(cfg: DictConfig) -> None:
    detector = load_detector_from_settings(OmegaConf.to_container(cfg, resolve=True))
    inputs = collect_inputs(cfg.input)
    log.info("%d input file(s); weights from %s; device %s", len(inputs), detector.source, detector.runs_on)
    results, failures = predict_images(
        detector,
        inputs,
        cfg.output,
        batch_size=cfg.batch_size,
        draw_score_thresh=cfg.draw_score_thresh,
        draw=cfg.draw,
    )
    done = len(inputs) - len(failures)
    log.info("%d image(s), %d detection(s) -> %s/predictions.json", done, len(results), cfg.output)
    if failures:
        log.error("%d file(s) skipped: %s", len(failures), ", ".join(str(p) for p, _ in failures))
    if done == 0:
        log.error("no image could be read")
        sys.exit(1)


if __name__ == "__main__":
    main()
