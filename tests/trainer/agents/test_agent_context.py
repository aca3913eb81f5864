"""An agent job on a model whose context is shorter than ``episode.max_episode_tokens`` (the
default 4096; the packaged tiny model has 1024) runs with episodes cut at the model's context
and a warning that says so, instead of a vLLM traceback at engine start (issue 32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.agent_jobs import CALCULATOR
from trainer.checkpoint.store import latest_checkpoint
from trainer.run.cli import main

pytest.importorskip("vllm")  # GPU test machines carry no vLLM build

pytestmark = pytest.mark.model

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def test_the_tiny_smoke_recipe_with_a_tool_runs_within_the_models_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = yaml.safe_load((RECIPES / "tiny-smoke.yaml").read_text())
    recipe["tools"] = [CALCULATOR]  # episode.max_episode_tokens: its default, 4096
    recipe["grpo"] |= {"steps": 1, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4}
    recipe["eval"] = {"interval": 0}
    path = tmp_path / "tool.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    code = main([str(path), "--output-dir", str(out), "--threads", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    warning = (
        "[warning] config: episode.max_episode_tokens is 4096, but the model's context is 1024 "
        "tokens: episodes end at 1024 tokens (end reason max_episode_tokens)"
    )
    assert warning in captured.err.splitlines()
    final = latest_checkpoint(out)
    assert final is not None
    metrics = json.loads((final / "manifest.json").read_text())["extra"]["metrics"]
    assert metrics["episode/turns"] >= 1.0
