"""``train()`` as a library: a plain reward function, graders as objects, a ready model and
tokenizer, a ready rollout engine, and how many sample groups reach ``on_samples``.

Tiny random Llama, transformers engine (one test uses vLLM), a few seconds per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import trainer.rollout.startup as startup_module
import trainer.run.setup as loop_module
from tests.trainer.test_loop import Recorder, tiny_spec
from trainer.models.loading import load_policy, resolve_model
from trainer.rollout.base import Completion, RolloutEngine
from trainer.rollout.registry import make_engine
from trainer.run.loop import train
from trainer.scoring.rewards import RewardFunction, resolve_scorer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8}
# An absolute path (the spec accepts it) where no model exists: loading it would fail.
NO_MODEL = "/nonexistent/grpo-test-model"


def tiny_model() -> tuple[Any, Any]:
    return load_policy(resolve_model("tiny-random-llama"))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that differ (a checkpoint leaves out tied ones: compare the rest)."""
    return [k for k in after if k in before and not torch.equal(before[k], after[k])]


def forbid_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the run loaded a model although one was given")

    monkeypatch.setattr(loop_module, "resolve_model", refuse)
    monkeypatch.setattr(loop_module, "load_policy", refuse)


# --------------------------------------------------------------------------- reward functions


def test_reward_fn_sets_the_reward(tmp_path: Path) -> None:
    calls: list[tuple[list[str], list[dict[str, object]]]] = []

    def quarter(completions: list[str], items: list[dict[str, object]]) -> list[float]:
        calls.append((completions, items))
        return [0.25] * len(completions)

    rows = [{"prompt": f"say {w}", "answer": w} for w in "abcd"]
    spec = tiny_spec(steps=2, grpo=SMALL, dataset={"rows": rows})
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path, reward_fn=quarter)

    assert sorted(rec.metrics) == [1, 2]
    for metrics in rec.metrics.values():
        assert metrics["reward/mean"] == 0.25 and metrics["reward/std"] == 0.0
        assert metrics["reward/quarter/mean"] == 0.25
        assert metrics["frac_zero_std_groups"] == 1.0
        assert "reward/has_seven/mean" not in metrics  # the spec's graders were not used
    # One call per step with the whole batch; each group's G completions share one answer.
    assert len(calls) == 2
    for completions, items in calls:
        answers = [item["answer"] for item in items]
        assert len(completions) == len(answers) == 16
        assert all(len(set(answers[i : i + 4])) == 1 for i in range(0, 16, 4))
        assert set(answers) <= set("abcd")
        # Each item is its row, as the dataset gave it.
        assert all(
            item == {"prompt": f"say {item['answer']}", "answer": item["answer"]} for item in items
        )
    for samples in rec.samples.values():
        for group in samples:
            assert group.answer in set("abcd")
            for c in group.completions:
                assert c.reward == 0.25 and c.rewards == {"quarter": 0.25} and c.advantage == 0.0


def test_reward_fn_drives_the_update(tmp_path: Path) -> None:
    def length_reward(completions: list[str], items: list[dict[str, object]]) -> list[float]:
        return [len(c) / 8 for c in completions]

    spec = tiny_spec(steps=2, grpo=SMALL)
    rec = Recorder()
    result = train(spec, rec, output_dir=tmp_path, reward_fn=length_reward, sample_groups=4)

    for step, metrics in rec.metrics.items():
        # All 4 groups are samples: the step's reward is the mean of the function's values.
        texts = [c.text for group in rec.samples[step] for c in group.completions]
        expected = sum(len(t) / 8 for t in texts) / len(texts)
        assert metrics["reward/mean"] == pytest.approx(expected, abs=1e-12)
        assert metrics["reward/length_reward/mean"] == pytest.approx(expected, abs=1e-12)
        assert metrics["frac_zero_std_groups"] < 1.0
        for group in rec.samples[step]:
            for c in group.completions:
                assert c.reward == len(c.text) / 8
    # The rewards varied, so the weights moved away from the packaged model's.
    assert result.checkpoint_path is not None
    trained = load_file(str(result.checkpoint_path / "model.safetensors"))
    base, _ = tiny_model()
    assert changed(snapshot(base), trained)


