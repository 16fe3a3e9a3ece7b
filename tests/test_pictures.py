"""Pictures: boxes drawn where they belong, the callback's files in a real Trainer run, plot_run's PNG."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader

from ssd_lightning.callbacks.curves import TrainingCurves
from ssd_lightning.callbacks.pictures import PredictionPictures
from ssd_lightning.data.categories import CategoryMap
from ssd_lightning.visualize import GT_COLOUR, class_colour, draw_detections, plot_curves, read_metrics_csv
from tests.helpers import REPO_ROOT, annotations_by_image, run_script


def _val(shapes_coco: Path) -> tuple[dict, Path]:
    ann_file = shapes_coco / "annotations" / "instances_val2017.json"
    return json.loads(ann_file.read_text()), ann_file


def _image_with_objects(data: dict, min_objects: int = 1) -> tuple[dict, list[dict]]:
    for img in data["images"]:
        anns = [a for a in data["annotations"] if a["image_id"] == img["id"]]
        if len(anns) >= min_objects:
            return img, anns
    raise AssertionError("no image with objects in the generated set")


def test_draw_detections_changes_exactly_the_box_outlines(shapes_coco):
    data, _ = _val(shapes_coco)
    info, _ = _image_with_objects(data)
    original = Image.open(shapes_coco / "val2017" / info["file_name"]).convert("RGB")
    w, h = original.size
    boxes = np.array([[10.0, 12.0, w * 0.6, h * 0.7], [w * 0.3, h * 0.4, w - 5.0, h - 8.0]])
    drawn = draw_detections(original, boxes, [1, 2], [0.9, 0.5], show_labels=False, line_width=3)
    a, b = np.asarray(original), np.asarray(drawn)
    assert b.shape == a.shape
    changed = np.any(a != b, axis=-1)
    # the only pixels allowed to change: the 3-px-wide inner bands of the two rectangles
    band = np.zeros((h, w), dtype=bool)
    for x0, t, r, bt in np.round(boxes).astype(int):
        band[t : bt + 1, x0 : x0 + 3] = band[t : bt + 1, r - 2 : r + 1] = True
        band[t : t + 3, x0 : r + 1] = band[bt - 2 : bt + 1, x0 : r + 1] = True
    assert not (changed & ~band).any(), "pixels off the box outlines changed"
    # on an edge the pixel has the class colour; the higher score (label 1) is drawn last, so on top
    x0, t, r, bt = np.round(boxes[0]).astype(int)
    assert tuple(b[(t + bt) // 2, x0]) == class_colour(1)
    assert tuple(b[t + 1, (x0 + r) // 2 - 20]) == class_colour(1)
    l2, t2, r2, b2 = np.round(boxes[1]).astype(int)
    assert tuple(b[(t2 + b2) // 2, r2]) == class_colour(2)
    # inside a box, away from every outline, nothing changed
    assert tuple(b[t + 10, x0 + 10]) == tuple(a[t + 10, x0 + 10])


def test_draw_detections_threshold_ground_truth_labels_and_scale():
    image = Image.new("RGB", (100, 80), (40, 40, 40))
    kept = draw_detections(image, [[20, 20, 60, 60]], [1], [0.29], score_thresh=0.3)
    assert np.array_equal(np.asarray(kept), np.asarray(image)), "a box under score_thresh was drawn"
    gt = draw_detections(image, gt_boxes=[[10, 10, 50, 50]], gt_labels=[1], class_names=["bg", "a"])
    assert tuple(np.asarray(gt)[30, 10]) == GT_COLOUR
    big = draw_detections(image, [[20, 20, 60, 60]], [3], [0.8], scale=4.0, class_names=["bg", "a", "b", "c"])
    assert big.size == (400, 320)
    arr = np.asarray(big)
    assert tuple(arr[200, 80]) == class_colour(3)  # left edge at 20 * 4 = 80
    # the "c 0.80" tag sits above the box's top-left corner, filled with the class colour
    tag = arr[70:80, 80:100].reshape(-1, 3)
    assert (tag == class_colour(3)).all(axis=1).mean() > 0.6
    assert (arr[60:80, 140:200] == 40).all()  # the tag is short: nothing further right
    with pytest.raises(ValueError, match="same length"):
        draw_detections(image, [[0, 0, 1, 1]], [1, 2])
    with pytest.raises(ValueError, match="shape"):
        draw_detections(image, [[0, 0, 1]], [1])


# ------------------------------------------------------------------------------------------ callback
class _ValImages(pl.LightningDataModule):
    """The generated val set as batches of image ids, with the metadata the callback reads."""

    def __init__(self, root: Path, image_ids: list[int]) -> None:
        super().__init__()
        self.val_images = root / "val2017"
        self.val_annotation_file = root / "annotations" / "instances_val2017.json"
        self.category_map = CategoryMap.from_coco(self.val_annotation_file)
        self.image_ids = image_ids

    def train_dataloader(self):
        return DataLoader([{"x": torch.randn(4)} for _ in range(4)], batch_size=2)

    def val_dataloader(self):
        return DataLoader([{"image_ids": i} for i in self.image_ids], batch_size=2)


def _near_outline(px: int, py: int, box: list[float], margin: int = 5) -> bool:
    x0, y0, x1, y1 = box
    inside_x, inside_y = x0 - margin <= px <= x1 + margin, y0 - margin <= py <= y1 + margin
    on_vertical = inside_y and min(abs(px - x0), abs(px - x1)) <= margin
    on_horizontal = inside_x and min(abs(py - y0), abs(py - y1)) <= margin
    return on_vertical or on_horizontal


def _free_probe(image: np.ndarray, boxes: list[list[float]], colour: tuple[int, ...]) -> tuple[int, int]:
    """A pixel more than 5 px from every box outline whose colour is far (> 80 levels) from ``colour``:
    where a wrongly drawn edge would show."""
    h, w = image.shape[:2]
    for py in range(12, h - 12, 3):
        for px in range(4, w - 16, 3):
            clear = not any(_near_outline(px, py, box) for box in boxes)
            if clear and np.abs(image[py, px].astype(int) - np.array(colour)).max() > 80:
                return px, py
    raise AssertionError("no free probe position in the generated image")


class _StubDetector(pl.LightningModule):
    """Emits known detections: each ground-truth box (score 0.9) and one low-score box (0.1)."""

    def __init__(self, detections: dict[int, dict]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.detections = detections

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch["x"]).pow(2).mean()
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"], on_step=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/mAP", 0.1 * (self.current_epoch + 1), on_epoch=True)
        return {"detections": [self.detections[int(i)] for i in batch["image_ids"]]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_callback_writes_pictures_and_curves_in_a_trainer_run(shapes_coco, tmp_path):
    data, _ = _val(shapes_coco)
    dm_probe = CategoryMap.from_coco(data)
    ids = [img["id"] for img in data["images"]][:5]
    by_id = {img["id"]: img for img in data["images"]}
    detections, low_score_probes = {}, {}
    for image_id in ids:
        anns = [a for a in data["annotations"] if a["image_id"] == image_id]
        boxes = [[x + 3, y + 3, x + w - 3, y + h - 3] for x, y, w, h in (a["bbox"] for a in anns)]
        original = np.asarray(
            Image.open(shapes_coco / "val2017" / by_id[image_id]["file_name"]).convert("RGB")
        )
        px, py = _free_probe(original, boxes, class_colour(1))
        low_score_probes[image_id] = (px, py)
        boxes.append([float(px), py - 8.0, px + 12.0, py + 8.0])  # its left edge crosses (px, py)
        labels = [int(dm_probe.category_id_to_label(a["category_id"])) for a in anns] + [1]
        detections[image_id] = {
            "image_id": image_id,
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "scores": torch.tensor([0.9] * len(anns) + [0.1]),
            "labels": torch.tensor(labels, dtype=torch.int64),
        }
    callback = PredictionPictures(output_dir=tmp_path, max_images=3, min_display_size=0)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[callback, TrainingCurves(output_dir=tmp_path)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        num_sanity_val_steps=1,
    )
    trainer.fit(_StubDetector(detections), datamodule=_ValImages(shapes_coco, ids))

    for epoch in (0, 1):
        written = sorted(p.name for p in (tmp_path / "predictions" / f"epoch_{epoch}").iterdir())
        assert written == sorted(f"{i}.jpg" for i in ids[:3]), written  # max_images, first ones seen
    assert not (tmp_path / "predictions" / "epoch_-1").exists()  # sanity check draws nothing

    checked = 0
    for image_id in ids[:3]:
        original = np.asarray(
            Image.open(shapes_coco / "val2017" / by_id[image_id]["file_name"]).convert("RGB")
        )
        picture = np.asarray(Image.open(tmp_path / "predictions" / "epoch_1" / f"{image_id}.jpg"))
        assert picture.shape == original.shape  # min_display_size=0: original size
        det = detections[image_id]
        for box, label, score in zip(det["boxes"], det["labels"], det["scores"], strict=True):
            x0, t, r, b = (round(float(v)) for v in box)
            y = (t + b) // 2
            if score < 0.3 or b - t < 12:
                continue
            # JPEG (q92, 4:4:4): the middle of the 2-px left edge keeps the class colour within a few levels
            diff = np.abs(picture[y, x0].astype(int) - np.array(class_colour(int(label))))
            assert diff.max() <= 40, (image_id, tuple(picture[y, x0]), class_colour(int(label)))
            checked += 1
        # the 0.1 box is not drawn: on its left edge, away from every other box, the picture is the original
        # (and that pixel is far from the class colour, so a drawn edge could not pass)
        px, py = low_score_probes[image_id]
        assert np.abs(picture[py, px].astype(int) - original[py, px].astype(int)).max() <= 40
    assert checked >= 1

    curves = tmp_path / "curves.png"
    assert curves.is_file() and Image.open(curves).size[0] > 500
    rows = read_metrics_csv(tmp_path / "csv" / "metrics.csv")
    assert any("train/loss_step" in r for r in rows) and any("val/mAP" in r for r in rows)


class _TinyRun(pl.LightningModule):
    """Logs train/loss every step and val/mAP every epoch; no detections (curves need none)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/mAP", 0.1 * (self.current_epoch + 1), on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_training_curves_alone_redraws_curves_png_after_due_evaluations_and_at_fit_end(tmp_path, monkeypatch):
    import ssd_lightning.callbacks.curves as curves_module

    titles = []

    def recording_plot(runs, output, *, title=None):
        titles.append(title)
        return plot_curves(runs, output, title=title)

    monkeypatch.setattr(curves_module, "plot_curves", recording_plot)
    data = DataLoader([torch.randn(4) for _ in range(4)], batch_size=2)
    options = dict(
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        num_sanity_val_steps=1,
    )
    trainer = pl.Trainer(
        max_epochs=5,
        logger=CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[TrainingCurves(output_dir=tmp_path, every_n_evals=2)],
        **options,
    )
    trainer.fit(_TinyRun(), train_dataloaders=data, val_dataloaders=data)
    # evaluations 2 and 4 (epochs 1, 3), the last epoch's (4), then the end of fit; never the sanity check
    name = tmp_path.name
    assert titles == [f"{name}: epoch 1", f"{name}: epoch 3", f"{name}: epoch 4", f"{name}: epoch 5"]
    png = Image.open(tmp_path / "curves.png")
    assert png.format == "PNG" and png.size == (1500, 420)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["csv", "curves.png"]  # no pictures: its own job
    rows = read_metrics_csv(tmp_path / "csv" / "metrics.csv")
    assert any("train/loss_step" in r for r in rows) and any("val/mAP" in r for r in rows)

    titles.clear()  # trainer.validate redraws nothing
    trainer.validate(_TinyRun(), dataloaders=data, verbose=False)
    assert titles == []

    no_csv = pl.Trainer(
        max_epochs=1, logger=False, callbacks=[TrainingCurves(output_dir=tmp_path / "b")], **options
    )
    with pytest.warns(UserWarning, match="curves.png needs a CSVLogger"):
        no_csv.fit(_TinyRun(), train_dataloaders=data, val_dataloaders=data)
    assert not (tmp_path / "b" / "curves.png").exists()


