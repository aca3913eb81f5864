"""What ``grpo train`` reports per step: ``metrics.jsonl`` in its output folder
(``MetricsFile``) and one line per step where there is no progress bar (``ConsoleCallbacks``
on a stream that is not a terminal, or with ``--no-progress``)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from trainer.run.callbacks import (
    METRICS_FILE,
    CallbackList,
    ConsoleCallbacks,
    MetricsFile,
    RunInfo,
    step_line,
)


def _info(output_dir: Path, start_step: int = 0, total: int = 5) -> RunInfo:
    return RunInfo(
        total_steps=total,
        start_step=start_step,
        model_path=Path("/models/tiny"),
        output_dir=output_dir,
        device="cpu",
        engine="transformers",
    )


SYNC = {"reward/mean": 0.25, "loss/policy": 0.0125, "loss/kl": 0.0025, "time/step": 1.25}
ASYNC = {**SYNC, "async/staleness_mean": 0.75, "async/staleness_max": 1.0}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_metrics_file_holds_one_object_per_step_with_every_metric(tmp_path: Path) -> None:
    out = tmp_path / "run"
    metrics = MetricsFile()
    metrics.on_start(_info(out))
    metrics.on_step(1, SYNC)
    metrics.on_step(2, {**ASYNC, "mismatch/kl": math.nan, "grad_norm": math.inf})
    assert metrics.path == out / METRICS_FILE
    assert _lines(out / METRICS_FILE) == [
        {"step": 1, **SYNC},
        {"step": 2, **ASYNC, "mismatch/kl": None, "grad_norm": None},  # JSON has no nan
    ]


def test_a_fresh_run_starts_the_file_empty_and_a_resume_keeps_its_steps(tmp_path: Path) -> None:
    metrics = MetricsFile()
    metrics.on_start(_info(tmp_path))
    for step in (1, 2, 3, 4):
        metrics.on_step(step, {"reward/mean": float(step)})
    with (tmp_path / METRICS_FILE).open("a", encoding="utf-8") as fh:
        fh.write('{"step": 5, "rew')  # a line cut by a crash
    # Resumed from the checkpoint of step 2: steps 3 and 4 are done again, once each.
    resumed = MetricsFile()
    resumed.on_start(_info(tmp_path, start_step=2))
    resumed.on_step(3, {"reward/mean": 30.0})
    assert _lines(tmp_path / METRICS_FILE) == [
        {"step": 1, "reward/mean": 1.0},
        {"step": 2, "reward/mean": 2.0},
        {"step": 3, "reward/mean": 30.0},
    ]
    MetricsFile().on_start(_info(tmp_path))  # a fresh run in the same folder
    assert (tmp_path / METRICS_FILE).read_text(encoding="utf-8") == ""


def test_the_step_line_has_step_reward_loss_and_an_async_runs_staleness() -> None:
    assert step_line(3, 20, SYNC) == "step 3/20 reward 0.250 loss 0.0150 s/step 1.2"
    assert step_line(3, 20, {**ASYNC, "eval/accuracy": 0.5}) == (
        "step 3/20 reward 0.250 loss 0.0150 staleness 0.75 eval 0.500 s/step 1.2"
    )
    assert step_line(1, 2, {}) == "step 1/2 reward nan loss nan s/step nan"
    agent = {**SYNC, "kl": 0.0025, "episode/turns": 1.5, "tools/calls": 0.5}
    assert step_line(2, 2, agent) == (
        "step 2/2 reward 0.250 loss 0.0150 kl 0.0025 turns 1.50 tools 0.50 tool_err 0.00 s/step 1.2"
    )


@pytest.mark.parametrize(
    ("stream", "disable"),
    [(io.StringIO(), False), (_Terminal(), True)],
    ids=["pipe", "no-progress"],
)
def test_without_a_bar_each_step_prints_one_line(
    tmp_path: Path, stream: io.StringIO, disable: bool
) -> None:
    console = ConsoleCallbacks(stream, disable=disable)
    console.on_start(_info(tmp_path, total=2))
    console.on_step(1, SYNC)
    console.on_step(2, ASYNC)
    console.close()
    lines = stream.getvalue().splitlines()
    assert lines[1:] == [step_line(1, 2, SYNC), step_line(2, 2, ASYNC)]
    assert "\r" not in stream.getvalue()


def test_on_a_terminal_the_bar_stays_and_prints_no_step_lines(tmp_path: Path) -> None:
    stream = _Terminal()
    console = ConsoleCallbacks(stream)
    console.on_start(_info(tmp_path, total=2))
    console.on_step(1, SYNC)
    console.close()
    assert "step 1/2 reward" not in stream.getvalue() and "grpo" in stream.getvalue()


def test_the_cli_hands_the_run_both_callbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``grpo train`` passes a callback list holding the console and the metrics file, whose
    steps (here a stand-in run's) reach ``metrics.jsonl`` and stderr's step lines."""
    from trainer.run import cli
    from trainer.run.loop import TrainResult

    seen: list[CallbackList] = []

    def fake_run(config, callbacks, nproc, output_dir, resume, device):  # type: ignore[no-untyped-def]
        seen.append(callbacks)
        callbacks.on_start(_info(output_dir, total=2))
        callbacks.on_step(1, SYNC)
        callbacks.on_step(2, ASYNC)
        return TrainResult(final_step=2)

    monkeypatch.setattr(cli, "_run", fake_run)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # main sets it when unset: restored after
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tiny-smoke.yaml"
    out = tmp_path / "run"
    assert cli.main([str(recipe), "--output-dir", str(out), "--no-progress"]) == 0
    assert [type(cb) for cb in seen[0].callbacks] == [ConsoleCallbacks, MetricsFile]
    assert _lines(out / METRICS_FILE) == [{"step": 1, **SYNC}, {"step": 2, **ASYNC}]
    err = capsys.readouterr().err
    assert step_line(1, 2, SYNC) in err and step_line(2, 2, ASYNC) in err
