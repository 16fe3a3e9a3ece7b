"""Detect objects in your own images with a trained SSD300.

python predict.py ckpt_path=outputs/demo/<run>/checkpoints/last.ckpt input=photos/ output=predictions
python predict.py nvidia_checkpoint=nvidia_ssdpyt_amp.pt input='photos/*.jpg' output=predictions
python predict.py onnx=model_e2e.onnx input=photos/    # scripts/export_onnx.py ... end_to_end=true
python predict.py ckpt_path=... input=data/shapes/val2017 \
    annotations=data/shapes/annotations/instances_val2017.json    # + <output>/coco_eval.json

``input`` is an image, a folder (subfolders too with ``recursive=true``, the default), a quoted glob or a list
file (``@list.txt``). Writes <output>/<name>.jpg (boxes with score >= draw_score_thresh; the input's path
relative to its folder, suffix .jpg) and <output>/predictions.json (COCO results format plus file_name);
with ``annotations=<COCO instances JSON>`` image ids are that file's and <output>/coco_eval.json holds the
COCO metrics. Unreadable files are skipped with a message; the exit status is non-zero only if no image
could be processed. Settings: configs/predict.yaml.
"""

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from ssd_lightning.errors import user_errors_as_messages
from ssd_lightning.inference.detector import load_detector_from_settings
from ssd_lightning.inference.predict import categories_for_annotations, evaluate_predictions, predict_images
from ssd_lightning.inference.sources import collect_inputs, load_annotation_file, match_annotation_ids

log = logging.getLogger("predict")


def run(cfg: DictConfig) -> None:
    """Collect the inputs (and their annotation ids), load the detector, predict, evaluate."""
    inputs = collect_inputs(cfg.input, recursive=cfg.recursive, exclude=[cfg.output])
    image_ids = dataset = None
    if cfg.annotations:
        dataset = load_annotation_file(cfg.annotations)
        image_ids = match_annotation_ids(inputs, dataset, where=f"annotations={cfg.annotations}")
    detector = load_detector_from_settings(OmegaConf.to_container(cfg, resolve=True))
    categories = None
    if dataset is not None:
        categories = categories_for_annotations(
            detector.categories, dataset, where=f"annotations={cfg.annotations}"
        )
    log.info("%d input file(s); weights from %s; device %s", len(inputs), detector.source, detector.runs_on)
    results, failures = predict_images(
        detector,
        inputs,
        cfg.output,
        batch_size=cfg.batch_size,
        draw_score_thresh=cfg.draw_score_thresh,
        draw=cfg.draw,
        image_ids=image_ids,
        categories=categories,
        workers=cfg.workers,
        progress=cfg.progress,
    )
    done = len(inputs) - len(failures)
    log.info("%d image(s), %d detection(s) -> %s/predictions.json", done, len(results), cfg.output)
    if failures:
        shown = ", ".join(str(p) for p, _ in failures[:10]) + (", ..." if len(failures) > 10 else "")
        log.error("%d file(s) skipped: %s", len(failures), shown)
    if done == 0:
        log.error("no image could be read")
        sys.exit(1)
    if image_ids is not None:
        annotated = len(dataset["images"])
        evaluate_predictions(cfg.annotations, results, image_ids, cfg.output, annotated_images=annotated)


@hydra.main(version_base="1.3", config_path="configs", config_name="predict")
def main(cfg: DictConfig) -> None:
    with user_errors_as_messages():
        run(cfg)


if __name__ == "__main__":
    main()
