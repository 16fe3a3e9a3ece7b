"""Callbacks: COCO mAP, error analysis, eval schedule, benchmark, training speed, pictures, curves, interrupt,
NaN guard."""

from ssd_lightning.callbacks.analysis import DetectionAnalysis
from ssd_lightning.callbacks.coco_map import CocoMAPCallback
from ssd_lightning.callbacks.curves import TrainingCurves
from ssd_lightning.callbacks.eval_schedule import EvalSchedule
from ssd_lightning.callbacks.interrupt import InterruptCheckpoint
from ssd_lightning.callbacks.nonfinite import NonFiniteGuard
from ssd_lightning.callbacks.pictures import PredictionPictures
from ssd_lightning.callbacks.progress import StepMetricsProgressBar
from ssd_lightning.callbacks.throughput import ThroughputBenchmark
from ssd_lightning.callbacks.training_speed import TrainingSpeed

__all__ = [
    "CocoMAPCallback",
    "DetectionAnalysis",
    "EvalSchedule",
    "InterruptCheckpoint",
    "NonFiniteGuard",
    "PredictionPictures",
    "StepMetricsProgressBar",
    "ThroughputBenchmark",
    "TrainingCurves",
    "TrainingSpeed",
]
