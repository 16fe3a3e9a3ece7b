"""Callbacks: COCO mAP, evaluation-epoch schedule."""

from ssd_lightning.callbacks.coco_map import CocoMAPCallback
from ssd_lightning.callbacks.eval_schedule import EvalSchedule

__all__ = ["CocoMAPCallback", "EvalSchedule"]