def test_callback_arguments_are_checked():
    with pytest.raises(ValueError, match="every_n_evals"):
        PredictionPictures(every_n_evals=0)
    with pytest.raises(ValueError, match="max_images"):
        PredictionPictures(max_images=-1)
    with pytest.raises(ValueError, match="every_n_evals"):
        TrainingCurves(every_n_evals=0)


# ------------------------------------------------------------------------------------------ curves
_CSV = """epoch,lr,step,train/loss_epoch,train/loss_step,val/mAP,val/mAP_50
0,0.001,0,,5.0,,
0,0.002,1,,4.0,,
0,,1,,,0.10,0.30
0,,1,4.5,,,
1,0.003,2,,3.0,,
1,0.004,3,,2.5,,
1,,3,,,0.20,0.45
"""


def test_read_metrics_csv_skips_empty_cells(tmp_path):
    (tmp_path / "metrics.csv").write_text(_CSV)
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert len(rows) == 7
    assert rows[0] == {"epoch": 0.0, "lr": 0.001, "step": 0.0, "train/loss_step": 5.0}
    assert rows[6] == {"epoch": 1.0, "step": 3.0, "val/mAP": 0.2, "val/mAP_50": 0.45}
    with pytest.raises(FileNotFoundError, match="csv/metrics.csv"):
        read_metrics_csv(tmp_path / "missing.csv")


