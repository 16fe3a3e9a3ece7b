"""CocoMAPCallback inside real Lightning Trainers (CPU): logged stats, written JSON, best tracking, DDP."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from ssd_lightning.callbacks.coco_map import CocoMAPCallback, _merge_ranks
from ssd_lightning.evaluation import COCO_STAT_NAMES, evaluate_coco
from tests.helpers import CONFIG_DIR, annotations_by_image, csv_rows, quiet_trainer, run_script

CATEGORY_IDS = [4, 9]  # non-contiguous on purpose


class DuckCategoryMap:
    """Stand-in for ssd_lightning.data.categories.CategoryMap (label i+1 <-> CATEGORY_IDS[i])."""

    def __init__(self, category_ids=CATEGORY_IDS):
        self.category_ids = list(category_ids)
        self.num_classes = len(category_ids)

    def label_to_category_id(self, labels):
        lut = torch.tensor([-1, *self.category_ids])
        return lut[torch.as_tensor(labels).long()]


def make_annotations(path: Path, num_images: int = 20, seed: int = 0) -> Path:
    """Images with 1-4 objects each of small / medium / large size, categories 4 and 9."""
    rng = np.random.default_rng(seed)
    images, anns = [], []
    for i in range(num_images):
        image_id = 1000 + 7 * i
        images.append({"id": image_id, "width": 500, "height": 400, "file_name": f"{image_id}.jpg"})
        for k in range(1 + i % 4):
            side = [20.0, 60.0, 150.0][(i + k) % 3] * rng.uniform(0.8, 1.2)
            x, y = rng.uniform(0, 500 - side), rng.uniform(0, 400 - side)
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": image_id,
                    "category_id": CATEGORY_IDS[(i + k) % 2],
                    "bbox": [round(x, 2), round(y, 2), round(side, 2), round(side * 0.8, 2)],
                    "area": round(side, 2) * round(side * 0.8, 2),
                    "iscrowd": 0,
                }
            )
    cats = [{"id": c, "name": f"c{c}"} for c in CATEGORY_IDS]
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return path


class IdDataset(Dataset):
    def __init__(self, image_ids):
        self.image_ids = list(image_ids)

    def __len__(self):
        return len(self.image_ids)

    def __getitem__(self, i):
        return {"image_ids": torch.tensor(self.image_ids[i]), "x": torch.ones(2)}


class DetDataModule(pl.LightningDataModule):
    """What CocoMAPCallback needs from a datamodule: val_dataloader, category_map, val_annotation_file."""

    def __init__(self, annotation_file: Path, image_ids=None, batch_size: int = 3):
        super().__init__()
        self.val_annotation_file = str(annotation_file)
        self.category_map = DuckCategoryMap()
        if image_ids is None:
            image_ids = [im["id"] for im in json.loads(Path(annotation_file).read_text())["images"]]
        self.image_ids = list(image_ids)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(IdDataset(self.image_ids[:4]), batch_size=2)

    def val_dataloader(self):
        return DataLoader(IdDataset(self.image_ids), batch_size=self.batch_size)


class GroundTruthDetector(pl.LightningModule):
    """Emits detections derived from the ground truth: exact (jitter 0) or with a deterministic jitter per
    image (independent of rank and batch), so that 1 and 2 processes give the same detections.

    ``jitter_per_epoch`` overrides ``jitter`` by ``current_epoch``; ``seen_dir`` makes each rank write the
    image ids it validated.
    """

    def __init__(
        self, annotation_file, jitter=0.0, jitter_per_epoch=None, empty=False, seen_dir=None, bad_image=None
    ):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.gt = annotations_by_image(annotation_file)
        self.jitter, self.jitter_per_epoch, self.empty = jitter, jitter_per_epoch, empty
        self.seen_dir = seen_dir
        self.bad_image = bad_image  # this image gets label 99, which the category map cannot map
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch["x"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_validation_epoch_start(self):
        self.seen = []

    def _detections(self, image_id: int) -> dict:
        jitter = self.jitter
        if self.jitter_per_epoch is not None:
            jitter = self.jitter_per_epoch[self.current_epoch]
        rng = np.random.default_rng([image_id, int(jitter * 1000)])
        anns = [] if self.empty else self.gt[image_id]
        xywh = np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4)
        xywh = xywh + rng.normal(0.0, jitter, xywh.shape) * xywh[:, [2, 3, 2, 3]]
        ltrb = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1)
        labels = [CATEGORY_IDS.index(a["category_id"]) + 1 for a in anns]
        if image_id == self.bad_image:
            labels = [99] * len(anns)
        return {  # on the module's device, as SSDLitModule's outputs
            "image_id": image_id,
            "boxes": torch.tensor(ltrb, dtype=torch.float32, device=self.device),
            "scores": torch.tensor(rng.uniform(0.1, 1.0, len(anns)), dtype=torch.float32, device=self.device),
            "labels": torch.tensor(labels, dtype=torch.int64, device=self.device).reshape(-1),
        }

    def validation_step(self, batch, batch_idx):
        ids = batch["image_ids"].tolist()
        self.seen.extend(ids)
        return {"detections": [self._detections(i) for i in ids]}

    def on_validation_epoch_end(self):
        if self.seen_dir is not None and not self.trainer.sanity_checking:
            path = Path(self.seen_dir) / f"rank{self.global_rank}_epoch{self.current_epoch}.json"
            path.write_text(json.dumps(self.seen))


class MetricRecorder(Callback):
    """Copies the val/ metrics after every (non-sanity) validation pass."""

    def __init__(self):
        self.history: list[tuple[int, dict]] = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            self.history.append((trainer.current_epoch, metrics))


class DestroyProcessGroupAtExit(Callback):
    """Destroy the default process group before interpreter shutdown, in every rank.

    Lightning registers such an exit handler for NCCL only. A gloo group outlives the rank's script: its C++
    threads are still running while CPython finalizes, and one of them then touching Python state (freeing a
    tensor it holds, completing a future) is ended by CPython (``pthread_exit``) inside C++ code that cannot
    unwind: ``std::terminate``, "terminate called without an active exception", SIGABRT. Rare, and more likely
    on a loaded machine (pytorch/pytorch#190489). ``setup`` runs inside each spawned rank, so the handler is
    registered there; destroying the group joins its threads while the interpreter is still whole.
    """

    def setup(self, trainer, pl_module, stage):
        from ssd_lightning.cli.train import _release_process_group

        atexit.unregister(_release_process_group)  # once per process
        atexit.register(_release_process_group)


def _pycocotools_by_hand(ann_file, json_file) -> list[float]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann_file))
        ev = COCOeval(gt, gt.loadRes(str(json_file)), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return list(ev.stats)


@pytest.fixture
def ann_file(tmp_path) -> Path:
    return make_annotations(tmp_path / "instances_val.json")


def test_validate_perfect_detections(tmp_path, ann_file, capsys):
    cb = CocoMAPCallback(output_dir=tmp_path / "out")
    trainer = quiet_trainer(tmp_path, [cb])
    (metrics,) = trainer.validate(GroundTruthDetector(ann_file), datamodule=DetDataModule(ann_file))
    per_class = {f"val/{m}/c{c}" for c in CATEGORY_IDS for m in ("AP", "AP50")}
    assert {f"val/{n}" for n in COCO_STAT_NAMES} | per_class == set(metrics)  # no best tracking outside fit
    assert all(metrics[k] == pytest.approx(1.0) for k in per_class)
    assert metrics["val/mAP"] == pytest.approx(1.0)
    assert metrics["val/mAP_small"] == pytest.approx(1.0)  # all area ranges are populated
    assert metrics["val/mAR_100"] == pytest.approx(1.0)
    written = tmp_path / "out" / "detections_epoch_0.json"
    results = json.loads(written.read_text())
    assert {r["category_id"] for r in results} == set(CATEGORY_IDS)
    assert _pycocotools_by_hand(ann_file, written) == pytest.approx(
        [metrics[f"val/{n}"] for n in COCO_STAT_NAMES]
    )
    assert capsys.readouterr().out.count("Average Precision") == 6
    assert not list((tmp_path / "out").glob(".*tmp"))  # no temp files left by the atomic write


def test_fit_jittered_best_tracking_and_checkpoint(tmp_path, ann_file):
    """3 epochs with different jitter: each logged value equals evaluate_coco on that epoch's JSON; the best
    epoch is tracked, survives a resume, and ModelCheckpoint(monitor="val/mAP") sees the same numbers."""
    jitters = [0.12, 0.03, 0.08, 0.2]
    cb, rec = CocoMAPCallback(verbose=False), MetricRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "best", monitor="val/mAP", mode="max")
    # Lightning 2.6: save_last next to a monitor writes last.ckpt only when a top-k checkpoint was saved,
    # so a resumable "last" needs its own ModelCheckpoint without monitor.
    last = ModelCheckpoint(dirpath=tmp_path / "last", save_last=True)
    trainer = quiet_trainer(tmp_path, [cb, rec, ckpt, last], max_epochs=3, num_sanity_val_steps=2)
    trainer.fit(GroundTruthDetector(ann_file, jitter_per_epoch=jitters), datamodule=DetDataModule(ann_file))

    assert [e for e, _ in rec.history] == [0, 1, 2]  # the sanity check is not evaluated
    maps = []
    for epoch, metrics in rec.history:
        json_file = tmp_path / f"detections_epoch_{epoch}.json"  # default_root_dir without a logger
        expected = evaluate_coco(ann_file, json_file, verbose=False)
        for name in COCO_STAT_NAMES:
            assert metrics[f"val/{name}"] == pytest.approx(expected[name], abs=1e-6), (epoch, name)
        assert _pycocotools_by_hand(ann_file, json_file) == pytest.approx(list(expected.values()))
        maps.append(expected["mAP"])
    assert min(maps) > 0.2 and max(maps) < 0.95 and maps[1] == max(maps)
    assert [m["val/mAP_best_epoch"] for _, m in rec.history] == [0, 1, 1]
    assert [m["val/mAP_best"] for _, m in rec.history] == pytest.approx([maps[0], maps[1], maps[1]])
    assert cb.best_epoch == 1 and cb.best_map == pytest.approx(maps[1])
    assert float(ckpt.best_model_score) == pytest.approx(maps[1], abs=1e-6)
    assert "epoch=1" in Path(ckpt.best_model_path).name

    # resume in a fresh callback: the best survives, a worse epoch 3 does not replace it
    cb2, rec2 = CocoMAPCallback(verbose=False), MetricRecorder()
    trainer = quiet_trainer(tmp_path, [cb2, rec2], max_epochs=4)
    trainer.fit(
        GroundTruthDetector(ann_file, jitter_per_epoch=jitters),
        datamodule=DetDataModule(ann_file),
        ckpt_path=str(tmp_path / "last" / "last.ckpt"),
    )
    assert [e for e, _ in rec2.history] == [3]
    metrics = rec2.history[0][1]
    assert metrics["val/mAP"] < maps[1]
    assert metrics["val/mAP_best"] == pytest.approx(maps[1]) and metrics["val/mAP_best_epoch"] == 1
    assert cb2.state_dict() == {"best_map": pytest.approx(maps[1]), "best_epoch": 1}


def test_empty_detections_and_missing_images(tmp_path, ann_file):
    cb = CocoMAPCallback(output_dir=tmp_path, verbose=False)
    trainer = quiet_trainer(tmp_path, [cb])
    (metrics,) = trainer.validate(
        GroundTruthDetector(ann_file, empty=True), datamodule=DetDataModule(ann_file)
    )
    assert all(metrics[f"val/{n}"] == 0.0 for n in COCO_STAT_NAMES)
    assert json.loads((tmp_path / "detections_epoch_0.json").read_text()) == []

    # a partial pass (limit_val_batches) is evaluated on the images it saw, with a warning
    trainer = quiet_trainer(tmp_path, [cb], limit_val_batches=2)
    with pytest.warns(UserWarning, match="6 of the 20 images"):
        (metrics,) = trainer.validate(GroundTruthDetector(ann_file), datamodule=DetDataModule(ann_file))
    assert metrics["val/mAP"] == pytest.approx(1.0)


def test_duplicates_are_dropped_with_a_warning(tmp_path, ann_file):
    ids = [im["id"] for im in json.loads(ann_file.read_text())["images"]]
    cb = CocoMAPCallback(output_dir=tmp_path, verbose=False)
    model = GroundTruthDetector(ann_file, jitter=0.1)
    (clean,) = quiet_trainer(tmp_path, [cb]).validate(model, datamodule=DetDataModule(ann_file))
    clean_results = json.loads((tmp_path / "detections_epoch_0.json").read_text())
    with pytest.warns(UserWarning, match="dropped 3 duplicate"):
        (dup,) = quiet_trainer(tmp_path, [cb]).validate(
            model, datamodule=DetDataModule(ann_file, ids + ids[:3])
        )
    assert dup == clean
    assert json.loads((tmp_path / "detections_epoch_0.json").read_text()) == clean_results


def test_configuration_errors(tmp_path, ann_file):
    with pytest.raises(ValueError, match="backend"):
        CocoMAPCallback(backend="nope")

    class NoMeta(DetDataModule):
        category_map = None

    dm = NoMeta(ann_file)
    dm.category_map = None
    with pytest.raises(ValueError, match="category_map"):
        quiet_trainer(tmp_path, [CocoMAPCallback()]).validate(GroundTruthDetector(ann_file), datamodule=dm)
    # explicit arguments take precedence over the datamodule
    cb = CocoMAPCallback(category_map=DuckCategoryMap(), annotation_file=ann_file, save_detections=False)
    (metrics,) = quiet_trainer(tmp_path, [cb]).validate(GroundTruthDetector(ann_file), datamodule=dm)
    assert metrics["val/mAP"] == pytest.approx(1.0)
    assert not list(tmp_path.glob("detections_epoch_*.json"))
    # a label mapped to a category the annotation file lacks is an error, not a silent 0
    cb = CocoMAPCallback(category_map=DuckCategoryMap([4, 99]), save_detections=False)
    with pytest.raises(ValueError, match=r"category id\(s\) \[99\]"):
        quiet_trainer(tmp_path, [cb]).validate(GroundTruthDetector(ann_file), datamodule=dm)


def test_conversion_error_surfaces_in_sanity_check(tmp_path, ann_file):
    class BadMap:
        def label_to_category_id(self, labels):
            raise ValueError("unknown label(s) [2]")

    trainer = quiet_trainer(
        tmp_path, [CocoMAPCallback(category_map=BadMap())], max_epochs=1, num_sanity_val_steps=1
    )
    with pytest.raises(ValueError, match="unknown label"):
        trainer.fit(GroundTruthDetector(ann_file), datamodule=DetDataModule(ann_file))
    assert trainer.global_step == 0  # raised by the sanity check, before any training


def test_sanity_check_runs_the_evaluator_on_the_images_it_saw(tmp_path, ann_file, monkeypatch):
    """A broken evaluator (or ground truth) fails in the sanity check, before any training step."""
    import ssd_lightning.callbacks.coco_map as coco_map

    calls = []

    def broken(ann, rows, backend, *, verbose, image_ids):
        calls.append(sorted(int(i) for i in image_ids))
        raise RuntimeError("evaluator broken")

    monkeypatch.setattr(coco_map, "evaluate_coco", broken)
    cb = CocoMAPCallback(verbose=False)
    trainer = quiet_trainer(tmp_path, [cb], max_epochs=1, num_sanity_val_steps=1)
    with pytest.raises(RuntimeError, match="evaluator broken"):
        trainer.fit(GroundTruthDetector(ann_file), datamodule=DetDataModule(ann_file))
    assert trainer.global_step == 0
    assert len(calls) == 1 and 0 < len(calls[0]) < len(json.loads(Path(ann_file).read_text())["images"])
    assert not list(tmp_path.glob("detections_epoch_*.json"))  # the sanity pass writes no results


def test_faster_backend_same_numbers(tmp_path, ann_file):
    out = []
    for backend in ("pycocotools", "faster_coco_eval"):
        cb = CocoMAPCallback(backend=backend, save_detections=False, verbose=False)
        model = GroundTruthDetector(ann_file, jitter=0.1)
        out.append(quiet_trainer(tmp_path, [cb]).validate(model, datamodule=DetDataModule(ann_file))[0])
    assert out[0] == out[1]
    assert 0.2 < out[0]["val/mAP"] < 0.9


def test_default_backend_is_faster_coco_eval():
    from omegaconf import OmegaConf

    assert CocoMAPCallback().backend == "faster_coco_eval"
    cfg = OmegaConf.load(CONFIG_DIR / "callbacks" / "detection.yaml")
    assert cfg.coco_map.backend == "faster_coco_eval"


def test_merge_ranks_keeps_first_rank_per_image_and_row_order():
    """Rank-0 merge of the per-rank (image ids, rows) arrays: sorted by image id, each image's rows in their
    original order, an image seen by two ranks taken from the lower rank only, images without detections
    kept in the ids."""

    def rows(image_id, n, tag):  # tag in the score column tells where a row came from
        out = np.zeros((n, 7))
        out[:, 0], out[:, 5], out[:, 6] = image_id, tag + np.arange(n) / 100, 4
        return out

    rank0 = (np.array([30, 10, 20]), np.concatenate([rows(30, 2, 0), rows(10, 3, 0), rows(20, 0, 0)]))
    rank1 = (np.array([25, 10, 5]), np.concatenate([rows(25, 1, 1), rows(10, 2, 1), rows(5, 2, 1)]))
    rank2 = (np.zeros(0, dtype=np.int64), np.zeros((0, 7)))
    ids, merged, duplicates = _merge_ranks([rank0, rank1, rank2])
    assert ids.tolist() == [5, 10, 20, 25, 30] and duplicates == 1
    assert merged[:, 0].tolist() == [5, 5, 10, 10, 10, 25, 30, 30]
    assert merged[:, 5].tolist() == [1.0, 1.01, 0.0, 0.01, 0.02, 1.0, 0.0, 0.01]
    # rank order decides which copy of a duplicated image is kept
    ids, merged, duplicates = _merge_ranks([rank1, rank0])
    assert duplicates == 1 and merged[merged[:, 0] == 10][:, 5].tolist() == [1.0, 1.01]
    ids, merged, duplicates = _merge_ranks([rank2])
    assert ids.shape == (0,) and merged.shape == (0, 7) and duplicates == 0


def test_with_eval_schedule_and_checkpoint(tmp_path, ann_file):
    """EvalSchedule + CocoMAPCallback + ModelCheckpoint(monitor="val/mAP"): evaluated (and JSON written) only
    on the scheduled epochs, best checkpoint from the best of those."""
    from ssd_lightning.callbacks.eval_schedule import EvalSchedule

    jitters = [0.0, 0.15, 0.0, 0.05]  # epochs 0 and 2 would be perfect but are not evaluated
    rec = MetricRecorder()
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="val/mAP", mode="max", filename="{epoch}")
    cbs = [EvalSchedule([1]), CocoMAPCallback(verbose=False), rec, best]
    quiet_trainer(tmp_path, cbs, max_epochs=4).fit(
        GroundTruthDetector(ann_file, jitter_per_epoch=jitters), datamodule=DetDataModule(ann_file)
    )
    assert [e for e, _ in rec.history] == [1, 3]
    assert sorted(p.name for p in tmp_path.glob("detections_epoch_*.json")) == [
        "detections_epoch_1.json",
        "detections_epoch_3.json",
    ]
    assert rec.history[1][1]["val/mAP_best_epoch"] == 3
    assert Path(best.best_model_path).name == "epoch=3.ckpt"
    assert sorted(p.name for p in tmp_path.glob("per_class_epoch_*.json")) == [
        "per_class_epoch_1.json",
        "per_class_epoch_3.json",
    ]
    assert all({"val/AP/c4", "val/AP50/c9"} <= set(m) for _, m in rec.history)


# ----------------------------------------------------------------------------------------- per-class AP
def _rename_categories(ann_file: Path, names: dict[int, str], extra: list[dict]) -> Path:
    """The same annotation file with other category names and extra categories (without any box)."""
    data = json.loads(ann_file.read_text())
    data["categories"] = [{"id": c["id"], "name": names[c["id"]]} for c in data["categories"]] + extra
    ann_file.write_text(json.dumps(data))
    return ann_file


def _restricted_pycocotools(ann_file: Path, json_file: Path, category_id: int) -> tuple[float, float]:
    """(AP, AP50) of pycocotools' COCOeval on one category (``params.catIds = [category_id]``)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann_file))
        ev = COCOeval(gt, gt.loadRes(str(json_file)), "bbox")
        ev.params.catIds = [category_id]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats[0], ev.stats[1]


@pytest.mark.parametrize("backend", ["faster_coco_eval", "pycocotools"])
def test_per_class_logged_written_and_printed(tmp_path, ann_file, backend, capsys):
    """val/AP/<name> and val/AP50/<name> logged (a '/' in a name made '_', a space kept, a category without
    ground truth left out), equal to pycocotools restricted to that category; per_class_epoch_0.json holds
    every category with its GT count; the table is printed worst first; the CSV logger takes the keys."""
    from pytorch_lightning.loggers import CSVLogger

    ann_file = _rename_categories(
        ann_file, {4: "traffic light", 9: "a/b"}, extra=[{"id": 13, "name": "no boxes"}]
    )
    cb = CocoMAPCallback(backend=backend, output_dir=tmp_path / "out")
    trainer = quiet_trainer(tmp_path, [cb], logger=CSVLogger(tmp_path / "logs", name="", version=""))
    (metrics,) = trainer.validate(
        GroundTruthDetector(ann_file, jitter=0.1), datamodule=DetDataModule(ann_file), verbose=False
    )
    detections = tmp_path / "out" / "detections_epoch_0.json"
    expected = {
        4: _restricted_pycocotools(ann_file, detections, 4),
        9: _restricted_pycocotools(ann_file, detections, 9),
    }
    assert _restricted_pycocotools(ann_file, detections, 13) == (-1.0, -1.0)  # no ground truth: undefined
    assert abs(expected[4][0] - expected[9][0]) > 0.02 and all(0.2 < ap < 0.9 for ap, _ in expected.values())

    per_class = {k: v for k, v in metrics.items() if k.startswith(("val/AP/", "val/AP50/"))}
    assert per_class == pytest.approx(
        {
            "val/AP/traffic light": expected[4][0],
            "val/AP50/traffic light": expected[4][1],
            "val/AP/a_b": expected[9][0],
            "val/AP50/a_b": expected[9][1],
        },
        abs=1e-6,  # logged as float32
    )
    assert cb.last_stats["AP/a_b"] == pytest.approx(expected[9][0], abs=1e-12)

    gt = json.loads(ann_file.read_text())["annotations"]
    records = json.loads((tmp_path / "out" / "per_class_epoch_0.json").read_text())
    assert [(r["category_id"], r["name"], r["metric_key"]) for r in records] == [
        (4, "traffic light", "traffic light"),
        (9, "a/b", "a_b"),
        (13, "no boxes", "no boxes"),
    ]
    for r in records[:2]:
        assert (r["AP"], r["AP50"]) == pytest.approx(expected[r["category_id"]], abs=1e-12)
        assert r["num_gt"] == sum(a["category_id"] == r["category_id"] for a in gt) > 0
    assert records[2] == {
        "category_id": 13,
        "name": "no boxes",
        "metric_key": "no boxes",
        "AP": None,
        "AP50": None,
        "num_gt": 0,
    }

    out = capsys.readouterr().out
    assert out.count("Average Precision") == 6  # the summary, then the table
    table = out[out.index("Per-class AP") :].splitlines()[2:5]
    worst_first = sorted(expected, key=lambda c: expected[c][0])
    names = {4: "traffic light", 9: "a/b"}
    assert [line.split(None, 4)[4] for line in table] == [names[c] for c in worst_first] + ["no boxes"]
    assert [float(line.split()[0]) for line in table[:2]] == pytest.approx(
        [expected[c][0] for c in worst_first], abs=5e-4
    )

    (row,) = csv_rows(tmp_path / "logs" / "metrics.csv")
    assert float(row["val/AP/traffic light"]) == pytest.approx(expected[4][0], abs=1e-6)
    assert float(row["val/AP50/a_b"]) == pytest.approx(expected[9][1], abs=1e-6)


def test_per_class_off(tmp_path, ann_file, capsys):
    cb = CocoMAPCallback(output_dir=tmp_path, per_class=False)
    (metrics,) = quiet_trainer(tmp_path, [cb]).validate(
        GroundTruthDetector(ann_file, jitter=0.1), datamodule=DetDataModule(ann_file), verbose=False
    )
    assert set(metrics) == {f"val/{n}" for n in COCO_STAT_NAMES}
    assert (tmp_path / "detections_epoch_0.json").is_file()
    assert not list(tmp_path.glob("per_class_epoch_*.json"))
    assert "Per-class AP" not in capsys.readouterr().out


def test_per_class_on_by_default_and_quiet_without_verbose(tmp_path, ann_file, capsys):
    from omegaconf import OmegaConf

    assert CocoMAPCallback().per_class is True
    cfg = OmegaConf.load(CONFIG_DIR / "callbacks" / "detection.yaml")
    assert cfg.coco_map.per_class is True
    cb = CocoMAPCallback(verbose=False, save_detections=False)
    (metrics,) = quiet_trainer(tmp_path, [cb]).validate(
        GroundTruthDetector(ann_file), datamodule=DetDataModule(ann_file), verbose=False
    )
    assert metrics["val/AP/c4"] == pytest.approx(1.0) and metrics["val/AP50/c9"] == pytest.approx(1.0)
    assert not list(tmp_path.glob("*_epoch_*.json"))  # save_detections=False: no file at all
    assert capsys.readouterr().out == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_validate_on_gpu(tmp_path, ann_file):
    cb = CocoMAPCallback(output_dir=tmp_path, verbose=False)
    trainer = quiet_trainer(tmp_path, [cb], accelerator="gpu")
    (metrics,) = trainer.validate(
        GroundTruthDetector(ann_file, jitter=0.1), datamodule=DetDataModule(ann_file)
    )
    expected = evaluate_coco(ann_file, tmp_path / "detections_epoch_0.json", verbose=False)
    assert metrics["val/mAP"] == pytest.approx(expected["mAP"], abs=1e-6) and 0.2 < expected["mAP"] < 0.9


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ddp_two_processes_match_one(tmp_path, ann_file):
    """A real 2-process CPU DDP run (gloo, ddp_spawn): each rank sees half of the images, rank 0 evaluates
    all of them, and the stats equal those of a 1-process run."""
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    single = quiet_trainer(tmp_path / "single", [CocoMAPCallback(verbose=False)]).validate(
        GroundTruthDetector(ann_file, jitter=0.1), datamodule=DetDataModule(ann_file), verbose=False
    )[0]

    trainer = quiet_trainer(
        tmp_path / "ddp",
        [CocoMAPCallback(verbose=False, output_dir=tmp_path / "ddp_out"), DestroyProcessGroupAtExit()],
        devices=2,
        strategy="ddp_spawn",
    )
    ddp = trainer.validate(
        GroundTruthDetector(ann_file, jitter=0.1, seen_dir=str(seen_dir)),
        datamodule=DetDataModule(ann_file),
        verbose=False,
    )[0]
    assert ddp == pytest.approx(single, abs=1e-7)
    all_ids = [im["id"] for im in json.loads(ann_file.read_text())["images"]]
    rank0 = json.loads((seen_dir / "rank0_epoch0.json").read_text())
    rank1 = json.loads((seen_dir / "rank1_epoch0.json").read_text())
    assert len(rank0) == len(rank1) == len(all_ids) // 2
    assert sorted(rank0 + rank1) == sorted(all_ids)
    written = json.loads((tmp_path / "ddp_out" / "detections_epoch_0.json").read_text())
    assert {r["image_id"] for r in written} == set(all_ids)
    assert evaluate_coco(ann_file, written, verbose=False)["mAP"] == pytest.approx(
        single["val/mAP"], abs=1e-6
    )


_DDP_ERROR_SCRIPT = """
import sys
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

sys.path.insert(0, {tests_dir!r})
from test_coco_map_callback import CocoMAPCallback, DetDataModule, GroundTruthDetector

ann_file, out_dir, bad_image = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])


class RecordException(Callback):
    def on_exception(self, trainer, pl_module, exception):
        text = f"{{type(exception).__name__}}: {{exception}}"
        (out_dir / f"rank{{trainer.global_rank}}.txt").write_text(text)


trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
    enable_model_summary=False, default_root_dir=str(out_dir),
    callbacks=[CocoMAPCallback(verbose=False, save_detections=False), RecordException()],
)
trainer.validate(GroundTruthDetector(ann_file, bad_image=bad_image), datamodule=DetDataModule(ann_file))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ddp_error_on_one_rank_does_not_hang(tmp_path, ann_file):
    """A conversion error that only rank 1 hits reaches rank 0 as that error, through the gather, instead of
    rank 0 waiting in a collective that rank 1 never joins (a lost connection with gloo, a hang until the
    collective timeout with NCCL). Real 2-process "ddp" run with Lightning's subprocess launcher."""
    all_ids = [im["id"] for im in json.loads(ann_file.read_text())["images"]]
    script = tmp_path / "ddp_error.py"
    script.write_text(_DDP_ERROR_SCRIPT.format(tests_dir=str(Path(__file__).parent)))
    # DistributedSampler without shuffling gives rank 1 the odd positions
    proc = run_script(script, str(ann_file), str(tmp_path), str(all_ids[1]), timeout=240, cwd=tmp_path)
    assert proc.returncode != 0
    rank0 = (tmp_path / "rank0.txt").read_text()
    assert rank0.startswith("RuntimeError") and "rank 1: IndexError" in rank0, proc.stderr[-3000:]


def test_take_evaluation_hands_over_the_evaluation_once(tmp_path, ann_file):
    """Rank 0 keeps the evaluation it logged (stats, per-class rows, precision array, the evaluated
    detections) for DetectionAnalysis; handed over once, none from the sanity check."""
    from ssd_lightning.evaluation import class_ap_from_precision

    class Take(Callback):
        def __init__(self):
            self.taken = []

        def on_validation_end(self, trainer, pl_module):
            self.taken.append((trainer.sanity_checking, cb.take_evaluation(), cb.take_evaluation()))

    cb, take = CocoMAPCallback(output_dir=tmp_path, verbose=False, per_class=False), Take()
    trainer = quiet_trainer(tmp_path, [cb, take], max_epochs=1, num_sanity_val_steps=1)
    trainer.fit(GroundTruthDetector(ann_file, jitter=0.1), datamodule=DetDataModule(ann_file))
    (sanity, none, _), (_, evaluated, again) = take.taken
    assert sanity and none is None and again is None
    assert evaluated.epoch == 0 and evaluated.evaluation.stats == cb.last_stats
    written = json.loads((tmp_path / "detections_epoch_0.json").read_text())
    assert evaluated.detections.shape == (len(written), 7)
    assert evaluated.detections[:, 5].tolist() == [r["score"] for r in written]
    ev = evaluated.evaluation
    assert ev.precision.shape == (10, 101, 2, 4, 3) and ev.category_ids.tolist() == CATEGORY_IDS
    ap, ap50 = class_ap_from_precision(ev.precision, ev.iou_thresholds)
    assert [c.ap50 for c in ev.classes] == ap50.tolist() and np.mean(ap) == pytest.approx(
        cb.last_stats["mAP"]
    )
    assert len(ev.image_ids) == 20 and ev.max_dets == 100
