from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.checkpoint.store import latest_checkpoint, load_checkpoint
from trainer.models.loading import load_policy
from trainer.run.cli import load_recipe, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_tiny_recipe_runs_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code = main(
        [
            str(RECIPES / "tiny-smoke.yaml"),
            "--steps",
            "2",
            "--output-dir",
            str(out),
            "--threads",
            "1",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    final = out / "checkpoint-000002"
    assert f"checkpoint: {final}" in captured.out
    assert "checkpoint of step 2" in captured.err  # the console callbacks
    assert latest_checkpoint(out) == final

    # --resume latest continues from step 2 (the transformers engine keeps this one quick).
    code = main([
        str(RECIPES / "tiny-smoke.yaml"), "--steps", "3", "--output-dir", str(out),
        "--resume", "latest", "--engine", "transformers", "--no-progress",
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "resumed from" in captured.err
    assert latest_checkpoint(out) == out / "checkpoint-000003"
    model, _ = load_policy(out / "checkpoint-000003")
    assert load_checkpoint(out / "checkpoint-000003", model, None, None).step == 3


def test_bad_recipe_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(
        "model: tiny-random-llama\n"
        "dataset: {rows: [{prompt: hi}]}\n"
        "graders: [{type: regex, pattern: '7'}]\n"
        "grpo: {learnin_rate: 0.1, group_size: 1}\n"
    )
    assert main([str(recipe), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "grpo.learnin_rate" in err and "grpo.group_size" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("model: [unclosed", "not valid YAML"),
        ("- a list", "must hold a mapping"),
    ],
)
def test_unreadable_recipes_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(content)
    assert main([str(recipe)]) == 2
    assert message in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_steps_override_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(RECIPES / "tiny-smoke.yaml"), "--steps", "0"]) == 2
    assert "grpo.steps" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny-smoke.yaml", "smollm2-arithmetic.yaml"])
def test_recipes_validate(name: str) -> None:
    spec = load_recipe(RECIPES / name)
    assert spec.warnings() == []
    assert spec.dataset.holdout > 0 and spec.eval.max_rows <= spec.dataset.holdout
    if name.startswith("smollm2"):
        assert spec.model == "smollm2-135m-instruct"
        assert spec.dataset.generator is not None and spec.dataset.generator.max_operand == 9
        assert {g.type for g in spec.graders} == {"numeric_match", "regex"}


def test_the_calculator_recipes_differ_only_in_the_tool() -> None:
    tool = load_recipe(RECIPES / "smollm2-calculator-tool.yaml")
    notool = load_recipe(RECIPES / "smollm2-calculator-notool.yaml")
    assert tool.warnings() == [] and notool.warnings() == []
    assert tool.is_agentic and not notool.is_agentic
    assert [t.function.name for t in tool.tools] == ["calculator"] and not notool.tools
    # The same job otherwise: the demonstration answers the same question, with or without the
    # calculator call.
    other = {"name", "tools", "episode", "dataset"}
    assert tool.model_dump(exclude=other) == notool.model_dump(exclude=other)
    assert tool.dataset.model_dump(exclude={"few_shot"}) == notool.dataset.model_dump(
        exclude={"few_shot"}
    )
    assert tool.dataset.few_shot[0] == notool.dataset.few_shot[0]
    assert tool.dataset.few_shot[-1] == notool.dataset.few_shot[-1]
    assert "<tool_call>" in tool.dataset.few_shot[1].content
    for row in tool.dataset.all_rows():
        a, b = str(row.prompt).removeprefix("What is ").split("?")[0].split("*")
        assert 10 <= int(a) <= 999 and 10 <= int(b) <= 999 and row.answer == str(int(a) * int(b))


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_the_calculator_recipes_tool_evaluates_arithmetic_only() -> None:
    from trainer.agents import Toolbox, ToolCall

    box = Toolbox(load_recipe(RECIPES / "smollm2-calculator-tool.yaml").tools, timeout_s=5.0)
    try:
        expressions = ["877*831", "(2+3)*4", "-7/2", 12, "__import__('os')", "2**99"]
        results = box.run([ToolCall("calculator", {"expression": e}) for e in expressions])
    finally:
        box.close()
    assert [r.content for r in results[:4]] == ["728787", "20", "-3.5", "12"]
    assert all(r.error is None for r in results[:4])
    assert all(r.error and "only numbers" in r.error for r in results[4:])


def test_smollm2_recipe_graders_on_typical_answers() -> None:
    from grading.graders import build_graders

    graders = build_graders(load_recipe(RECIPES / "smollm2-arithmetic.yaml").graders)
    totals, per = graders.score(
        ["2 + 3 = 5", "The answer is 5.", "5", "2 + 3 = 6", "Five", "5 is the sum of 2 and 3"],
        [{"answer": "5"}] * 6,
    )
    assert per["numeric"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert per["ends_with_number"] == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # last: ends with 3
    assert totals == pytest.approx([1.1, 1.1, 1.1, 0.1, 0.0, 0.1])


def test_nproc_below_one_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(RECIPES / "tiny-smoke.yaml"), "--nproc", "0"]) == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err


def test_two_ranks_train_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The recipe's vllm engine works in ranks too (two engines; minutes on 2 busy cores): the
    # transformers engine keeps this one quick.
    out = tmp_path / "run"
    code = main([
        str(RECIPES / "tiny-smoke.yaml"), "--steps", "2", "--nproc", "2", "--output-dir",
        str(out), "--threads", "1", "--engine", "transformers", "--no-progress",
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    final = out / "checkpoint-000002"
    assert f"finished step 2; checkpoint: {final}" in captured.out
    assert "checkpoint of step 2" in captured.err  # rank 0's, through the console callbacks
    assert latest_checkpoint(out) == final


def test_ctrl_c_stops_two_ranks_at_a_step_with_a_checkpoint(tmp_path: Path) -> None:
    """Ctrl-C at a terminal signals the whole foreground process group: here, the command
    alone (the agent runs in a session of its own). Its stop request reaches rank 0 through
    should_stop, and the run ends at a step with a checkpoint."""
    from tests.conftest import wait_until
    from tests.trainer.ranks_support import processes_mentioning

    out = tmp_path / "run"
    log_path = tmp_path / "grpo.log"
    root = RECIPES.parent
    with log_path.open("wb") as log:
        command = subprocess.Popen(
            [sys.executable, "-m", "grpo_cli", "train", str(RECIPES / "tiny-smoke.yaml"),
             "--steps", "200", "--nproc", "2", "--output-dir", str(out), "--threads", "1",
             "--engine", "transformers", "--no-progress"],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            # The recipe checkpoints every 5 steps: step 5 is done, rank 0 is mid-run.
            wait_until(
                lambda: "checkpoint of step 5" in log_path.read_text(errors="replace"),
                300,
                "the checkpoint of step 5",
            )
            os.killpg(command.pid, signal.SIGINT)
            code = command.wait(120)
        finally:
            if command.poll() is None:
                os.killpg(command.pid, signal.SIGKILL)
                command.wait(10)
    output = log_path.read_text(errors="replace")
    assert code == 0, output[-3000:]
    stopped = re.search(r"stopped early at step (\d+); checkpoint: (\S+)", output)
    assert stopped is not None, output[-3000:]
    step = int(stopped[1])
    assert 5 <= step < 200
    assert Path(stopped[2]) == out / f"checkpoint-{step:06d}" == latest_checkpoint(out)
    assert processes_mentioning(str(out)) == []
