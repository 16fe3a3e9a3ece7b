"""Pictures a person looks at: detections drawn on images, and a run's training curves.

:func:`draw_detections` (boxes with names and scores, ground truth underneath), :func:`plot_curves` (runs'
``metrics.csv``: loss and LR over steps, the validation metric over epochs), :func:`plot_pr_curves` and
:func:`plot_confusion_matrix` (:mod:`ssd_lightning.error_analysis`'s arrays); :func:`log_picture` sends a
picture to the loggers that take images. matplotlib's object API (no pyplot, no GUI backend): safe in
training processes and on machines without a display.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ssd_lightning.metrics_csv import read_metrics_csv

__all__ = [
    "GT_COLOUR",
    "PALETTE",
    "class_colour",
    "draw_detections",
    "log_picture",
    "plot_confusion_matrix",
    "plot_curves",
    "plot_pr_curves",
    "read_metrics_csv",
]

# Prediction colours by label (:func:`class_colour`), readable on photos; GT_COLOUR is not among them.
PALETTE: tuple[tuple[int, int, int], ...] = (
    *((255, 56, 56), (255, 157, 0), (0, 140, 255), (255, 0, 200), (255, 230, 0)),
    *((0, 230, 230), (160, 80, 255), (255, 120, 160), (120, 70, 0), (0, 0, 200)),
)
GT_COLOUR: tuple[int, int, int] = (0, 255, 0)


def class_colour(label: int) -> tuple[int, int, int]:
    """RGB colour of predicted boxes of label ``label`` (1..K)."""
    return PALETTE[(int(label) - 1) % len(PALETTE)]


@lru_cache(maxsize=16)
def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)  # scalable font when Pillow has FreeType
    except (TypeError, OSError, ImportError):
        return ImageFont.load_default()


def _as_array(values, shape_tail: tuple[int, ...], name: str, dtype=np.float64) -> np.ndarray:
    if values is None:
        return np.zeros((0, *shape_tail), dtype=dtype)
    if hasattr(values, "detach"):  # torch tensor, on any device
        values = values.detach().float().cpu().numpy()
    arr = np.asarray(values, dtype=dtype)
    if arr.size == 0:
        return arr.reshape(0, *shape_tail)
    if arr.shape[1:] != shape_tail:
        raise ValueError(
            f"{name} must have shape (k{''.join(f', {s}' for s in shape_tail)}), got {arr.shape}"
        )
    return arr


def _label_text(label: int, class_names: Sequence[str] | None, score: float | None) -> str:
    name = class_names[label] if class_names is not None and 0 <= label < len(class_names) else str(label)
    return name if score is None else f"{name} {score:.2f}"


def _box(
    draw: ImageDraw.ImageDraw, font, box: np.ndarray, colour, width: int, text: str | None, *, above: bool
) -> None:
    """Outline ``box`` (ltrb, rounded; not drawn if not finite or inverted) and ``text`` (if any) in a filled
    tag at its left: above its top (below it when there is no room), or ending at its bottom."""
    if not np.all(np.isfinite(box)):
        return
    left, top, right, bottom = (round(float(v)) for v in box)
    if right < left or bottom < top:
        return
    draw.rectangle((left, top, right, bottom), outline=colour, width=width)
    if text is None:
        return
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    tw, th = x1 - x0 + 4, y1 - y0 + 4
    y = (top - th if top - th >= 0 else top) if above else bottom - th + 1
    draw.rectangle((left, y, left + tw - 1, y + th - 1), fill=colour)
    dark = 0.299 * colour[0] + 0.587 * colour[1] + 0.114 * colour[2] > 140  # text colour by luminance
    draw.text((left + 2 - x0, y + 2 - y0), text, fill=(0, 0, 0) if dark else (255, 255, 255), font=font)


def draw_detections(
    image: Image.Image,
    boxes=None,
    labels=None,
    scores=None,
    *,
    class_names: Sequence[str] | None = None,
    gt_boxes=None,
    gt_labels=None,
    score_thresh: float = 0.0,
    scale: float = 1.0,
    line_width: int | None = None,
    show_labels: bool = True,
) -> Image.Image:
    """A new RGB image: ``image`` resized by ``scale`` (bilinear) with boxes drawn: ``boxes`` (k, 4) ltrb in
    pixels of ``image`` (tensor, array or list) in the colour of their ``labels`` (1..K), with
    ``class_names[label]`` and ``scores`` (those below ``score_thresh`` left out; the best drawn last) in a
    tag (``show_labels``); ground truth first, in :data:`GT_COLOUR`. ``line_width`` (output pixels, inward
    from the rounded ltrb) defaults to ``max(2, round(side / 250))``."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    out = image.convert("RGB")  # a copy
    if scale != 1.0:
        size = (max(1, round(out.width * scale)), max(1, round(out.height * scale)))
        out = out.resize(size, Image.BILINEAR)
    boxes_a, labels_a = _as_array(boxes, (4,), "boxes"), _as_array(labels, (), "labels", np.int64)
    scores_a = None if scores is None else _as_array(scores, (), "scores")
    if len(labels_a) != len(boxes_a) or (scores_a is not None and len(scores_a) != len(boxes_a)):
        raise ValueError(
            f"boxes, labels and scores need the same length, got {len(boxes_a)}, {len(labels_a)}"
            f"{'' if scores_a is None else f' and {len(scores_a)}'}"
        )
    gt_a = _as_array(gt_boxes, (4,), "gt_boxes") * scale
    gt_labels_a = None if gt_labels is None else _as_array(gt_labels, (), "gt_labels", np.int64)
    width = line_width or max(2, round(max(out.size) / 250))
    font = _font(max(10, round(max(out.size) / 40)))
    draw = ImageDraw.Draw(out)
    gt_labelled = show_labels and gt_labels_a is not None
    for i, box in enumerate(gt_a):
        text = _label_text(int(gt_labels_a[i]), class_names, None) if gt_labelled else None
        _box(draw, font, box, GT_COLOUR, width, text, above=False)
    order = np.argsort(scores_a, kind="stable") if scores_a is not None else range(len(boxes_a))
    for i in order:
        score = None if scores_a is None else float(scores_a[i])
        if score is not None and score < score_thresh:
            continue
        text = _label_text(int(labels_a[i]), class_names, score) if show_labels else None
        _box(draw, font, boxes_a[i] * scale, class_colour(int(labels_a[i])), width, text, above=True)
    return out


