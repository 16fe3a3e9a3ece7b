"""Inference: detectors from checkpoints, NVIDIA weights or ONNX; predict on images; ONNX export."""
