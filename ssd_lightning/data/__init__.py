"""Data: DALI LightningDataModules, the category map, synthetic data, the demo dataset generator.

Import each module directly (``ssd_lightning.data.categories``, ``.synthetic``, ``.coco_datamodule``): the
package itself imports nothing, so the category map loads without Lightning or DALI.
"""