def _series(rows: Sequence[Mapping[str, float]], key: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r[x], r[key]) for r in rows if key in r and x in r and math.isfinite(r[key])]
    xs, ys = np.asarray(pairs, dtype=np.float64).reshape(-1, 2).T
    order = np.argsort(xs, kind="stable")
    return xs[order], ys[order]


def _found_series(
    rows: Sequence[Mapping[str, float]], candidates: Sequence[str], x: str, prefix: str = ""
) -> tuple[str, np.ndarray, np.ndarray] | None:
    """``(key, xs, ys)`` of the first of ``candidates`` (else of the ``prefix*`` columns); None if no data."""
    keys = set().union(*rows)
    found = [k for k in candidates if k in keys] or sorted(k for k in keys if prefix and k.startswith(prefix))
    xs, ys = _series(rows, found[0], x) if found else ((), ())
    return (found[0], xs, ys) if len(xs) else None


def _plot_run(axes, rows: Sequence[Mapping[str, float]], label: str, colour: str, single: bool) -> dict:
    """Draw one run on the (loss, lr, val) axes; returns the column drawn on each panel drawn."""
    ax_loss, ax_lr, ax_val = axes
    drawn = {}
    if found := _found_series(rows, ["train/loss_step", "train/loss"], "step"):
        drawn["loss"], xs, ys = found
        window = len(ys) // 50
        if window >= 2:  # a faint raw line under a running mean
            ax_loss.plot(xs, ys, color=colour, alpha=0.25, linewidth=0.8)
            ys = np.convolve(
                np.concatenate([np.full(window - 1, ys[0]), ys]), np.ones(window) / window, "valid"
            )
        ax_loss.plot(xs, ys, color=colour, linewidth=1.5, label=label)
    if found := _found_series(rows, ["lr"], "step", prefix="lr-"):
        drawn["lr"], xs, ys = found
        ax_lr.plot(xs, ys, color=colour, linewidth=1.5, label=label)
    if found := _found_series(rows, ["val/mAP"], "epoch", prefix="val/"):
        key, xs, ys = found
        drawn["val"] = key
        ax_val.plot(xs, ys, color=colour, marker="o", linewidth=1.5, label=f"{label} {key}")
        if single and key == "val/mAP":
            xs50, ys50 = _series(rows, "val/mAP_50", "epoch")
            if len(xs50):
                ax_val.plot(xs50, ys50, color=colour, marker="s", linestyle="--", label="val/mAP_50")
    return drawn


