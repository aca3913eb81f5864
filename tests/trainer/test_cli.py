from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer.checkpoint.store import latest_checkpoint, load_checkpoint
from trainer.models.loading import load_policy
from trainer.run.cli import load_recipe, main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model gains nothing from more, and on a shared 2-core
    machine two spinning OpenMP threads per process made these runs ~50x slower (measured)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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


def test_smollm2_recipe_graders_on_typical_answers() -> None:
    from trainer.graders import build_graders

    graders = build_graders(load_recipe(RECIPES / "smollm2-arithmetic.yaml").graders)
    totals, per = graders.score(
        ["2 + 3 = 5", "The answer is 5.", "5", "2 + 3 = 6", "Five", "5 is the sum of 2 and 3"],
        [{"answer": "5"}] * 6,
    )
    assert per["numeric"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert per["ends_with_number"] == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]  # last: ends with 3
    assert totals == pytest.approx([1.1, 1.1, 1.1, 0.1, 0.0, 0.1])
