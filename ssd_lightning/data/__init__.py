"""Data: DALI LightningDataModules, the category map, synthetic data, the demo dataset generator.

The DALI datamodules live in ``coco_datamodule`` and ``imagefolder_datamodule`` and are imported from
there, so that synthetic data and the category map work on machines without DALI.
"""

from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.data.synthetic import SyntheticClassificationDataModule, SyntheticDetectionDataModule

__all__ = ["CategoryMap", "SyntheticClassificationDataModule", "SyntheticDetectionDataModule"]
