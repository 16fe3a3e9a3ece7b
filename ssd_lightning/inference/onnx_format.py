"""The ONNX files this project exports: output names and the metadata entries (JSON strings)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["END_TO_END_OUTPUTS", "METADATA_KEYS", "NETWORK_OUTPUTS", "metadata_entry", "read_metadata"]

NETWORK_OUTPUTS: tuple[str, ...] = ("locs", "logits")  # of the network-only graph, in order
END_TO_END_OUTPUTS: tuple[str, ...] = ("boxes", "scores", "labels", "num_detections")
#: Metadata entries written with an end-to-end export (``export.export_end_to_end``).
METADATA_KEYS: tuple[str, ...] = ("class_names", "category_ids", "decoder", "image_size")
_PREFIX = "ssd_lightning."


def metadata_entry(key: str, value: Any) -> tuple[str, str]:
    """``(name, JSON text)`` of one metadata entry as stored in the ONNX file's ``metadata_props``."""
    return _PREFIX + key, json.dumps(value)


def read_metadata(custom_metadata: Mapping[str, str]) -> dict[str, Any]:
    """The :func:`metadata_entry` entries of an onnxruntime ``custom_metadata_map`` (or metadata_props)."""
    return {
        k.removeprefix(_PREFIX): json.loads(v) for k, v in custom_metadata.items() if k.startswith(_PREFIX)
    }
