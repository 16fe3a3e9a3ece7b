"""Weight files: reading them without running their code, their layouts, and partial initialisation.

Every weights file is read with ``torch.load(weights_only=True)`` plus :data:`SAFE_GLOBALS`; anything else is
refused (:class:`UntrustedCheckpointError`) before its code runs, unless ``trust_checkpoint=True``.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ssd_lightning.errors import ConfigError, UserError

log = logging.getLogger(__name__)

#: What ``weights_only=True`` may rebuild beyond tensors and containers: the NVIDIA reference's checkpoints
#: can hold its ``argparse.Namespace`` (rebuilt by setting attributes, calling nothing the file names).
SAFE_GLOBALS: list[type] = [argparse.Namespace]

#: Wrappers' key prefixes: DDP (``module.``), LightningModules (``net.``, ``model.``), torch.compile.
_WRAPPER_PREFIXES = ("module.", "net.", "model.", "_orig_mod.")


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """A weights file named by the config or an argument does not exist."""


class CheckpointReadError(UserError, ValueError):
    """A weights file exists but is no checkpoint ``torch.load`` can read."""


class UntrustedCheckpointError(UserError, pickle.UnpicklingError):
    """A checkpoint holds Python objects that only full unpickling (``trust_checkpoint``) would rebuild."""


def untrusted_message(what: str, path: str | os.PathLike, error: BaseException) -> str:
    """The message of :class:`UntrustedCheckpointError`: what the file holds and the two ways out."""
    named = re.search(r"GLOBAL (\S+)", str(error))
    detail = f"it names {named.group(1)}" if named else type(error).__name__
    return (
        f"{what}={path} holds Python objects beyond tensors and plain values ({detail}); loading it means "
        "unpickling them, which can run code from the file, so it was not loaded. If you trust where the "
        "file comes from, set trust_checkpoint=true (train.py: model.trust_checkpoint=true; Python: "
        "trust_checkpoint=True). Otherwise load it once where you trust it and keep only its weights: "
        "torch.save(state_dict, 'weights.pt')"
    )


INIT_FROM_FILES = (
    "a .ckpt of a run of this project, an NVIDIA SSD300 checkpoint or a state dict (when resuming with "
    "ckpt_path=, init_from is not read)"
)


def check_checkpoint_file(path: str | os.PathLike, *, what: str, expected: str = "") -> Path:
    """``path`` expanded, or :class:`CheckpointNotFoundError` naming ``what`` (and ``expected``)."""
    path = Path(path).expanduser()
    if not path.is_file():
        hint = f"; point {what} at {expected}" if expected else ""
        raise CheckpointNotFoundError(f"{what}={path} not found: no such file{hint}")
    return path


def read_checkpoint(
    path: str | os.PathLike, *, trust_checkpoint: bool = False, what: str = "checkpoint", expected: str = ""
) -> Any:
    """``torch.load`` on the CPU, ``weights_only`` unless ``trust_checkpoint``; ``what`` names the file in
    messages. :class:`UntrustedCheckpointError`: refused before anything of the file ran."""
    path = check_checkpoint_file(path, what=what, expected=expected)
    try:
        if trust_checkpoint:
            log.warning("%s=%s: unpickling it fully (trust_checkpoint=true)", what, path)
            return torch.load(path, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        # "GLOBAL": the file names a class or function to call
        if isinstance(e, pickle.UnpicklingError) and not trust_checkpoint and "GLOBAL" in str(e):
            raise UntrustedCheckpointError(untrusted_message(what, path, e)) from None
        text = str(e)
        found = re.search(r"WeightsUnpickler error: \s*([^\n]{1,120})", text)
        first_sentence = text.splitlines()[0].split(". ")[0][:200] if text else type(e).__name__
        raise CheckpointReadError(
            f"{what}={path} is not a checkpoint torch.load can read ({type(e).__name__}: "
            f"{found.group(1) if found else first_sentence}); is it truncated, or another kind of file?"
        ) from e


# --------------------------------------------------------------------------- layouts
def unwrap_distributed_key(key: object) -> str:
    """``module.1.conf.0.weight`` / ``module.conf.0.weight`` -> ``conf.0.weight`` (the reference's rule)."""
    return re.sub(r"^module\.(1\.)?", "", str(key))


def read_nvidia_state_dict(
    path_or_checkpoint: str | os.PathLike | Mapping[str, object], *, trust_checkpoint: bool = False
) -> dict[str, Tensor]:
    """The tensors of an NVIDIA SSD300 checkpoint or a bare state dict, DDP prefixes removed."""
    checkpoint = path_or_checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = read_checkpoint(checkpoint, trust_checkpoint=trust_checkpoint, what="nvidia_checkpoint")
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"expected a checkpoint dict or a state dict, got {type(checkpoint).__name__}")
    state = checkpoint.get("model", checkpoint)
    if not isinstance(state, Mapping):
        raise ValueError(f"checkpoint['model'] must be a state dict, got {type(state).__name__}")
    return {unwrap_distributed_key(k): v for k, v in state.items() if isinstance(v, Tensor)}


