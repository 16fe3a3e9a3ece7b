"""LightningModules: they take plain arguments, never a config object."""