def test_reward_function_checks_what_it_returns() -> None:
    def short(completions: list[str], items: list[dict[str, object]]) -> list[float]:
        return [1.0]

    def nan(completions: list[str], items: list[dict[str, object]]) -> list[float]:
        return [float("nan")] * len(completions)

    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        RewardFunction(short).score(["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="non-finite"):
        RewardFunction(nan).score(["a"], [{}])
    assert RewardFunction(lambda c, a: [0.0] * len(c)).names == ["reward_fn"]
    assert RewardFunction(short, name="mine", max_total=1.0).max_total == 1.0
    with pytest.raises(ValueError, match="must match"):
        RewardFunction(short, name="Bad Name")
    with pytest.raises(ValueError, match="not both"):
        resolve_scorer(RewardFunction(short), short, [])


# --------------------------------------------------------------------------- a ready model


def test_ready_model_is_trained_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = tiny_model()
    before = snapshot(model)
    forbid_loading(monkeypatch)
    spec = tiny_spec(
        steps=2, grpo={**SMALL, "kl": {"estimator": "k3", "beta": 0.1}}, model=NO_MODEL
    )
    rec = Recorder()
    result = train(spec, rec, output_dir=tmp_path, model=model, tokenizer=tokenizer)

    assert result.final_step == 2
    assert rec.info is not None and rec.info.model_path is None
    after = snapshot(model)
    assert changed(before, after), "the given model object was not trained"
    # The reference is a frozen copy of the model as given: no KL at step 1, some at step 2.
    assert rec.metrics[1]["kl_k3"] < 1e-6 < rec.metrics[2]["kl_k3"]
    # The engine generated with that very object, and the checkpoint holds its weights.
    assert all(m["logprob_diff/engine_vs_trainer"] < 1e-4 for m in rec.metrics.values())
    assert result.checkpoint_path is not None
    saved = load_file(str(result.checkpoint_path / "model.safetensors"))
    assert all(torch.equal(saved[k], after[k]) for k in saved)


class CountingEngine:
    """A caller's engine: wraps a real one and counts what the run does with it."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def generate(self, prompts: list[list[int]], n: int, **kw: Any) -> list[list[Completion]]:
        self.calls.append("generate")
        return self.inner.generate(prompts, n, **kw)

    def sync_weights(self, model: torch.nn.Module) -> float:
        self.calls.append("sync")
        return self.inner.sync_weights(model)

    def close(self) -> None:
        self.calls.append("close")


def test_given_engine_is_used_synced_and_left_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny_model()
    inner = make_engine(
        "transformers",
        Path(NO_MODEL),
        tokenizer,
        dtype="float32",
        max_model_len=64,
        policy_model=model,
    )
    engine = CountingEngine(inner)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the run built an engine although one was given")

    monkeypatch.setattr(startup_module, "make_engine", refuse)
    forbid_loading(monkeypatch)
    spec = tiny_spec(steps=2, grpo=SMALL, model=NO_MODEL)
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path, model=model, tokenizer=tokenizer, engine=engine)

    # Weights pushed before the first rollout and after each step's update; never closed.
    assert engine.calls == ["sync", "generate", "sync", "generate", "sync"]
    assert rec.info is not None and rec.info.engine == "CountingEngine"
    assert any(kind == "engine" and "CountingEngine" in msg for kind, _, msg in rec.events)


# --------------------------------------------------------------------------- graders, samples


@dataclass(frozen=True)
class Contains:
    """A grader object (the ``grading.graders.Grader`` protocol), not a spec."""

    name: str
    weight: float
    text: str

    def __call__(self, completion: str, answer: str | None) -> float:
        return float(self.text in completion)


@pytest.mark.parametrize("groups", [3, 0])
def test_sample_groups_and_grader_objects(tmp_path: Path, groups: int) -> None:
    spec = tiny_spec(steps=2, grpo=SMALL)
    rec = Recorder()
    graders = [Contains("has_a", 1.0, "a"), Contains("has_e", 0.5, "e")]
    train(spec, rec, output_dir=tmp_path, graders=graders, sample_groups=groups)

    assert sorted(rec.samples) == [1, 2]
    assert all(len(samples) == groups for samples in rec.samples.values())
    for samples in rec.samples.values():
        for c in (c for group in samples for c in group.completions):
            assert c.rewards == {"has_a": float("a" in c.text), "has_e": float("e" in c.text)}
            assert c.reward == c.rewards["has_a"] + 0.5 * c.rewards["has_e"]
    for metrics in rec.metrics.values():
        assert {"reward/has_a/mean", "reward/has_e/mean"} <= set(metrics)
        assert "reward/has_seven/mean" not in metrics


def test_bad_arguments_fail_before_any_work(tmp_path: Path) -> None:
    spec = tiny_spec(steps=1)
    model, tokenizer = tiny_model()
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="model and tokenizer together"):
        train(spec, output_dir=out, model=model)
    with pytest.raises(ValueError, match="model and tokenizer together"):
        train(spec, output_dir=out, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="not both"):
        train(
            spec,
            output_dir=out,
            graders=[Contains("x", 1, "x")],
            reward_fn=lambda c, a: [0.0] * len(c),
        )
    with pytest.raises(ValueError, match="sample_groups"):
        train(spec, output_dir=out, sample_groups=-1)
    assert not out.exists()


# --------------------------------------------------------------------------- vLLM


def test_vllm_engine_loads_a_ready_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM loads folders: a ready model is saved for it, and the engine samples with THAT
    model's weights (perturbed here, so the packaged weights would show a large logprob gap)."""
    model, tokenizer = tiny_model()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    forbid_loading(monkeypatch)
    staged: list[Path] = []

    class SeesStaging(Recorder):
        def on_start(self, info: Any) -> None:
            super().on_start(info)
            staged.extend(tmp_path.glob(f"{startup_module.STAGED_PREFIX}*"))

    spec = tiny_spec(
        steps=2, grpo=SMALL, model=NO_MODEL, rollout={"engine": "vllm", "dtype": "float32"}
    )
    rec = SeesStaging()
    train(spec, rec, output_dir=tmp_path, model=model, tokenizer=tokenizer)

    # The staged folder existed while the run was on, and is gone after it.
    assert len(staged) == 1 and not staged[0].exists()
    diffs = [rec.metrics[s]["logprob_diff/engine_vs_trainer"] for s in (1, 2)]
    assert all(d < 1e-3 for d in diffs), diffs
