"""The strict state-dict check of every loader that fills a whole network: one rule, one message."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from torch import Tensor, nn

__all__ = ["check_state_dict", "load_state_dict_strict"]

_SHOWN = 10  # keys listed per kind of mismatch


def _listed(label: str, items: list[str]) -> str:
    more = f" ... (+{len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return f"{label} ({len(items)}): {items[:_SHOWN]}{more}"


def check_state_dict(
    expected: Mapping[str, Tensor], state: Mapping[str, Tensor], *, source: str, target: str, hint: str = ""
) -> None:
    """ValueError (``<source> does not fit <target>: ...``) unless keys and shapes equal ``expected``'s."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    )
    if missing or unexpected or mismatched:
        kinds = {"missing": missing, "unexpected": unexpected, "shape mismatch": mismatched}
        listed = "; ".join(_listed(label, items) for label, items in kinds.items())
        raise ValueError(f"{source} does not fit {target}: {listed}" + (f". {hint}" if hint else ""))


def load_state_dict_strict(
    model: nn.Module,
    state: Mapping[str, Tensor],
    *,
    source: str,
    target: str,
    hint: str = "",
    skip: Collection[str] = (),
) -> None:
    """:func:`check_state_dict`, then load ``state``; keys in ``skip`` keep the model's values."""
    own = {k: v for k, v in model.state_dict().items() if k not in skip}
    state = {k: v for k, v in state.items() if k not in skip}
    check_state_dict(own, state, source=source, target=target, hint=hint)
    model.load_state_dict(state, strict=not skip)
