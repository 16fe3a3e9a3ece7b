"""Detect objects in (or classify) your own images with a trained model: the checkpoint says which.

python predict.py ckpt_path=outputs/demo/<run>/checkpoints/last.ckpt input=photos/ output=predictions
python predict.py nvidia_checkpoint=nvidia_ssdpyt_amp.pt input='photos/*.jpg' output=predictions
python predict.py onnx=model_e2e.onnx input=photos/    # scripts/export_onnx.py ... end_to_end=true
python predict.py ckpt_path=... input=data/shapes/val2017 \
    annotations=data/shapes/annotations/instances_val2017.json    # + <output>/coco_eval.json

``input`` is an image, a folder (subfolders too with ``recursive=true``, the default), a quoted glob or a list
file (``@list.txt``). Writes <output>/<name>.jpg (boxes with score >= draw_score_thresh; the input's path
relative to its folder, suffix .jpg), <output>/predictions.jsonl (one line per image as it is done) and
<output>/predictions.json (COCO results format plus file_name, written at the end);
with ``annotations=<COCO instances JSON>`` image ids are that file's and <output>/coco_eval.json holds the
COCO metrics. A classifier checkpoint (MobileNetV2 run) writes each image's ``top_k`` classes with scores
to <output>/predictions.json; ``annotations=<ImageFolder root>`` scores top-1/top-5
(<output>/classification_eval.json). Unreadable files are skipped with a message; the exit status is
non-zero only if no image could be processed. Settings: configs/predict.yaml.
"""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from ssd_lightning.inference.predict import predict_from_settings


@hydra.main(version_base="1.3", config_path="configs", config_name="predict")
def main(cfg: DictConfig) -> None:
    status = predict_from_settings(OmegaConf.to_container(cfg, resolve=True))
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
