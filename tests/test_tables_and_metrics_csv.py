"""The one markdown-table formatter (ssd_lightning.tables) and the one metrics.csv reader
(ssd_lightning.metrics_csv), against hand-written text, and the old entry points that now reuse them."""

from __future__ import annotations

import pytest

from ssd_lightning.metrics_csv import last_values, read_last_metrics, read_metrics_csv
from ssd_lightning.tables import markdown_row, markdown_rule, markdown_table

pytestmark = pytest.mark.no_dali

METRICS = (
    "epoch,step,lr,train/loss_step,val/mAP,val/mAP_50,note\n"
    "0,9,0.1,2.5,,,x\n"
    "0,19,0.05,2.0,,,\n"
    "0,19,,,0.25,0.5,\n"
    "1,29,0.01,,nan,,\n"
)


def test_markdown_table_plain_and_aligned():
    table = markdown_table(["name", "n"], [["a", 1], ["bb", None]], align="lr")
    assert table == "| name | n |\n|---|---:|\n| a | 1 |\n| bb |  |"
    assert markdown_table(["x"], [[None]], missing="–").endswith("| – |")


def test_markdown_table_padded_reads_aligned_as_text():
    table = markdown_table(["name", "value"], [["a", "1.50"], ["long name", "12.00"]], align="lr", pad=True)
    assert table.splitlines() == [
        "| name      | value |",
        "|-----------|------:|",
        "| a         |  1.50 |",
        "| long name | 12.00 |",
    ]
    assert len({len(line) for line in table.splitlines()}) == 1


def test_markdown_pieces_and_shape_errors():
    assert markdown_row([1, "b", None]) == "| 1 | b |  |"
    assert markdown_rule("lrl") == "|---|---:|---|"
    with pytest.raises(ValueError, match="2 letters for 3 columns"):
        markdown_table(["a", "b", "c"], [], align="lr")
    with pytest.raises(ValueError, match="a row has 1 cells for 2 columns"):
        markdown_table(["a", "b"], [["x"]])


def test_read_metrics_csv_rows_of_floats(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(METRICS)
    rows = read_metrics_csv(path)
    assert rows[0] == {"epoch": 0.0, "step": 9.0, "lr": 0.1, "train/loss_step": 2.5}  # "x" is no number
    assert rows[2] == {"epoch": 0.0, "step": 19.0, "val/mAP": 0.25, "val/mAP_50": 0.5}
    assert len(rows) == 4
    with pytest.raises(FileNotFoundError, match="csv/metrics.csv"):
        read_metrics_csv(tmp_path / "missing.csv")


def test_last_values_by_pattern_without_bookkeeping(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(METRICS)
    last = read_last_metrics(path, ["val/*", "lr"])
    assert last["lr"] == 0.01 and last["val/mAP_50"] == 0.5
    assert last["val/mAP"] != last["val/mAP"]  # the last logged value, NaN included
    assert list(last) == ["lr", "val/mAP", "val/mAP_50"]  # order of first appearance
    assert "epoch" not in read_last_metrics(path) and "step" not in read_last_metrics(path)
    assert read_last_metrics(tmp_path / "missing.csv") == {}
    assert last_values(read_metrics_csv(path), ["train/*"]) == {"train/loss_step": 2.0}


def test_the_old_names_are_the_one_reader():
    from ssd_lightning import visualize
    from ssd_lightning.cli import sweep_summary

    assert visualize.read_metrics_csv is read_metrics_csv
    assert sweep_summary.read_last_metrics is read_last_metrics
