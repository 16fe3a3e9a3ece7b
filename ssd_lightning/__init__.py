"""SSD300 v1.1 and MobileNetV2 training with PyTorch Lightning, Hydra and NVIDIA DALI."""

__version__ = "0.1.0"
