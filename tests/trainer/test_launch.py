"""launch_ranks end to end: torchrun's agent, two gloo ranks on CPU training the tiny recipe on
the transformers engine, rank 0 relaying to callbacks in this process. Then its failures: a
TrainerError of rank 0, a rank killed with SIGKILL, the launching process killed. After each,
no rank and no agent may be left. (Marked `model` and `process` in tests/trainer/conftest.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobspec import JobSpec
from tests.conftest import wait_until
from tests.trainer.ranks_support import (
    Recorder,
    alive,
    processes_mentioning,
    rank_pids,
)
from trainer.errors import RankFailed, TrainerError
from trainer.run.cli import load_recipe
from trainer.run.launch import launch_ranks
from trainer.run.rank_main import pid_file

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-smoke.yaml"


@pytest.fixture(autouse=True)
def _bounded_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that wait on each other give up within two minutes, never hang the suite."""
    monkeypatch.setenv("GRPO_DIST_TIMEOUT_S", "120")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "run"
    yield folder
    # Whatever the test did, nothing of the launch may outlive it.
    left = processes_mentioning(str(folder))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the launch still running: {left}"


def tiny(steps: int, **grpo: object) -> JobSpec:
    spec = load_recipe(RECIPE, steps=steps, engine="transformers", devices=2)
    return spec.model_copy(update={"grpo": spec.grpo.model_copy(update=grpo)})


def assert_all_gone(out: Path, nproc: int = 2) -> None:
    pids = rank_pids(out, nproc)
    assert len(pids) == nproc, "every rank wrote its pid"
    assert not [pid for pid in pids if alive(pid)]
    assert processes_mentioning(str(out)) == []  # the agent too


def test_two_ranks_train_and_rank_0_reports_each_step_once(out: Path) -> None:
    calls = Recorder()
    started = time.monotonic()
    result = launch_ranks(
        tiny(2), calls, nproc=2, output_dir=out, resume_from=None, device="cpu", sample_groups=1
    )
    print(f"2 ranks, 2 steps: {time.monotonic() - started:.1f}s")
    assert len(calls.of("start")) == 1
    assert [c[1] for c in calls.of("step")] == [1, 2]
    assert calls.of("should_stop"), "rank 0 asked the launcher's callbacks whether to stop"
    assert [(c[1], len(c[2])) for c in calls.of("samples")] == [(1, 1), (2, 1)]  # type: ignore[arg-type]
    final = out / "checkpoint-000002"
    assert calls.of("checkpoint") == [("checkpoint", 2, final)]
    assert (final / "manifest.json").is_file()
    assert (result.final_step, result.checkpoint_path, result.stopped_early) == (2, final, False)
    assert result.last_metrics["reward/mean"] == calls.of("step")[-1][2]["reward/mean"]  # type: ignore[index]
    assert_all_gone(out)


def test_a_trainer_error_of_rank_0_is_raised_here_with_its_reason(out: Path) -> None:
    # No prompt of the recipe fits in 2 tokens: the run's setup raises PromptsTooLong.
    with pytest.raises(TrainerError) as raised:
        launch_ranks(tiny(2, max_prompt_tokens=2), Recorder(), nproc=2, output_dir=out,
                     resume_from=None, device="cpu")  # fmt: skip
    assert raised.value.reason == "prompts_too_long"
    assert not isinstance(raised.value, RankFailed)
    assert "no training row fits" in str(raised.value)
    assert_all_gone(out)


class KillsRankOne(Recorder):
    """kill -9 of rank 1 as soon as rank 0 reports its first step."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.killed_at: float | None = None

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        super().on_step(step, metrics)
        if self.killed_at is None:
            os.kill(int(pid_file(self.out, 1).read_text()), signal.SIGKILL)
            self.killed_at = time.monotonic()


def test_a_rank_killed_with_sigkill_ends_the_launch_as_rank_failed(out: Path) -> None:
    calls = KillsRankOne(out)
    with pytest.raises(RankFailed) as raised:
        launch_ranks(tiny(200), calls, nproc=2, output_dir=out, resume_from=None, device="cpu")
    assert calls.killed_at is not None
    took = time.monotonic() - calls.killed_at
    print(f"rank_failed {took:.1f}s after the kill")
    assert took < 60  # torchrun stops rank 0 and exits; nothing waits on a dead peer
    assert raised.value.reason == "rank_failed"
    assert "rank 1 failed (killed by signal 9 (SIGKILL))" in str(raised.value)
    assert len(calls.of("step")) < 200
    assert_all_gone(out)


def test_killing_the_launching_process_takes_the_agent_and_the_ranks_with_it(
    out: Path, tmp_path: Path
) -> None:
    script = (
        "import sys; from pathlib import Path;"
        "from trainer.run.cli import load_recipe;"
        "from trainer.run.callbacks import Callbacks;"
        "from trainer.run.launch import launch_ranks;"
        "spec = load_recipe(Path(sys.argv[1]), steps=200, engine='transformers', devices=2);"
        "launch_ranks(spec, Callbacks(), nproc=2, output_dir=Path(sys.argv[2]),"
        " resume_from=None, device='cpu')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "launcher.log").open("wb")
    launcher = subprocess.Popen(
        [sys.executable, "-c", script, str(RECIPE), str(out)],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    try:
        wait_until(lambda: len(rank_pids(out, 2)) == 2, 120, "both ranks to start")
        pids = rank_pids(out, 2)
        assert all(alive(pid) for pid in pids)
        launcher.kill()
        launcher.wait(10)
        # A rank in the middle of exiting no longer shows its command line but still runs:
        # wait for both signs.
        wait_until(
            lambda: not processes_mentioning(str(out)) and not any(alive(p) for p in pids),
            30,
            "the agent and ranks to die",
        )
        assert not [pid for pid in pids if alive(pid)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        log.close()
