"""Text output: metric CSV and tables, log lines."""

from __future__ import annotations

import csv
import io

from grpo_cli.render import metrics_csv, metrics_table, stream_line

SERIES = {
    "reward/mean": [{"step": 1, "value": 0.25}, {"step": 2, "value": 0.1 + 0.2}],
    "eval/accuracy": [{"step": 2, "value": 0.5}],
}


def test_metrics_csv_rows_are_steps_and_columns_metrics() -> None:
    rows = list(csv.reader(io.StringIO(metrics_csv(SERIES))))
    assert rows == [
        ["step", "eval/accuracy", "reward/mean"],
        ["1", "", "0.25"],
        ["2", "0.5", "0.30000000000000004"],  # repr: values round-trip exactly
    ]
    assert metrics_csv({}) == "step\n"


def test_metrics_table_aligns_columns() -> None:
    lines = metrics_table(SERIES).splitlines()
    assert lines[0].split() == ["step", "eval/accuracy", "reward/mean"]
    assert lines[1].split() == ["1", "-", "0.25"]
    assert len({len(line) for line in lines}) == 1
    assert metrics_table({}) == "no metrics recorded yet"


def test_stream_lines() -> None:
    metrics = {"step": 3, "attempt": 1, "values": {"reward/mean": 0.5, "kl": 0.00123, "x": 1.0}}
    assert stream_line("metrics", metrics, 10) == "step    3/10  reward/mean 0.5  kl 0.00123"
    event = {
        "id": 7,
        "type": "checkpoint_saved",
        "level": "info",
        "message": "checkpoint at step 2",
        "created_at": "2026-01-02T03:04:05.678+00:00",
    }
    assert stream_line("event", event) == "03:04:05 [checkpoint_saved] checkpoint at step 2"
    warning = {**event, "type": "warning", "level": "warning", "message": "slow"}
    assert stream_line("event", warning) == "03:04:05 [warning warning] slow"
    assert stream_line("end", {"status": "failed"}) == "end: job failed"
