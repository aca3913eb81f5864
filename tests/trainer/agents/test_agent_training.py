"""Agent jobs through the training loop (issue 27): episodes instead of single completions,
graders reading the transcript, the environment's reward in the total, the episode metrics in
the step's metrics, and hostile tools that only give error results."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import PreTrainedTokenizerBase

from tests.trainer.agents.conftest import ScriptedEngine
from tests.trainer.conftest import tiny_llama
from trainer.checkpoint.store import latest_checkpoint
from trainer.errors import TrainerError
from trainer.run.callbacks import Callbacks, RolloutSample
from trainer.run.cli import main
from trainer.run.loop import train
from trainer.spec import JobSpec

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def tool(name: str, source: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in properties.items()},
            },
        },
        "implementation": {"type": "python", "source": source},
    }


CALCULATOR = tool("multiply", "def multiply(a, b):\n    return a * b\n", a="integer", b="integer")
HOSTILE = [
    tool("peek", "def peek():\n    return open('/etc/shadow').read()\n"),
    tool(
        "dial",
        "import socket\n\ndef dial():\n"
        "    return str(socket.create_connection(('1.1.1.1', 80), timeout=1))\n",
    ),
    tool("spin", "def spin():\n    while True:\n        pass\n"),
    tool("flood", "def flood():\n    print('x' * 100_000_000)\n    return 'x' * 100_000_000\n"),
]
# Two turns: the first answer is questioned, the second ends the episode; reward 1 when the
# episode's last answer is the row's answer.
TWO_TURNS = """
class Environment:
    def reset(self, item):
        self.answer = str(item["answer"])
        self.turns = 0
        return []

    def step(self, messages):
        self.turns += 1
        if self.turns < 2:
            return {"messages": [{"role": "user", "content": "Are you sure?"}], "reward": 0.0}
        right = self.answer in messages[-1]["content"]
        return {"messages": [], "reward": 1.0 if right else 0.0, "done": True}
"""
# Full marks when the final answer is the row's and the transcript shows a multiply call.
TRANSCRIPT_GRADER = """
def grade(sample, item):
    calls = [c["name"] for c in sample["tool_calls"]]
    roles = [m["role"] for m in sample["messages"]]
    assert "assistant" in roles
    used = 1.0 if "multiply" in calls else 0.5
    return used if str(item["answer"]) in sample["output_text"] else 0.0
"""
HAS_MESSAGES = """
def grade(sample, item):
    roles = [m["role"] for m in sample["messages"]]
    return 1.0 if roles.count("assistant") >= 1 and isinstance(sample["tool_calls"], list) else 0.0
"""


def agent_job(**fields: Any) -> dict[str, Any]:
    rows = [{"prompt": f"What is {a} times {b}?", "answer": str(a * b)} for a, b in
            [(12, 34), (23, 45), (31, 27), (19, 41)]]  # fmt: skip
    job: dict[str, Any] = {
        "name": "tiny-agents",
        "model": "tiny-random-llama",
        "seed": 0,
        "dataset": {"rows": rows, "use_chat_template": True},
        "graders": [{"type": "python", "name": "transcript", "source": HAS_MESSAGES}],
        "tools": [CALCULATOR],
        "environment": {"type": "python", "source": TWO_TURNS, "weight": 0.5},
        "episode": {"max_turns": 4, "max_episode_tokens": 1024, "tool_timeout_s": 2.0},
        "grpo": {
            "steps": 2,
            "prompts_per_step": 2,
            "group_size": 2,
            "learning_rate": 0.001,
            "max_new_tokens": 8,
            "max_prompt_tokens": 1024,
            "micro_batch_size": 4,
        },
        "rollout": {"engine": "transformers", "dtype": "float32"},
        "checkpoint_interval": 0,
    }
    job.update(fields)
    return job


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_grpo_train_runs_a_tiny_agent_job_with_a_calculator_and_a_two_turn_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = tmp_path / "agents.yaml"
    recipe.write_text(yaml.safe_dump(agent_job()))
    out = tmp_path / "run"
    code = main([str(recipe), "--output-dir", str(out), "--threads", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert re.search(r"turns=\d", captured.err) and "tools=" in captured.err  # the step line
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


def scripted_reply(prompt: str) -> str:
    """Call every tool once, then answer with the multiply result; asked again, answer again."""
    if "<tool_call>" not in prompt.split("Available tools:")[-1]:
        a, b = re.findall(r"What is (\d+) times (\d+)", prompt)[-1]
        calls = [f'{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}']
        calls += [f'{{"name": "{name}", "arguments": {{}}}}' for name in
                  ("peek", "dial", "spin", "flood")]  # fmt: skip
        return "\n".join(f"<tool_call>{c}</tool_call>" for c in calls)
    # The multiply result: the first tool turn after the calls (a tool turn, or a user turn).
    product = re.findall(r"(?:<\|im_start\|>tool\n|Tool result \(multiply\):\n)(\d+)", prompt)
    wrong = next(ANSWERS) % 3 == 2
    return f"The answer is {'unknown' if wrong or not product else product[0]}."


ANSWERS = itertools.count()


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
        ({"resources": {"devices": 2}}, "one device"),
    ):
        spec = JobSpec.model_validate(agent_job(**fields))
        with pytest.raises(TrainerError) as info:
            train(spec, output_dir=tmp_path)
        assert info.value.reason == "agents_not_supported" and why in str(info.value), fields