def network_state_dict(checkpoint: object, *, source: str) -> tuple[dict[str, Tensor], list[str]]:
    """The network's tensors in a Lightning, NVIDIA/torchvision or plain checkpoint, wrapper prefixes removed,
    and the keys left out (e.g. an EMA copy); CheckpointReadError when there are none."""
    container, key_of = checkpoint, str
    if isinstance(checkpoint, Mapping):
        if isinstance(checkpoint.get("state_dict"), Mapping):
            container = checkpoint["state_dict"]
        elif isinstance(checkpoint.get("model"), Mapping):  # NVIDIA's layout, read_nvidia_state_dict's keys
            container, key_of = checkpoint["model"], unwrap_distributed_key
    if not isinstance(container, Mapping):
        raise CheckpointReadError(
            f"{source} holds no state dict but a {type(checkpoint).__name__}: expected a dict of tensors "
            "or a checkpoint dict"
        )
    state = {key_of(k): v for k, v in container.items() if isinstance(v, Tensor)}
    left_out = [str(k) for k, v in container.items() if not isinstance(v, Tensor)]
    # the first wrapper prefix any key has, again and again: "net._orig_mod.features.0" -> "features.0"
    while prefix := next((p for p in _WRAPPER_PREFIXES if any(k.startswith(p) for k in state)), None):
        left_out += [k for k in state if not k.startswith(prefix)]
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not state:
        raise CheckpointReadError(
            f"{source} holds no state dict: expected a dict of tensors, a Lightning checkpoint "
            "('state_dict') or an NVIDIA / torchvision checkpoint ('model')"
        )
    return state, left_out


# --------------------------------------------------------------------------- partial initialisation
def _preview(keys: list[str], n: int = 3) -> str:
    if not keys:
        return ""
    more = f", +{len(keys) - n} more" if len(keys) > n else ""
    return f" ({', '.join(keys[:n])}{more})"


@dataclass
class InitReport:
    """What :func:`init_from_checkpoint` did, key by key (model-side names)."""

    source: str
    loaded: list[str] = field(default_factory=list)  # copied from the file
    other_shape: list[str] = field(default_factory=list)  # in the file with another shape: left at init
    absent: list[str] = field(default_factory=list)  # not in the file: left at init
    unused: list[str] = field(default_factory=list)  # file tensors the model has no place for
    left_out: list[str] = field(default_factory=list)  # file entries outside the network (EMA, metrics)
    loaded_fraction: float = 0.0  # of the model's parameter and buffer elements

    def summary(self) -> str:
        total = len(self.loaded) + len(self.other_shape) + len(self.absent)
        return (
            f"{self.source}: loaded {len(self.loaded)}/{total} tensors ({self.loaded_fraction:.0%} of the "
            f"weights); re-initialised {len(self.other_shape)} whose shape differs in the file"
            f"{_preview(self.other_shape)} and {len(self.absent)} the file lacks{_preview(self.absent)}; "
            f"ignored {len(self.unused)} file tensors the model has no place for{_preview(self.unused)} "
            f"and {len(self.left_out)} entries outside the network{_preview(self.left_out)}"
        )


def init_from_checkpoint(
    net: nn.Module,
    path: str | os.PathLike,
    *,
    trust_checkpoint: bool = False,
    log_summary: bool = True,
) -> InitReport:
    """Copy the file's tensors whose name and shape match ``net``'s (the others, e.g. another class count's
    heads, keep their values) and log one line (``log_summary``); ConfigError when no parameter matches."""
    what = "model.init_from"
    source = f"{what}={path}"
    checkpoint = read_checkpoint(path, trust_checkpoint=trust_checkpoint, what=what, expected=INIT_FROM_FILES)
    state, left_out = network_state_dict(checkpoint, source=source)
    own = net.state_dict()
    report = InitReport(source=source, left_out=left_out)
    for key, value in own.items():
        if key not in state:
            report.absent.append(key)
        elif tuple(state[key].shape) != tuple(value.shape):
            report.other_shape.append(key)
        else:
            report.loaded.append(key)
    report.unused = sorted(set(state) - set(own))
    net.load_state_dict({k: state[k] for k in report.loaded}, strict=False)  # into the existing tensors
    elements = sum(v.numel() for v in own.values())
    report.loaded_fraction = sum(own[k].numel() for k in report.loaded) / max(elements, 1)
    parameters = {name for name, _ in net.named_parameters()}
    if not parameters & set(report.loaded):
        raise ConfigError(
            f"{source}: none of the network's parameters matches the file by name and shape (file keys e.g. "
            f"{sorted(state)[:3]}, network keys e.g. {sorted(parameters)[:3]}); it was made for another "
            f"architecture. Point {what} at a checkpoint of this network (same model.net), or remove it"
        )
    if log_summary:  # a warning when less than half of the network came from the file
        log.log(logging.INFO if report.loaded_fraction >= 0.5 else logging.WARNING, "%s", report.summary())
    return report
