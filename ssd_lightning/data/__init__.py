"""Data: DALI LightningDataModules, the category map, synthetic data, the demo dataset generator.

Import each module directly: the package imports nothing, so the category map loads without Lightning or DALI.
"""
