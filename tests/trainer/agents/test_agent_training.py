"""Agent jobs through the training loop (issue 27): episodes instead of single completions,
graders reading the transcript, the environment's reward in the total, the episode metrics in
the step's metrics, and hostile tools that only give error results."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from transformers import PreTrainedTokenizerBase

from jobspec import JobSpec
from tests.agent_jobs import (
    CALCULATOR,
    HOSTILE,
    TRANSCRIPT_GRADER,
    ScriptedEngine,
    agent_job,
    scripted_reply,
)
from tests.trainer.conftest import tiny_llama
from trainer.checkpoint.store import latest_checkpoint
from trainer.errors import TrainerError
from trainer.run.callbacks import Callbacks, RolloutSample
from trainer.run.cli import main
from trainer.run.loop import train

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
    pytest.mark.usefixtures("one_torch_thread"),
]


def test_grpo_train_runs_a_tiny_agent_job_with_a_calculator_and_a_two_turn_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = tmp_path / "agents.yaml"
    recipe.write_text(yaml.safe_dump(agent_job()))
    out = tmp_path / "run"
    code = main([str(recipe), "--output-dir", str(out), "--threads", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert re.search(r"turns \d.* tools \d", captured.err)  # the step lines of an agent job
    final = latest_checkpoint(out)
    assert final is not None and final.name == "checkpoint-000002"
    metrics = json.loads((final / "manifest.json").read_text())["extra"]["metrics"]
    names = {"episode/turns", "episode/masked_token_frac", "episode/end/done", "tools/calls",
             "tools/errors", "tools/malformed", "reward/environment/mean"}  # fmt: skip
    assert names <= set(metrics), names - set(metrics)
    # The transcript reached the python grader (it needs sample.messages and tool_calls).
    assert metrics["reward/transcript/mean"] == 1.0 and metrics["reward/transcript/errors"] == 0


class Recorder(Callbacks):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.samples: list[RolloutSample] = []

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(dict(metrics))

    def on_samples(self, step: int, samples: list[RolloutSample]) -> None:
        self.samples.extend(samples)


def test_episodes_train_with_tools_an_environment_and_hostile_tools(
    tmp_path: Path, smol: PreTrainedTokenizerBase
) -> None:
    spec = JobSpec.model_validate(
        agent_job(
            tools=[CALCULATOR, *HOSTILE],
            graders=[{"type": "python", "name": "transcript", "source": TRANSCRIPT_GRADER}],
            episode={"max_turns": 4, "max_episode_tokens": 2048, "tool_timeout_s": 2.0},
            grpo={**agent_job()["grpo"], "max_new_tokens": 256, "max_prompt_tokens": 2048},
        )
    )
    model = tiny_llama(len(smol))
    model.config.max_position_embeddings = 4096  # rotary positions are computed as needed
    engine = ScriptedEngine(smol, scripted_reply)
    recorder = Recorder()
    result = train(spec, recorder, output_dir=tmp_path, model=model, tokenizer=smol, engine=engine)
    assert result.final_step == 2 and len(recorder.steps) == 2
    metrics = recorder.steps[-1]
    for name in ("episode/turns", "tools/calls", "tools/errors", "episode/end/done",
                 "episode/masked_token_frac", "reward/environment/mean"):  # fmt: skip
        assert name in metrics, name
    assert metrics["episode/turns"] == 3.0  # the calls, the answer, the answer again
    assert metrics["tools/calls"] == 5.0 and metrics["episode/end/done"] == 1.0
    # Every hostile call is an error result the model reads; the calculator's is not.
    assert metrics["tools/errors"] == 4.0 and metrics["tools/malformed"] == 0.0
    # One answer in three is wrong: the graders and the environment see it (0.5 x env reward).
    right = [m["reward/transcript/mean"] for m in recorder.steps]
    envs = [m["reward/environment/mean"] for m in recorder.steps]
    assert all(0.0 < r < 1.0 for r in right) and right == envs
    assert [m["reward/mean"] for m in recorder.steps] == pytest.approx([1.5 * r for r in right])
    assert any(m["update/skipped"] == 0.0 for m in recorder.steps)  # episodes were trained
    assert 0.0 < metrics["episode/masked_token_frac"] < 1.0
    assert recorder.samples and recorder.samples[0].completions[0].text.startswith("The answer")
    # Each episode's sample carries its turns for the rollout viewer: the calls with their
    # arguments, one result per call (the hostile ones failed), the answers and the question.
    first = recorder.samples[0]
    a, b = (int(n) for n in re.findall(r"What is (\d+) times (\d+)", first.prompt)[-1])
    for sample in first.completions:
        transcript = sample.transcript
        assert transcript is not None and transcript["end_reason"] == "done"
        turns = transcript["turns"]
        assert [t["source"] for t in turns] == ["model", *["tool"] * 5, "model", "environment",
                                                "model"]  # fmt: skip
        calls = turns[0]["tool_calls"]
        assert [c["name"] for c in calls] == ["multiply", "peek", "dial", "spin", "flood"]
        assert json.loads(calls[0]["arguments"]) == {"a": a, "b": b}
        assert [t["name"] for t in turns[1:6]] == [c["name"] for c in calls]
        assert turns[1]["content"] == str(a * b) and turns[1]["error"] is None
        assert all(t["error"] for t in turns[2:6])  # the hostile tools: error results
        assert turns[7]["content"] == "Are you sure?"
        assert turns[8]["content"] == sample.text and transcript["turns_left_out"] == 0


def test_what_is_not_wired_is_still_refused(tmp_path: Path) -> None:
    http = {**CALCULATOR, "implementation": {"type": "http", "endpoint": "calc"}}
    for fields, why in (
        ({"tools": [http]}, "http tools"),
        ({"environment": {"type": "http", "endpoint": "env"}}, "http environments"),
    ):
        spec = JobSpec.model_validate(agent_job(**fields))
        with pytest.raises(TrainerError) as info:
            train(spec, output_dir=tmp_path)
        assert info.value.reason == "agents_not_supported" and why in str(info.value), fields