def test_plot_curves_draws_one_line_per_run(tmp_path):
    (tmp_path / "metrics.csv").write_text(_CSV)
    out = plot_curves(
        {"a": tmp_path / "metrics.csv", "b": read_metrics_csv(tmp_path / "metrics.csv")[:3]},
        tmp_path / "x" / "curves.png",
    )
    img = np.asarray(Image.open(out).convert("RGB"))
    assert img.shape[1] == 1500 and img.shape[0] == 420
    # matplotlib's C0 (blue) and C1 (orange) lines are both there
    assert (np.abs(img.astype(int) - (31, 119, 180)).max(axis=-1) < 10).sum() > 50
    assert (np.abs(img.astype(int) - (255, 127, 14)).max(axis=-1) < 10).sum() > 50


def test_plot_run_script_on_a_run_and_a_sweep(tmp_path):
    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").write_text(_CSV)
    sweep = tmp_path / "sweep"
    for job, lr in ((0, "1e-3"), (1, "2e-3")):
        (sweep / str(job) / "csv").mkdir(parents=True)
        (sweep / str(job) / "csv" / "metrics.csv").write_text(_CSV)
        (sweep / str(job) / ".hydra").mkdir()
        (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(
            f"- experiment=demo\n- model.optimizer.lr={lr}\n"
        )
    result = run_script(REPO_ROOT / "scripts" / "plot_run.py", str(run), str(sweep), timeout=120)
    assert result.returncode == 0, result.stderr
    for d in (run, sweep):
        png = Image.open(d / "curves.png")
        assert png.format == "PNG" and png.size == (1500, 420)
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("plot_run", REPO_ROOT / "scripts" / "plot_run.py")
    plot_run = module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    assert list(plot_run.find_runs(sweep)) == ["0: model.optimizer.lr=1e-3", "1: model.optimizer.lr=2e-3"]
    with pytest.raises(FileNotFoundError, match="no csv/metrics.csv"):
        plot_run.find_runs(tmp_path / "run" / "csv")


# ------------------------------------------------------------------------------------------ error analysis
class _NoisyDetector(pl.LightningModule):
    """Detections made from the ground truth: jittered, some with the wrong class, some missing, plus false
    positives; the same for an image at every epoch (seeded by its id)."""

    def __init__(self, annotation_file: Path, category_map: CategoryMap) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.gt = annotations_by_image(annotation_file)
        self.cmap = category_map

    def training_step(self, batch, batch_idx):
        return self.layer(batch["x"]).pow(2).mean()

    def _detections(self, image_id: int) -> dict:
        rng = np.random.default_rng(image_id)
        boxes, labels, scores = [], [], []
        k = len(self.cmap.category_ids)
        for a in self.gt[image_id]:
            if rng.uniform() < 0.15:
                continue  # missed
            x, y, w, h = np.asarray(a["bbox"]) + rng.normal(0, 0.08, 4) * np.repeat(a["bbox"][2:], 2)
            label = int(self.cmap.category_id_to_label(a["category_id"]))
            if rng.uniform() < 0.25:
                label = int(rng.integers(1, k + 1))  # maybe the wrong class
            boxes.append([x, y, x + w, y + h])
            labels.append(label)
            scores.append(rng.uniform(0.2, 1.0))
        for _ in range(int(rng.integers(0, 3))):  # false positives
            x, y = rng.uniform(0, 150, 2)
            boxes.append([x, y, x + 40, y + 30])
            labels.append(int(rng.integers(1, k + 1)))
            scores.append(rng.uniform(0.05, 0.9))
        return {
            "image_id": image_id,
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "scores": torch.tensor(scores, dtype=torch.float32),
            "labels": torch.tensor(labels, dtype=torch.int64),
        }

    def validation_step(self, batch, batch_idx):
        return {"detections": [self._detections(int(i)) for i in batch["image_ids"]]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _LoggedMetrics(pl.Callback):
    def __init__(self) -> None:
        self.history: dict[int, dict[str, float]] = {}

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.history[trainer.current_epoch] = {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_detection_analysis_in_a_trainer_fit_matches_the_logged_per_class_ap(shapes_coco, tmp_path):
    """A real fit on the shapes val set with CocoMAPCallback, DetectionAnalysis and TensorBoard: each
    evaluated epoch gets its PR curves and confusion matrix; the curves' per-class AP50 is the logged one."""
    from pytorch_lightning.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ssd_lightning.callbacks import CocoMAPCallback, DetectionAnalysis
    from ssd_lightning.callbacks.eval_schedule import EvalSchedule

    data, ann_file = _val(shapes_coco)
    dm = _ValImages(shapes_coco, [img["id"] for img in data["images"]])
    recorder = _LoggedMetrics()
    analysis = DetectionAnalysis(output_dir=tmp_path, confusion_score_thresh=0.3)
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=TensorBoardLogger(tmp_path, name="tb", version=""),
        callbacks=[
            CocoMAPCallback(output_dir=tmp_path, verbose=False),
            analysis,
            EvalSchedule([0], always_last=True),
            recorder,
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        limit_train_batches=1,
    )
    trainer.fit(_NoisyDetector(ann_file, dm.category_map), datamodule=dm)

    assert sorted(recorder.history) == [0, 2]  # the schedule: epoch 0 and the last one
    assert sorted(p.name for p in (tmp_path / "analysis").iterdir()) == ["epoch_0", "epoch_2"]
    names = {c["id"]: c["name"] for c in data["categories"]}
    folder = tmp_path / "analysis" / "epoch_2"
    pr = json.loads((folder / "pr_curves.json").read_text())
    assert [c["iou"] for c in pr["curves"]] == [0.5, 0.75] and len(pr["recall"]) == 101
    at50 = pr["curves"][0]
    logged = recorder.history[2]
    assert at50["AP"] == pytest.approx(logged["val/mAP_50"], abs=1e-6)
    assert pr["curves"][1]["AP"] == pytest.approx(logged["val/mAP_75"], abs=1e-6)
    for row in at50["classes"]:
        assert row["name"] == names[row["category_id"]]
        assert row["AP"] == pytest.approx(logged[f"val/AP50/{row['name']}"], abs=1e-6)
        assert np.mean(row["precision"]) == pytest.approx(row["AP"], abs=1e-9)
    assert 0.2 < logged["val/mAP_50"] < 0.95  # mistakes to look at

    confusion = json.loads((folder / "confusion_matrix.json").read_text())
    matrix = np.asarray(confusion["matrix"])
    k = len(data["categories"])
    assert matrix.shape == (k + 1, k + 1) and confusion["names"][-1] == "background"
    assert confusion["score_threshold"] == 0.3 and confusion["iou_threshold"] == 0.5
    gt_per_class = [
        sum(1 for a in data["annotations"] if a["category_id"] == c and not a.get("iscrowd"))
        for c in sorted(names)
    ]
    assert matrix[:k].sum(axis=1).tolist() == gt_per_class  # every ground-truth box in its row once
    assert matrix[:k, :k].trace() > 0 and matrix[:k, :k].sum() > matrix[:k, :k].trace()  # swaps counted
    for name in ("pr_curves.png", "confusion_matrix.png"):
        assert Image.open(folder / name).size[0] > 400
    assert not (tmp_path / "analysis" / "epoch_-1").exists() and analysis._evals == 2

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert {"analysis/pr_curves", "analysis/confusion_matrix"} <= set(events.Tags()["images"])
    assert len(events.Images("analysis/pr_curves")) == 2


def test_detection_analysis_arguments_and_pictures(tmp_path, monkeypatch):
    from ssd_lightning.callbacks import DetectionAnalysis
    from ssd_lightning.visualize import log_picture, plot_confusion_matrix, plot_pr_curves

    with pytest.raises(ValueError, match="every_n_evals"):
        DetectionAnalysis(every_n_evals=0)
    with pytest.raises(ValueError, match="confusion_iou"):
        DetectionAnalysis(confusion_iou=0.0)
    # an empty row (no "background" ground truth) is drawn, not divided by zero
    path = plot_confusion_matrix(np.diag([5, 3, 0]), ["a", "b", "background"], tmp_path / "cm.png")
    assert Image.open(path).size[0] > 300
    with pytest.raises(ValueError, match=r"\(2, 2\) matrix"):
        plot_confusion_matrix(np.zeros((3, 3)), ["a", "b"], tmp_path / "bad.png")
    # 1,000 classes: the 60 most confused are drawn (a picture of the usual size, not 18,000 px wide)
    many = np.diag(np.full(1000, 10))
    many[7, 900], many[900, 7] = 4, 2
    drawn = []
    monkeypatch.setattr("matplotlib.axes.Axes.set_yticks", lambda ax, ticks, names, **kw: drawn.extend(names))
    path = plot_confusion_matrix(many, [f"c{i}" for i in range(1000)], tmp_path / "many.png")
    assert len(drawn) == 60 and {"c7", "c900"} <= set(drawn) and max(Image.open(path).size) < 1500
    recall = np.linspace(0, 1, 101)
    precision = np.stack([np.where(recall <= 0.5, 1.0, 0.0), np.full(101, np.nan)])[None]  # (1, 2, 101)
    ap = np.array([[precision[0, 0].mean(), np.nan]])
    out = plot_pr_curves(
        recall, precision, ap, precision[:, 0], ap[:, 0], [0.5], ["a", "b"], tmp_path / "pr.png"
    )
    assert Image.open(out).size[0] > 300
    with pytest.raises(ValueError, match="1 class names for 2 classes"):
        plot_pr_curves(recall, precision, ap, precision[:, 0], ap[:, 0], [0.5], ["a"], tmp_path / "pr.png")
    assert log_picture([CSVLogger(tmp_path)], "x", out, 0) == 0  # only loggers that take images
