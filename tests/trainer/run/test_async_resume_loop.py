"""Resuming an async run with another ``grpo.async.max_staleness`` through ``train()`` and a
real rollout server (issue 45): every step trains the straight run's prompts, none is dropped
as too stale or skipped, and the weight versions are written in the run's own folder and
removed with it. (Each case on the run's pieces, with the numbers:
tests/trainer/run/test_async_resume_staleness.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobspec import JobSpec
from tests.trainer.run.test_async_loop import _async_spec
from tests.trainer.test_loop import Recorder
from trainer.run.async_run import VERSIONS_DIR
from trainer.run.loop import train

pytestmark = [pytest.mark.process, pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = 4


class Watcher(Recorder):
    """Records each step's prompts (every group: ``sample_groups`` = the step's prompts) and
    where the run keeps its weight versions while it runs."""

    def __init__(self, output_dir: Path, stop_after: int | None = None) -> None:
        super().__init__(stop_after)
        self.output_dir = output_dir
        self.versions_seen: list[list[str]] = []

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        super().on_step(step, metrics)
        folder = self.output_dir / VERSIONS_DIR
        self.versions_seen.append(sorted(p.name for p in folder.glob("*/versions/v*")))

    def prompts(self) -> dict[int, list[str]]:
        return {step: [s.prompt for s in samples] for step, samples in self.samples.items()}


def test_a_resume_with_another_k_trains_the_straight_runs_prompts(tmp_path: Path) -> None:
    def spec(k: int) -> JobSpec:
        return _async_spec(k, 5)

    straight = Watcher(tmp_path / "straight")
    train(spec(2), straight, output_dir=straight.output_dir, sample_groups=PROMPTS)
    first = Watcher(tmp_path / "resumed", stop_after=2)
    half = train(spec(2), first, output_dir=first.output_dir, sample_groups=PROMPTS)
    assert half.final_step == 2 and half.checkpoint_path is not None
    # The versions were files in the run's folder while it ran, and left with it.
    assert first.versions_seen[0] and all(v for v in first.versions_seen)
    assert not (first.output_dir / VERSIONS_DIR).exists()

    for k in (1, 0):  # lower, then synchronous: the batches made for steps 3-4 sampled again
        second = Watcher(first.output_dir)
        train(
            spec(k),
            second,
            output_dir=first.output_dir,
            resume_from=half.checkpoint_path,
            sample_groups=PROMPTS,
        )
        assert {**first.prompts(), **second.prompts()} == straight.prompts(), k
        for step, metrics in second.metrics.items():
            assert metrics.get("async/dropped_stale", 0.0) == 0.0, (k, step)
            assert metrics.get("async/staleness_max", 0.0) <= k, (k, step)
        assert any(kind == "resume" and "sampled again" in text for kind, _, text in second.events)
