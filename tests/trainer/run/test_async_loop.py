"""Async GRPO through ``train()`` on the tiny model: a rollout server of its own generates the
steps ahead with the versions the schedule names, a resume reproduces the straight run, the
synchronous default is untouched, and the mismatch guard pauses the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.test_loop import Recorder, tiny_spec
from trainer.run.async_rollouts import behaviour_version
from trainer.run.async_run import ENGINE_MISMATCH_METRIC, PENDING_KEY
from trainer.run.loop import train

pytestmark = [pytest.mark.process, pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]


def _async_spec(k: int, steps: int, **grpo: Any) -> Any:
    return tiny_spec(
        steps=steps,
        grpo={
            "prompts_per_step": 4,
            "group_size": 4,
            "max_new_tokens": 12,
            # The tiny random model moves far in one step at this learning rate: the guard's
            # bound is the guard test's business.
            "async": {
                "max_staleness": k,
                "server_threads": 1,
                "max_mismatch": 100,
                "max_capped_frac": 1.0,
                **grpo.pop("async", {}),
            },
            **grpo,
        },
        dataset={"rows": [{"prompt": f"say {w}"} for w in "abcdef"]},  # epochs cross mid-step
    )


def _comparable(metrics: dict[str, float]) -> dict[str, float]:
    skip = ("time/", "tokens_per_s", "async/rollout_busy_frac", "async/update_busy_frac")
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


def test_an_async_run_trains_on_samples_k_versions_behind(tmp_path: Path) -> None:
    k, steps = 2, 4
    recorder = Recorder()
    result = train(_async_spec(k, steps), recorder, output_dir=tmp_path)
    assert result.final_step == steps and not result.stopped_early
    for step in range(1, steps + 1):
        m = recorder.metrics[step]
        version = behaviour_version(step, k)
        assert m["async/behaviour_version"] == version
        assert m["async/staleness_max"] == step - 1 - version  # 0, 1, 2, 2
        assert m["async/staleness_count/" + str(step - 1 - version)] == 16.0
        assert m["async/dropped_stale"] == 0.0
        assert 0.0 <= m["async/rollout_busy_frac"] <= 1.0
        assert m["rollout/server_restarts"] == 0.0
        # The mismatch between the server's sampling and the trainer: ~1 at lag 0, above it
        # once the samples are a version or more behind.
        assert m["mismatch/token_mult_prob_error"] >= 1.0
    assert recorder.metrics[3]["mismatch/token_mult_prob_error"] > 1.0 + 1e-6
    # The last checkpoint keeps nothing ahead: there is no step after it.
    manifest = json.loads((result.checkpoint_path / "manifest.json").read_text())  # type: ignore[operator]
    assert manifest["extra"][PENDING_KEY] == {}


def test_max_staleness_0_is_the_synchronous_run(tmp_path: Path) -> None:
    default, explicit = Recorder(), Recorder()
    train(tiny_spec(steps=2), default, output_dir=tmp_path / "default")
    train(
        tiny_spec(steps=2, grpo={"async": {"max_staleness": 0}}),
        explicit,
        output_dir=tmp_path / "explicit",
    )
    for step in (1, 2):
        assert not any(k.startswith("async/") for k in explicit.metrics[step])
        a, b = _comparable(default.metrics[step]), _comparable(explicit.metrics[step])
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert b[key] == pytest.approx(value, abs=1e-6), (step, key)


def test_an_async_resume_reproduces_the_straight_run(tmp_path: Path) -> None:
    spec = _async_spec(2, 5, num_iterations=2, mini_batch_size=8)
    straight = Recorder()
    train(spec, straight, output_dir=tmp_path / "straight")

    first = Recorder(stop_after=2)
    half = train(spec, first, output_dir=tmp_path / "resumed")
    assert half.stopped_early and half.final_step == 2 and half.checkpoint_path is not None
    manifest = json.loads((half.checkpoint_path / "manifest.json").read_text())
    assert sorted(manifest["extra"][PENDING_KEY]) == ["3", "4"]  # made ahead, kept
    second = Recorder()
    train(spec, second, output_dir=tmp_path / "resumed", resume_from=half.checkpoint_path)
    assert sorted(second.metrics) == [3, 4, 5]
    resumed = {**first.metrics, **second.metrics}
    for step in range(1, 6):
        want = _comparable(straight.metrics[step])
        got = _comparable(resumed[step])
        assert got.keys() == want.keys(), step
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-5), (step, key)


def test_the_mismatch_guard_pauses_on_a_capped_share_with_its_reason(tmp_path: Path) -> None:
    # A bound on the capped share just above 0: from step 2 the samples are a version behind
    # a model this rate moves far, so some token's weight passes the correction's cap.
    spec = _async_spec(1, 4, learning_rate=1e-2, **{"async": {"max_capped_frac": 1e-6}})
    recorder = Recorder()
    result = train(spec, recorder, output_dir=tmp_path)
    assert result.stopped_early and 2 <= result.final_step < 4
    assert result.pause_reason is not None and "mismatch guard" in result.pause_reason
    assert "mismatch/capped_frac" in result.pause_reason
    assert recorder.metrics[result.final_step]["mismatch/capped_frac"] > 1e-6
    assert result.checkpoint_path == tmp_path / f"checkpoint-{result.final_step:06d}"
    assert ("paused", "warning", result.pause_reason) in recorder.events


def test_the_mismatch_guard_pauses_on_the_engines_own_mismatch(tmp_path: Path) -> None:
    # A bfloat16 engine against the float32 trainer, on the same weights at step 1 (no lag).
    spec = _async_spec(1, 3, **{"async": {"max_mismatch": 1.000001}})
    spec = spec.model_copy(
        update={"rollout": spec.rollout.model_copy(update={"dtype": "bfloat16"})}
    )
    recorder = Recorder()
    result = train(spec, recorder, output_dir=tmp_path)
    assert result.stopped_early and result.final_step == 1
    assert result.pause_reason is not None and ENGINE_MISMATCH_METRIC in result.pause_reason
    assert recorder.metrics[1][ENGINE_MISMATCH_METRIC] > 1.000001


def test_dynamic_sampling_rounds_are_made_ahead_with_the_steps_version(tmp_path: Path) -> None:
    spec = _async_spec(1, 3, dynamic_sampling={"enabled": True, "max_rounds": 3})
    recorder = Recorder()
    result = train(spec, recorder, output_dir=tmp_path)
    assert result.final_step == 3
    for step, m in recorder.metrics.items():
        # Every round of a step (refills included) sampled with that step's version.
        assert m["async/staleness_max"] == step - 1 - behaviour_version(step, 1)
        assert m["async/dropped_stale"] == 0.0


def test_an_agent_job_runs_its_episodes_in_the_rollout_server(tmp_path: Path) -> None:
    """Agent episodes (the calculator, the two-turn environment) through the rollout server:
    every turn of an episode is sampled with its step's version, and the episode's sample
    carries it. (The random model's turns mostly run to max_new_tokens, which ends an
    episode; tests/trainer/agents covers the turns themselves with a scripted model.)"""
    from jobspec import JobSpec
    from tests.agent_jobs import agent_job

    data = agent_job()
    data["grpo"] |= {
        "steps": 3,
        "async": {"max_staleness": 1, "server_threads": 1, "max_mismatch": 100},
    }
    recorder = Recorder()
    result = train(JobSpec.model_validate(data), recorder, output_dir=tmp_path)
    assert result.final_step == 3
    for step, m in recorder.metrics.items():
        assert m["episode/turns"] >= 1.0
        assert m["async/staleness_max"] == step - 1 - behaviour_version(step, 1)
        assert m["async/staleness_count/" + str(step - 1 - behaviour_version(step, 1))] == 4.0
