"""Pictures a person looks at: detections drawn on images, and a run's training curves.

* :func:`draw_detections` draws boxes (ltrb, in pixels of the given image) with class names and scores
  on a copy of a PIL image; ground truth, when given, is drawn underneath in :data:`GT_COLOUR`.
* :func:`plot_curves` draws the ``metrics.csv`` of runs (read by :mod:`ssd_lightning.metrics_csv`, whose
  :func:`read_metrics_csv` is re-exported here): training loss and learning rate over steps, the validation
  metric over epochs, one line per run.
* :func:`plot_pr_curves` and :func:`plot_confusion_matrix` draw the arrays of
  :mod:`ssd_lightning.error_analysis` (and any confusion matrix); :func:`log_picture` sends a written
  picture to the loggers that take images (TensorBoard).

matplotlib's object API (no pyplot, no GUI backend): safe in training processes and on machines without a
display.
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

# Prediction colours by class label (label k uses PALETTE[(k - 1) % len(PALETTE)]); saturated colours
# that stay readable on photos. Ground truth uses GT_COLOUR, which is not in the palette.
PALETTE: tuple[tuple[int, int, int], ...] = (
    *((255, 56, 56), (255, 157, 0), (0, 140, 255), (255, 0, 200), (255, 230, 0)),
    *((0, 230, 230), (160, 80, 255), (255, 120, 160), (120, 70, 0), (0, 0, 200)),
)
GT_COLOUR: tuple[int, int, int] = (0, 255, 0)


def class_colour(label: int) -> tuple[int, int, int]:
    """RGB colour of contiguous label ``label`` (1..K) for predicted boxes."""
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


def _text_colour(fill: tuple[int, int, int]) -> tuple[int, int, int]:
    luminance = 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2]
    return (0, 0, 0) if luminance > 140 else (255, 255, 255)


def _rect(draw: ImageDraw.ImageDraw, box: np.ndarray, colour: tuple[int, int, int], width: int):
    """Outline ``box`` (ltrb, rounded to pixels); its ``(l, t, r, b)``, or None when it cannot be drawn."""
    if not np.all(np.isfinite(box)):
        return None
    left, t, r, b = (round(float(v)) for v in box)
    if r < left or b < t:
        return None
    draw.rectangle((left, t, r, b), outline=colour, width=width)
    return left, t, r, b


def _tag(draw: ImageDraw.ImageDraw, font, text: str, x: int, y: int, colour, *, above: bool) -> None:
    """``text`` in a filled tag at ``x``: above ``y`` (below it when there is no room), or ending at ``y``."""
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    tw, th = right - left + 4, bottom - top + 4
    y0 = (y - th if y - th >= 0 else y) if above else y - th + 1
    draw.rectangle((x, y0, x + tw - 1, y0 + th - 1), fill=colour)
    draw.text((x + 2 - left, y0 + 2 - top), text, fill=_text_colour(colour), font=font)


def _predictions(boxes, labels, scores) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    boxes_a = _as_array(boxes, (4,), "boxes")
    labels_a = _as_array(labels, (), "labels", np.int64)
    scores_a = None if scores is None else _as_array(scores, (), "scores")
    if len(labels_a) != len(boxes_a) or (scores_a is not None and len(scores_a) != len(boxes_a)):
        raise ValueError(
            f"boxes, labels and scores need the same length, got {len(boxes_a)}, {len(labels_a)}"
            f"{'' if scores_a is None else f' and {len(scores_a)}'}"
        )
    return boxes_a, labels_a, scores_a


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
    """Draw predicted (and ground-truth) boxes on a copy of ``image``.

    Args:
        image: the original image (any mode; converted to RGB).
        boxes: (k, 4) float ltrb in pixels of ``image`` (tensor, array or list), or None.
        labels: (k,) contiguous class labels (1..K) of ``boxes``; they pick the colour (:func:`class_colour`)
            and the name ``class_names[label]``.
        scores: (k,) confidences, shown after the name; boxes with ``score < score_thresh`` are left out.
        class_names: name of label ``k`` at index ``k`` (index 0 = background, as ``CategoryMap.names``).
        gt_boxes: (m, 4) ground-truth ltrb boxes in pixels, drawn first in :data:`GT_COLOUR`.
        gt_labels: (m,) their labels (names written at the bottom-left corner, inside the box).
        score_thresh: minimum score of a drawn prediction.
        scale: resize factor applied to the image (bilinear) and the boxes before drawing, so that small
            images get readable lines and text; 1.0 keeps the pixels of ``image`` unchanged off the boxes.
        line_width: box outline width in output pixels; default ``max(2, round(side / 250))``.
        show_labels: write names/scores in a filled tag at the top-left corner of each box.

    Returns:
        a new RGB image of size ``round(scale * size)``. Predictions are drawn in ascending score order
        so the most confident box ends on top. A rectangle outline covers ``line_width`` pixels inward
        from its ltrb coordinates (rounded to the nearest pixel).
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    out = image.convert("RGB")  # a copy
    if scale != 1.0:
        size = (max(1, round(out.width * scale)), max(1, round(out.height * scale)))
        out = out.resize(size, Image.BILINEAR)
    boxes_a, labels_a, scores_a = _predictions(boxes, labels, scores)
    gt_a = _as_array(gt_boxes, (4,), "gt_boxes") * scale
    gt_labels_a = None if gt_labels is None else _as_array(gt_labels, (), "gt_labels", np.int64)
    width = line_width or max(2, round(max(out.size) / 250))
    font = _font(max(10, round(max(out.size) / 40)))
    draw = ImageDraw.Draw(out)
    for i, box in enumerate(gt_a):
        drawn = _rect(draw, box, GT_COLOUR, width)
        if drawn and show_labels and gt_labels_a is not None:
            text = _label_text(int(gt_labels_a[i]), class_names, None)
            _tag(draw, font, text, drawn[0], drawn[3], GT_COLOUR, above=False)
    order = np.argsort(scores_a, kind="stable") if scores_a is not None else range(len(boxes_a))
    for i in order:
        score = None if scores_a is None else float(scores_a[i])
        if score is not None and score < score_thresh:
            continue
        colour = class_colour(int(labels_a[i]))
        drawn = _rect(draw, boxes_a[i] * scale, colour, width)
        if drawn and show_labels:
            text = _label_text(int(labels_a[i]), class_names, score)
            _tag(draw, font, text, drawn[0], drawn[1], colour, above=True)
    return out