def plot_curves(
    runs: Mapping[str, Sequence[Mapping[str, float]] | str | os.PathLike],
    output: str | os.PathLike,
    *,
    title: str | None = None,
) -> Path:
    """Training loss and LR over steps, the validation metric over epochs, one line per run (label -> rows of
    :func:`read_metrics_csv` or a ``metrics.csv`` path), to the PNG ``output``. Columns: ``train/loss_step``
    (else ``train/loss``), ``lr`` (else the first ``lr-*``), ``val/mAP`` (else the first ``val/*``)."""
    from matplotlib.figure import Figure

    loaded = {
        label: read_metrics_csv(rows) if isinstance(rows, (str, os.PathLike)) else list(rows)
        for label, rows in runs.items()
    }
    fig = Figure(figsize=(15, 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    single = len(loaded) == 1
    drawn = [
        _plot_run(axes, rows, label, f"C{i % 10}", single) for i, (label, rows) in enumerate(loaded.items())
    ]
    val_names = {d["val"] for d in drawn if "val" in d}
    val_title = next(iter(val_names)) if len(val_names) == 1 else "validation metric"
    panels = (
        ("loss", "training loss", "step"),
        ("lr", "learning rate", "step"),
        ("val", val_title, "epoch (0-based)"),
    )
    for ax, (what, name, xlabel) in zip(axes, panels, strict=True):
        ax.set(title=name, xlabel=xlabel)
        ax.grid(True, alpha=0.3)
        if not any(what in d for d in drawn):
            ax.text(
                0.5, 0.5, "not logged yet", ha="center", va="center", transform=ax.transAxes, color="grey"
            )
        elif not single or what == "val":
            ax.legend(fontsize=8)
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if title:
        fig.suptitle(title)
    return _save(fig, output)


def _save(fig, output: str | os.PathLike) -> Path:
    """Write ``fig`` to ``output`` atomically; parent folders created."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, output)
    return output


def plot_pr_curves(
    recall: np.ndarray,
    precision: np.ndarray,
    ap: np.ndarray,
    all_precision: np.ndarray,
    all_ap: np.ndarray,
    iou_thresholds: Sequence[float],
    class_names: Sequence[str],
    output: str | os.PathLike,
    *,
    title: str | None = None,
) -> Path:
    """One panel per IoU threshold: ``precision`` (I, K, R) over ``recall`` (R,) per class (NaN: not drawn),
    ``ap`` (I, K) in the legend, and the all-classes line, thick and black. Beyond 20 classes, the legend
    names the best and worst 10, the others grey. Written to the PNG ``output``."""
    from matplotlib.figure import Figure

    precision, ap = np.asarray(precision, dtype=np.float64), np.asarray(ap, dtype=np.float64)
    n_iou, n_cls = precision.shape[:2]
    if len(class_names) != n_cls:
        raise ValueError(f"{len(class_names)} class names for {n_cls} classes")
    fig = Figure(figsize=(6.5 * n_iou, 5.2), dpi=100, layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, n_iou))
    for i, ax in enumerate(axes):
        defined = np.flatnonzero(~np.isnan(ap[i]))
        ranked = defined[np.argsort(-ap[i, defined], kind="stable")]  # best first
        named = set(ranked[:10].tolist() + ranked[-10:].tolist())  # the best and worst 10: all of up to 20
        for rank, k in enumerate(ranked):
            if k in named:
                label = f"{ap[i, k]:.3f} {class_names[k]}"
                ax.plot(recall, precision[i, k], linewidth=1.2, color=f"C{rank % 10}", label=label)
            else:
                ax.plot(recall, precision[i, k], linewidth=0.6, color="0.8")
        if np.isfinite(all_ap[i]):
            ax.plot(
                recall, all_precision[i], color="black", linewidth=3, label=f"{all_ap[i]:.3f} all classes"
            )
        hidden = len(ranked) - len(named)
        ax.set_title(f"IoU {iou_thresholds[i]:g}" + (f" ({hidden} classes in grey)" if hidden else ""))
        ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1), ylim=(0, 1.02))
        ax.grid(True, alpha=0.3)
        if not len(ranked):
            ax.text(0.5, 0.5, "no ground truth", ha="center", va="center", transform=ax.transAxes)
            continue
        handles, labels = (x[-1:] + x[:-1] for x in ax.get_legend_handles_labels())  # all classes first
        ax.legend(handles, labels, fontsize=7, title="AP  class", title_fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title)
    return _save(fig, output)


def plot_confusion_matrix(
    matrix: np.ndarray,
    class_names: Sequence[str],
    output: str | os.PathLike,
    *,
    title: str | None = None,
) -> Path:
    """The ``(C, C)`` counts ``matrix`` (rows true, columns predicted) as shares of their row, to the PNG
    ``output`` (returned); the shares written in the cells up to 25 classes. Beyond 60 only the 60 most
    confused are drawn (most off-diagonal counts in their row and column), said in the title: 1,000 ImageNet
    classes in full took ~55 s and a 300-megapixel picture."""
    annotate_max, max_classes = 25, 60
    from matplotlib.figure import Figure

    counts = np.asarray(matrix, dtype=np.float64)
    size = counts.shape[0]
    if counts.ndim != 2 or counts.shape[1] != size or len(class_names) != size:
        raise ValueError(f"a ({len(class_names)}, {len(class_names)}) matrix is needed, got {counts.shape}")
    totals = counts.sum(axis=1, keepdims=True)
    shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    if size > max_classes:
        confused = counts * (1 - np.eye(size))
        keep = np.sort(np.argsort(-(confused.sum(0) + confused.sum(1)), kind="stable")[:max_classes])
        counts, shares = counts[np.ix_(keep, keep)], shares[np.ix_(keep, keep)]
        class_names = [class_names[i] for i in keep]
        title = f"{title + ': ' if title else ''}the {max_classes} most confused of {size} classes"
        size = max_classes
    # a fixed layout in inches (the constrained one draws the figure twice: seconds at 80 classes)
    longest = max((len(str(n)) for n in class_names), default=1)
    cell = 0.3 if size <= annotate_max else 0.18  # inches per class
    font = max(4, min(9, round(cell * 72 * 0.55)))
    margin = 0.4 + min(longest, 30) * font / 72 * 0.62  # room for the tick labels
    side = max(3.0, cell * size)
    width, height = margin + side + 1.3, margin + side + 0.6
    fig = Figure(figsize=(width, height), dpi=100)
    ax = fig.add_axes((margin / width, margin / height, side / width, side / height))
    shown = ax.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
    colour_bar = fig.add_axes(((margin + side + 0.2) / width, margin / height, 0.2 / width, side / height))
    fig.colorbar(shown, cax=colour_bar, label="share of the true row")
    ax.set_xticks(range(size), [str(n) for n in class_names], rotation=90, fontsize=font)
    ax.set_yticks(range(size), [str(n) for n in class_names], fontsize=font)
    ax.set(xlabel="predicted", ylabel="true")
    if size <= annotate_max:
        for r, c in zip(*np.nonzero(counts), strict=True):
            colour = "white" if shares[r, c] > 0.5 else "black"
            ax.text(c, r, f"{shares[r, c]:.2f}", ha="center", va="center", fontsize=font, color=colour)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, output)


def log_picture(loggers: Sequence[object], tag: str, path: str | os.PathLike, step: int) -> int:
    """Add the picture at ``path`` to every logger that takes images (TensorBoard's ``add_image``, W&B and
    MLflow's ``log_image``); returns how many took it."""
    taken, image = 0, None
    for logger in loggers:
        if any(cls.__name__ == "TensorBoardLogger" for cls in type(logger).__mro__):
            add_image = getattr(getattr(logger, "experiment", None), "add_image", None)
            if callable(add_image):
                if image is None:
                    with Image.open(path) as img:
                        image = np.asarray(img.convert("RGB"))
                add_image(tag, image, global_step=step, dataformats="HWC")
                taken += 1
        elif callable(log_image := getattr(logger, "log_image", None)):  # WandbLogger, MLFlowLogger
            log_image(tag, [os.fspath(path)], step=step)
            taken += 1
    return taken
