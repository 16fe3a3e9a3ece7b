"""Markdown tables of results: the one formatter behind every benchmark and sweep table.

Cells come formatted (callers own number formats); ``None`` prints as ``missing``. Stdlib only."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["markdown_row", "markdown_rule", "markdown_table"]


def markdown_row(cells: Sequence[Any], widths: Sequence[int] | None = None, align: str | None = None) -> str:
    """``| a | b |``; with ``widths``, each cell justified to its width (``align``: ``l``/``r`` per cell)."""
    texts = ["" if c is None else str(c) for c in cells]
    if widths is not None:
        align = align or "l" * len(texts)
        texts = [t.rjust(w) if a == "r" else t.ljust(w) for t, w, a in zip(texts, widths, align, strict=True)]
    return "| " + " | ".join(texts) + " |"


def markdown_rule(align: str, widths: Sequence[int] | None = None) -> str:
    """The header rule: ``l`` (``---``) or ``r`` (``---:``) per column of ``align``; ``widths``: padded."""
    if widths is None:
        return "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    dashes = ["-" * (w + 1) + (":" if a == "r" else "-") for a, w in zip(align, widths, strict=True)]
    return "|" + "|".join(dashes) + "|"


def markdown_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    align: str | None = None,
    pad: bool = False,
    missing: str = "",
) -> str:
    """Header, rule and one line per row (rows as long as ``columns``), joined by newlines, no trailing one.
    ``align``: ``l`` or ``r`` per column (default all ``l``); ``pad``: cells padded to their column's widest
    text, so the table also reads aligned as plain text."""
    align = align or "l" * len(columns)
    if len(align) != len(columns):
        raise ValueError(f"align has {len(align)} letters for {len(columns)} columns")
    texts = [[missing if c is None else str(c) for c in row] for row in rows]
    for row in texts:
        if len(row) != len(columns):
            raise ValueError(f"a row has {len(row)} cells for {len(columns)} columns: {row}")
    widths = [max(len(t) for t in column) for column in zip(columns, *texts, strict=True)] if pad else None
    body = [markdown_row(row, widths, align) for row in texts]
    return "\n".join([markdown_row(columns, widths), markdown_rule(align, widths), *body])