# ---------------------------------------------------------------------------------------------- curves
def _series(rows: Sequence[Mapping[str, float]], key: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r[x], r[key]) for r in rows if key in r and x in r and math.isfinite(r[key])]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    xs, ys = np.asarray(pairs, dtype=np.float64).T
    order = np.argsort(xs, kind="stable")
    return xs[order], ys[order]


def _smooth(ys: np.ndarray, window: int) -> np.ndarray:
    if len(ys) < 3 * window or window < 2:
        return ys
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, ys[0]), ys])
    return np.convolve(padded, kernel, mode="valid")


def _found_series(
    rows: Sequence[Mapping[str, float]], candidates: Sequence[str], x: str, prefix: str = ""
) -> tuple[str, np.ndarray, np.ndarray] | None:
    """``(key, xs, ys)`` of the first of ``candidates`` (else of the ``prefix*`` columns); None if no data."""
    keys = set().union(*rows)
    found = [k for k in candidates if k in keys] or sorted(k for k in keys if prefix and k.startswith(prefix))
    if found:
        key = found[0]
        xs, ys = _series(rows, key, x)
        if len(xs):
            return key, xs, ys
    return None


def _plot_run(axes, rows: Sequence[Mapping[str, float]], label: str, colour: str, single: bool) -> dict:
    """Draw one run on the (loss, lr, val) axes; returns the column drawn on each panel that got a line."""
    ax_loss, ax_lr, ax_val = axes
    drawn = {}
    if found := _found_series(rows, ["train/loss_step", "train/loss"], "step"):
        drawn["loss"], xs, ys = found
        smooth = _smooth(ys, max(1, len(ys) // 50))
        if smooth is not ys:
            ax_loss.plot(xs, ys, color=colour, alpha=0.25, linewidth=0.8)
        ax_loss.plot(xs, smooth, color=colour, linewidth=1.5, label=label)
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
    """Draw training loss and LR over steps and the validation metric over epochs; one line per run.

    Args:
        runs: label -> rows (from :func:`read_metrics_csv`) or the path of a ``metrics.csv``.
        output: PNG file to write (parent folders are created); returned.
        title: figure title.

    Columns used: loss ``train/loss_step`` (else ``train/loss``), learning rate ``lr`` (else the first
    ``lr-*`` column of ``LearningRateMonitor``), validation ``val/mAP`` (else the first ``val/*`` column),
    x axes ``step`` and ``epoch`` (0-based, as logged). A panel without data says so.
    """
    from matplotlib.figure import Figure  # imported here: matplotlib is only needed for curves

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
    """Write ``fig`` to ``output`` atomically (a temporary file, then a rename); parent folders created."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, output)
    return output


# ---------------------------------------------------------------------------------------- error analysis
def _legend_classes(ap: np.ndarray, max_legend_classes: int) -> tuple[np.ndarray, set[int]]:
    """The classes with an AP, best first, and those the legend names: all, or the best and worst
    ``max_legend_classes // 2``."""
    defined = np.flatnonzero(~np.isnan(ap))
    ranked = defined[np.argsort(-ap[defined], kind="stable")]
    if len(ranked) <= max_legend_classes:
        return ranked, set(ranked.tolist())
    half = max_legend_classes // 2
    return ranked, set(ranked[:half].tolist()) | set(ranked[-half:].tolist())


def _finish_pr_panel(ax, has_curves: bool) -> None:
    """Axes of a PR panel; the legend lists the all-classes line (drawn last) first."""
    ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1), ylim=(0, 1.02))
    ax.grid(True, alpha=0.3)
    if not has_curves:
        ax.text(0.5, 0.5, "no ground truth", ha="center", va="center", transform=ax.transAxes)
        return
    handles, labels = (x[-1:] + x[:-1] for x in ax.get_legend_handles_labels())
    ax.legend(handles, labels, fontsize=7, title="AP  class", title_fontsize=7, loc="lower left")


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
    max_legend_classes: int = 20,
) -> Path:
    """One panel per IoU threshold: a precision/recall line per class and a thick black all-classes line.

    Args:
        recall: ``(R,)`` recall points.
        precision: ``(I, K, R)`` precision per IoU threshold and class (NaN: class without ground truth,
            not drawn).
        ap: ``(I, K)`` the AP of each line, shown in the legend.
        all_precision, all_ap: ``(I, R)`` and ``(I,)``, the all-classes line and its AP.
        iou_thresholds: ``(I,)`` the panel titles.
        class_names: ``K`` names.
        output: PNG file to write; returned.
        title: figure title.
        max_legend_classes: with more classes than this, the legend names the all-classes line and the
            ``max_legend_classes // 2`` best and worst classes; the others are drawn in light grey.
    """
    from matplotlib.figure import Figure

    precision = np.asarray(precision, dtype=np.float64)
    ap = np.asarray(ap, dtype=np.float64)
    n_iou, n_cls = precision.shape[:2]
    if len(class_names) != n_cls:
        raise ValueError(f"{len(class_names)} class names for {n_cls} classes")
    fig = Figure(figsize=(6.5 * n_iou, 5.2), dpi=100, layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, n_iou))
    for i, ax in enumerate(axes):
        ranked, named = _legend_classes(ap[i], max_legend_classes)
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
        _finish_pr_panel(ax, has_curves=len(ranked) > 0)
    if title:
        fig.suptitle(title)
    return _save(fig, output)


def plot_confusion_matrix(
    matrix: np.ndarray,
    class_names: Sequence[str],
    output: str | os.PathLike,
    *,
    title: str | None = None,
    true_label: str = "true",
    predicted_label: str = "predicted",
    annotate_max: int = 25,
    max_classes: int = 60,
) -> Path:
    """A confusion matrix (rows true, columns predicted) normalised by row: each cell the share of its row.

    Args:
        matrix: ``(C, C)`` counts; an all-zero row stays zero.
        class_names: ``C`` names (the last one ``"background"`` for a detection matrix).
        output: PNG file to write; returned.
        title: figure title (state the thresholds here).
        true_label, predicted_label: axis labels.
        annotate_max: write the shares into the cells when ``C`` is at most this.
        max_classes: beyond this many classes only the ``max_classes`` most confused ones are drawn (most
            off-diagonal counts in their row and column; shares still of the whole row), said in the title:
            1,000 ImageNet classes drawn in full took ~55 s and a 300-megapixel picture per evaluation.
    """
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
    fig.colorbar(shown, cax=colour_bar, label=f"share of the {true_label} row")
    ax.set_xticks(range(size), [str(n) for n in class_names], rotation=90, fontsize=font)
    ax.set_yticks(range(size), [str(n) for n in class_names], fontsize=font)
    ax.set(xlabel=predicted_label, ylabel=true_label)
    if size <= annotate_max:
        for r, c in zip(*np.nonzero(counts), strict=True):
            colour = "white" if shares[r, c] > 0.5 else "black"
            ax.text(c, r, f"{shares[r, c]:.2f}", ha="center", va="center", fontsize=font, color=colour)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, output)


def log_picture(loggers: Sequence[object], tag: str, path: str | os.PathLike, step: int) -> int:
    """Add the picture at ``path`` under ``tag`` at ``step`` to every logger that takes images: TensorBoard
    (its ``SummaryWriter.add_image``), W&B and MLflow (their ``log_image``); CSV loggers are left alone.

    Returns:
        how many loggers took it.
    """
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
