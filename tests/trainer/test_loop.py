"""The training loop on the tiny random Llama (transformers engine unless a test says vllm).

The toy task: the reward is 1 when the completion contains the digit 7. The untrained model
writes one in ~30% of its 16-character completions; GRPO drives that to ~100% in a few steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import trainer.rollout.startup as startup_module
from jobspec import JobSpec
from trainer.checkpoint.store import RETENTION_METRIC
from trainer.data.dataset import PromptsTooLong
from trainer.errors import NonFiniteLossError, TrainerError
from trainer.rollout.base import Completion, RolloutEngine
from trainer.rollout.registry import make_engine
from trainer.run.callbacks import Callbacks, RolloutSample, RunInfo
from trainer.run.loop import train
from trainer.update import losses
from trainer.update.inputs import Advantages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CATALOG = {
    "reward/mean", "reward/std", "reward/has_seven/mean", "frac_zero_std_groups",
    "advantage/abs_mean", "entropy", "loss/policy", "loss/kl",
    "grad_norm", "lr", "completion_len/mean", "completion_len/max", "truncated_frac",
    "time/rollout", "time/reward", "time/logprobs", "time/update", "time/weight_sync",
    "time/step", "tokens_per_s/rollout", "logprob_diff/engine_vs_trainer",
    "reward/has_seven/errors", "reward/errors", "reward/timeouts", "data/skipped_prompts",
    "mismatch/kl", "mismatch/ratio_mean", "mismatch/ratio_max", "mismatch/capped_frac",
    "mismatch/token_mult_prob_error", "tokens/trained", "update/skipped",
}  # fmt: skip
# Absent from a step whose update was skipped for want of signal (update/skipped 1): every
# advantage 0 and no loss-side term, so no update ran and nothing was scored for it.
UPDATE_METRICS = {
    "advantage/abs_mean", "entropy", "loss/policy", "loss/kl", "grad_norm",
    "logprob_diff/engine_vs_trainer", "mismatch/kl", "mismatch/ratio_mean",
    "mismatch/ratio_max", "mismatch/capped_frac", "mismatch/token_mult_prob_error",
    "tokens/trained", "kl", "kl_k3",
}  # fmt: skip
# Reported only when a step has an update after its first (several iterations or minibatches):
# the first runs at ratio 1 and cannot clip.
CLIP_FRACTIONS = {"clip_frac/low", "clip_frac/high", "clip_frac/dual", "clip_frac/clamped"}


def tiny_spec(*, steps: int = 6, grpo: dict[str, Any] | None = None, **top: Any) -> JobSpec:
    data: dict[str, Any] = {
        "model": "tiny-random-llama",
        "dataset": {"rows": [{"prompt": f"say {w}"} for w in "abcdefgh"]},
        "graders": [{"type": "regex", "name": "has_seven", "pattern": "7"}],
        "grpo": {
            "steps": steps,
            "prompts_per_step": 8,
            "group_size": 8,
            "max_new_tokens": 16,
            "max_prompt_tokens": 32,
            "learning_rate": 1e-3,
            "micro_batch_size": 64,
            **(grpo or {}),
        },
        "rollout": {"engine": "transformers"},
        "checkpoint_interval": 0,
        "seed": 0,
    }
    data.update(top)
    return JobSpec.model_validate(data)


class Recorder(Callbacks):
    def __init__(self, stop_after: int | None = None) -> None:
        self.info: RunInfo | None = None
        self.metrics: dict[int, dict[str, float]] = {}
        self.events: list[tuple[str, str, str]] = []
        self.samples: dict[int, list[RolloutSample]] = {}
        self.checkpoints: list[tuple[int, Path]] = []
        self.params: dict[int, torch.Tensor] = {}
        self.stop_after = stop_after
        self.model: torch.nn.Module | None = None

    def on_start(self, info: RunInfo) -> None:
        self.info = info

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = metrics

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        self.events.append((kind, level, message))

    def on_samples(self, step: int, samples: list[RolloutSample]) -> None:
        self.samples[step] = samples

    def on_checkpoint(self, step: int, path: Path) -> None:
        assert path.is_dir() and (path / "manifest.json").is_file()  # after the rename
        self.checkpoints.append((step, path))

    def should_stop(self) -> bool:
        return self.stop_after is not None and max(self.metrics, default=0) >= self.stop_after

    def rewards(self) -> list[float]:
        return [self.metrics[s]["reward/mean"] for s in sorted(self.metrics)]


# --------------------------------------------------------------------------- learning


@pytest.mark.parametrize(
    ("estimator", "beta", "placement"),
    [
        ("k3", 0.0, "loss"),  # beta 0: no reference model at all
        ("k1", 0.1, "reward"),  # k1 has no gradient in the loss; it belongs in the reward
        ("k2", 0.1, "loss"),
        ("k3", 0.1, "loss"),
        ("k3_unbiased", 0.1, "loss"),
        ("k1_causal", 0.1, "loss"),  # the KL still to come, summed over each row's own tokens
    ],
)
def test_learns_the_toy_task(tmp_path: Path, estimator: str, beta: float, placement: str) -> None:
    spec = tiny_spec(grpo={"kl": {"estimator": estimator, "beta": beta, "placement": placement}})
    rec = Recorder()
    result = train(spec, rec, output_dir=tmp_path)

    rewards = rec.rewards()
    assert len(rewards) == 6 and result.final_step == 6 and not result.stopped_early
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.25, rewards
    assert last > 0.8, rewards

    for step, metrics in rec.metrics.items():
        expected = set(CATALOG)
        if beta > 0:
            expected |= {"kl", "kl_k3"}
        if beta > 0 and placement == "reward":
            expected |= {"kl/reward_penalty"}
        if metrics["update/skipped"]:
            expected -= UPDATE_METRICS
        assert set(metrics) == expected, (step, set(metrics) ^ expected)
        assert all(math.isfinite(v) for v in metrics.values())
        # Same model object generates and trains: the logprobs agree to float noise.
        assert metrics.get("logprob_diff/engine_vs_trainer", 0.0) < 1e-4
    if beta > 0:
        # The policy moves away from the reference, which the KL metrics see.
        assert rec.metrics[1]["kl_k3"] < 1e-6 < rec.metrics[6]["kl_k3"]
        loss_kl = [m["loss/kl"] for m in rec.metrics.values()]
        assert (max(loss_kl) > 0) == (placement == "loss")
    assert result.checkpoint_path == tmp_path / "checkpoint-000006"
    assert rec.checkpoints == [(6, tmp_path / "checkpoint-000006")]


def test_feature_combination_learns(tmp_path: Path) -> None:
    """Several updates per batch (old-logprob pass, clipping), minibatches with micro-batches,
    dynamic sampling, overlong shaping, Dr. GRPO aggregation, a warmup+cosine schedule, and a
    held-out evaluation."""
    spec = tiny_spec(
        steps=6,
        grpo={
            "num_iterations": 2,
            "mini_batch_size": 32,
            "micro_batch_size": 12,
            "dynamic_sampling": {"enabled": True, "max_rounds": 2},
            "overlong": {"enabled": True, "cache_tokens": 4, "penalty": 0.1},
            "loss_aggregation": "seq_mean_token_sum_norm",
            "advantage_scale": "batch",
            "lr_schedule": "cosine",
            "warmup_steps": 1,
            "learning_rate": 2e-3,
            "kl": {"estimator": "k3_unbiased", "beta": 0.05},
        },
        dataset={"rows": [{"prompt": f"say {w}"} for w in "abcdefghij"], "holdout": 2},
        eval={"interval": 3},
    )
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path)
    rewards = rec.rewards()
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards
    assert [s for s in rec.metrics if "eval/accuracy" in rec.metrics[s]] == [3, 6]
    lrs = [rec.metrics[s]["lr"] for s in sorted(rec.metrics)]
    assert lrs[0] == pytest.approx(2e-3) and lrs == sorted(lrs, reverse=True) and lrs[-1] > 0
    assert any(m["clip_frac/low"] + m["clip_frac/high"] > 0 for m in rec.metrics.values())
    assert all(set(m) >= CLIP_FRACTIONS for m in rec.metrics.values())
    assert all(m["time/logprobs"] > 0 for m in rec.metrics.values())
    # With dynamic sampling, the groups trained on have a learning signal.
    for step, samples in rec.samples.items():
        assert 1 <= len(samples) <= 2
        for group in samples:
            assert len(group.completions) == 8
            if len({c.reward for c in group.completions}) > 1:
                assert any(c.advantage != 0 for c in group.completions), step


def test_micro_batching_does_not_change_the_update(tmp_path: Path) -> None:
    """Gradient accumulation over micro-batches with global token counts equals one pass."""
    results = []
    for micro in (32, 5):  # 5: uneven micro-batches
        rec = Recorder()
        spec = tiny_spec(
            steps=2,
            grpo={
                "prompts_per_step": 4,
                "max_new_tokens": 12,
                "micro_batch_size": micro,
                "kl": {"estimator": "k3", "beta": 0.1},
            },
        )
        train(spec, rec, output_dir=tmp_path / str(micro))
        results.append(rec.metrics)
    for step in (1, 2):
        for key in ("loss/policy", "loss/kl", "grad_norm", "reward/mean", "kl"):
            assert results[0][step][key] == pytest.approx(results[1][step][key], abs=1e-5)


# --------------------------------------------------------------------------- resume


class RecordingEngine:
    """Wraps a real engine and keeps the token ids of every sampled (non-greedy) call."""

    def __init__(self, inner: RolloutEngine, log: list[list[list[int]]]) -> None:
        self.inner = inner
        self.log = log

    def generate(self, prompts: list[list[int]], n: int, **kw: Any) -> list[list[Completion]]:
        out = self.inner.generate(prompts, n, **kw)
        if not kw.get("greedy"):
            self.log.append([c.token_ids for group in out for c in group])
        return out

    def sync_weights(self, model: torch.nn.Module) -> float:
        return self.inner.sync_weights(model)

    def close(self) -> None:
        self.inner.close()


def _recording(monkeypatch: pytest.MonkeyPatch, log: list[list[list[int]]]) -> None:
    def make(*args: Any, **kwargs: Any) -> RecordingEngine:
        return RecordingEngine(make_engine(*args, **kwargs), log)

    monkeypatch.setattr(startup_module, "make_engine", make)


def test_resume_reproduces_the_straight_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tiny_spec(
        steps=4,
        grpo={
            "prompts_per_step": 4,
            "group_size": 4,
            "max_new_tokens": 12,
            "num_iterations": 2,
            "mini_batch_size": 8,
            "lr_schedule": "cosine",
            "warmup_steps": 1,
            "kl": {"estimator": "k3_unbiased", "beta": 0.1},
        },
        dataset={"rows": [{"prompt": f"say {w}"} for w in "abcdef"]},  # epochs cross mid-step
    )
    straight_tokens: list[list[list[int]]] = []
    _recording(monkeypatch, straight_tokens)
    straight = Recorder()
    train(spec, straight, output_dir=tmp_path / "straight")

    resumed_tokens: list[list[list[int]]] = []
    _recording(monkeypatch, resumed_tokens)
    first = Recorder(stop_after=2)
    half = train(spec, first, output_dir=tmp_path / "resumed")
    assert half.stopped_early and half.final_step == 2
    assert half.checkpoint_path == tmp_path / "resumed" / "checkpoint-000002"
    second = Recorder()
    result = train(spec, second, output_dir=tmp_path / "resumed", resume_from=half.checkpoint_path)
    assert second.info is not None and second.info.start_step == 2
    assert sorted(second.metrics) == [3, 4] and result.final_step == 4
    assert any(kind == "resume" for kind, _, _ in second.events)

    assert len(straight_tokens) == len(resumed_tokens) == 4
    for step, (a, b) in enumerate(zip(straight_tokens, resumed_tokens, strict=True), start=1):
        assert a == b, f"different samples at step {step}"
    resumed_metrics = {**first.metrics, **second.metrics}
    for step in range(1, 5):
        for key, value in straight.metrics[step].items():
            if key.startswith(("time/", "tokens_per_s")):
                continue
            assert resumed_metrics[step][key] == pytest.approx(value, abs=1e-5), (step, key)


def test_library_runs_keep_the_checkpoints_the_spec_keeps_across_a_resume(tmp_path: Path) -> None:
    """`grpo train` (no service) prunes its own folder by the spec's checkpoint section; the
    value a checkpoint ranks by is the metric's latest at or before its step, carried over a
    resume (step 5's value is the evaluation of step 3, made before the stop)."""
    spec = tiny_spec(
        steps=7,
        grpo={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8},
        dataset={"rows": [{"prompt": f"say {w}"} for w in "abcdefghijkl"], "holdout": 4},
        eval={"interval": 3, "max_rows": 4},
        checkpoint_interval=1,
        checkpoint={"keep_last": 2, "keep_best_by": "eval/accuracy"},
    )
    recorded: dict[int, object] = {}

    class ManifestRecorder(Recorder):
        def on_checkpoint(self, step: int, path: Path) -> None:
            super().on_checkpoint(step, path)
            manifest = json.loads((path / "manifest.json").read_text())
            recorded[step] = manifest["extra"][RETENTION_METRIC]

    first = ManifestRecorder(stop_after=4)
    half = train(spec, first, output_dir=tmp_path)
    assert half.final_step == 4 and half.checkpoint_path == tmp_path / "checkpoint-000004"
    second = ManifestRecorder()
    train(spec, second, output_dir=tmp_path, resume_from=half.checkpoint_path)
    metrics = {**first.metrics, **second.metrics}
    assert sorted(s for s, m in metrics.items() if "eval/accuracy" in m) == [3, 6, 7]
    seen: list[tuple[int, float | None]] = []
    latest: float | None = None
    for step in range(1, 8):
        latest = metrics[step].get("eval/accuracy", latest)
        seen.append((step, latest))
    assert recorded == {s: {"name": "eval/accuracy", "value": v} for s, v in seen}
    assert recorded[5] == recorded[3] and recorded[1] == {"name": "eval/accuracy", "value": None}
    expected = spec.checkpoint.kept_steps(seen)
    assert {6, 7} <= expected and len(expected) <= 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"checkpoint-{s:06d}" for s in sorted(expected)
    ]
    # A receiver that applies the retention itself (the service's worker): nothing is deleted.
    service = Recorder()
    service.applies_retention = True
    train(
        spec.model_copy(update={"grpo": spec.grpo.model_copy(update={"steps": 3})}),
        service,
        output_dir=tmp_path / "service",
    )
    assert [s for s, _ in service.checkpoints] == [1, 2, 3]
    assert len(list((tmp_path / "service").glob("checkpoint-*"))) == 3


# --------------------------------------------------------------------------- failures, cancel


def test_non_finite_updates_are_skipped_then_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = losses.clipped_surrogate
    calls = {"n": 0}

    def poisoned(*args: Any, **kwargs: Any) -> losses.SurrogateResult:
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:  # step 1 trains normally, every later update is NaN
            return out
        return out._replace(per_token_loss=out.per_token_loss * float("nan"))

    monkeypatch.setattr(losses, "clipped_surrogate", poisoned)
    spec = tiny_spec(steps=6, grpo={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8})

    class Snapshots(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.weights: dict[int, dict[str, torch.Tensor]] = {}

    rec = Snapshots()

    def make(*args: Any, **kwargs: Any) -> RolloutEngine:
        policy = kwargs["policy_model"]
        engine = make_engine(*args, **kwargs)

        class Spy(RecordingEngine):
            def generate(self, prompts: list[list[int]], n: int, **kw: Any) -> Any:
                step = len(rec.metrics) + 1
                rec.weights[step] = {k: v.clone() for k, v in policy.state_dict().items()}
                return super().generate(prompts, n, **kw)

        return Spy(engine, [])

    monkeypatch.setattr(startup_module, "make_engine", make)
    with pytest.raises(NonFiniteLossError) as info:
        train(spec, rec, output_dir=tmp_path)
    assert isinstance(info.value, TrainerError) and info.value.reason == "non_finite_loss"
    # Steps that ran an update (a step whose batch has no signal runs none, and cannot be
    # non-finite): step 1, then two non-finite ones; the next update, the 3rd non-finite, is
    # fatal and its step reports nothing.
    updated = [s for s, m in sorted(rec.metrics.items()) if not m["update/skipped"]]
    assert updated[0] == 1 and len(updated) == 3, rec.metrics
    assert [kind for kind, _, _ in rec.events].count("non_finite") == 3
    # Step 1 changed the weights; the skipped updates after it did not.
    w = rec.weights
    last = max(w)
    assert any(not torch.equal(w[1][k], w[2][k]) for k in w[1])
    assert all(torch.equal(w[2][k], w[s][k]) for s in range(3, last + 1) for k in w[2])
    assert "grad_norm" in rec.metrics[1] and "grad_norm" not in rec.metrics[2]
    assert not list(tmp_path.glob("checkpoint-*"))


def test_should_stop_stops_after_the_step_with_a_checkpoint(tmp_path: Path) -> None:
    spec = tiny_spec(steps=5, grpo={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8})
    rec = Recorder(stop_after=2)
    result = train(spec, rec, output_dir=tmp_path)
    assert result.stopped_early and result.final_step == 2
    assert sorted(rec.metrics) == [1, 2]
    assert rec.checkpoints == [(2, tmp_path / "checkpoint-000002")]
    assert result.checkpoint_path == tmp_path / "checkpoint-000002"
    assert result.last_metrics == rec.metrics[2]
    # on_samples: a bounded few groups per step, each with the graded completions.
    assert sorted(rec.samples) == [1, 2]
    for samples in rec.samples.values():
        assert len(samples) == 2
        for group in samples:
            assert group.prompt.startswith("say ") and group.answer is None
            assert len(group.completions) == 4
            assert sum(c.advantage for c in group.completions) == pytest.approx(0, abs=1e-5)
            for c in group.completions:
                assert c.reward == c.rewards["has_seven"] == float("7" in c.text)
                assert 1 <= c.num_tokens <= 8 and c.finish_reason in {"stop", "length"}
                assert c.transcript is None  # a single completion has no episode turns


def test_dynamic_sampling_without_signal_skips_the_update(tmp_path: Path) -> None:
    # Every completion gets the same reward: no group carries a learning signal.
    spec = tiny_spec(
        steps=2,
        grpo={
            "prompts_per_step": 4,
            "group_size": 4,
            "max_new_tokens": 4,
            "dynamic_sampling": {"enabled": True, "max_rounds": 3},
            "lr_schedule": "linear",
            "warmup_steps": 2,
            "learning_rate": 1e-3,
        },
        graders=[{"type": "length", "max_chars": 1000}],
    )
    rec = Recorder()
    result = train(spec, rec, output_dir=tmp_path)
    assert result.final_step == 2
    # Nothing trained, so the warmup did not move: both steps report its first rate.
    assert rec.metrics[1]["lr"] == rec.metrics[2]["lr"] == pytest.approx(5e-4)
    kinds = [kind for kind, _, _ in rec.events]
    assert kinds.count("dynamic_sampling") == 2 and kinds.count("no_signal") == 2
    for metrics in rec.metrics.values():
        assert metrics["frac_zero_std_groups"] == 1.0 and metrics["reward/mean"] == 1.0
        assert "loss/policy" not in metrics and "grad_norm" not in metrics
        assert metrics["time/weight_sync"] == 0.0
    # Each step tried all 3 rounds to find a signal; with nothing kept, the later rounds drew
    # oversample (2) times the shortfall: 4 + 8 + 8 prompts.
    for metrics in rec.metrics.values():
        assert metrics["dynamic_sampling/rounds"] == 3
        assert metrics["dynamic_sampling/dropped_groups"] == 20
        assert metrics["dynamic_sampling/kept_groups"] == 0
    messages = [m for kind, _, m in rec.events if kind == "dynamic_sampling"]
    assert all("dropped 20 of 20 groups" in m and "3 sampling rounds" in m for m in messages)
    assert all(len(s) == 2 for s in rec.samples.values())


def test_dynamic_sampling_keeps_the_kl_acting_on_the_groups_it_drops(tmp_path: Path) -> None:
    """Step 1's rewards differ within every group and it trains; from step 2 on every group is
    flat, so dynamic sampling leaves the task's update nothing. The KL in the reward still acts
    on every sampled completion (its expected pull is then the one without dynamic sampling,
    tests/trainer/update/test_kl_exact.py), so step 2 updates, pulling back toward the
    reference. Before, the dropped groups took the KL with them and step 2 was skipped."""
    spec = tiny_spec(
        steps=2,
        grpo={
            "prompts_per_step": 2,
            "group_size": 4,
            "max_new_tokens": 4,
            "dynamic_sampling": {"enabled": True, "max_rounds": 1},
            "kl": {"beta": 0.5, "placement": "reward", "estimator": "k1"},
            "learning_rate": 1e-2,
        },
    )
    rec = Recorder()

    def alternating_then_flat(texts: list[str], items: list[Any]) -> list[float]:
        if rec.metrics:  # step 1 is over
            return [1.0] * len(texts)
        return [float(i % 2) for i in range(len(texts))]

    train(spec, rec, output_dir=tmp_path, reward_fn=alternating_then_flat)
    first, second = rec.metrics[1], rec.metrics[2]
    assert first["dynamic_sampling/kept_groups"] == 2 and first["update/skipped"] == 0.0
    assert "dynamic_sampling/kl_only_groups" not in first  # nothing dropped
    assert second["dynamic_sampling/kept_groups"] == 0
    assert second["dynamic_sampling/dropped_groups"] == 2
    assert second["dynamic_sampling/kl_only_groups"] == 2
    assert second["update/skipped"] == 0.0 and second["grad_norm"] > 0
    assert second["kl/reward_penalty"] != 0.0  # step 1 moved the policy off the reference


class _SyncCounter(RecordingEngine):
    """Counts weight syncs and snapshots the policy's weights before each rollout, by step."""

    def __init__(self, inner: RolloutEngine, policy: torch.nn.Module, rec: Recorder) -> None:
        super().__init__(inner, [])
        self.policy, self.rec = policy, rec
        self.syncs = 0
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def generate(self, prompts: list[list[int]], n: int, **kw: Any) -> Any:
        step = len(self.rec.metrics) + 1
        self.weights[step] = {k: v.clone() for k, v in self.policy.state_dict().items()}
        return super().generate(prompts, n, **kw)

    def sync_weights(self, model: torch.nn.Module) -> float:
        self.syncs += 1
        return super().sync_weights(model)


def _counting(monkeypatch: pytest.MonkeyPatch, rec: Recorder) -> list[_SyncCounter]:
    engines: list[_SyncCounter] = []

    def make(*args: Any, **kwargs: Any) -> RolloutEngine:
        engines.append(_SyncCounter(make_engine(*args, **kwargs), kwargs["policy_model"], rec))
        return engines[-1]

    monkeypatch.setattr(startup_module, "make_engine", make)
    return engines


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_batch_without_signal_moves_no_weight_no_schedule_and_no_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every completion gets the same reward and no KL is in the loss: every advantage is 0.
    Before the fix AdamW's weight decay still moved every weight, the warmup advanced and the
    engine was re-synced each step; the batch was also scored for nothing."""
    import trainer.run.step_update as step_update

    spec = tiny_spec(
        steps=3,
        grpo={
            "prompts_per_step": 2,
            "group_size": 4,
            "max_new_tokens": 4,
            "lr_schedule": "linear",
            "warmup_steps": 2,
            "weight_decay": 0.1,
            "num_iterations": 2,  # an old-logprob pass would be due before the update
        },
        graders=[{"type": "length", "max_chars": 1000}],
    )
    scoring_passes: list[int] = []
    real_score = step_update.score_logprobs

    def counted(*args: Any, **kwargs: Any) -> Any:
        scoring_passes.append(1)
        return real_score(*args, **kwargs)

    monkeypatch.setattr(step_update, "score_logprobs", counted)
    rec = Recorder()
    engines = _counting(monkeypatch, rec)
    train(spec, rec, output_dir=tmp_path)
    (engine,) = engines
    assert [m["update/skipped"] for m in rec.metrics.values()] == [1.0, 1.0, 1.0]
    assert engine.syncs == 0
    # Without KL in the reward the advantages need no log-probabilities: no scoring pass ran.
    assert scoring_passes == []
    assert _same(engine.weights[1], engine.weights[3])
    final = rec.metrics[3]
    assert final["lr"] == rec.metrics[1]["lr"] == pytest.approx(5e-4)  # the warmup waited
    assert "loss/policy" not in final and "grad_norm" not in final
    assert final["time/weight_sync"] == 0.0


def test_momentum_does_not_carry_a_step_without_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 trains; step 2's advantages are all 0. Before the fix AdamW's momentum moved
    every weight again at step 2 (about 77% of step 1's move)."""
    import trainer.run.step_update as step_update

    calls = {"n": 0}
    real = step_update.split_advantages

    def second_step_flat(*args: Any, **kwargs: Any) -> Advantages:
        calls["n"] += 1
        adv = real(*args, **kwargs)
        return Advantages(torch.zeros_like(adv.total), None) if calls["n"] == 2 else adv

    monkeypatch.setattr(step_update, "split_advantages", second_step_flat)
    spec = tiny_spec(steps=3, grpo={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8})
    rec = Recorder()
    engines = _counting(monkeypatch, rec)
    train(spec, rec, output_dir=tmp_path)
    (engine,) = engines
    w = engine.weights
    assert [rec.metrics[s]["update/skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert not _same(w[1], w[2])  # step 1 trained
    assert _same(w[2], w[3])  # step 2 did not move a weight
    assert engine.syncs == 2  # after steps 1 and 3


def test_prompts_over_the_limit_are_skipped_and_reported_by_row(tmp_path: Path) -> None:
    long = "what is " + "1+" * 20 + "1?"  # 50 characters: over 32 tokens once formatted
    prompts = ["say a", long, "say b", "say c", long, "say d", long, "say e"]
    spec = tiny_spec(
        steps=1,
        grpo={"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 4},
        dataset={"rows": [{"prompt": p, "answer": "7"} for p in prompts], "holdout": 2},
        eval={"interval": 1},
    )
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path)
    (event,) = [(level, m) for kind, level, m in rec.events if kind == "dataset"]
    assert event[0] == "warning"
    assert "skipped 3 dataset rows" in event[1] and "max_prompt_tokens (32;" in event[1]
    assert event[1].endswith("rows 2, 5, 7")  # the 7th is a held-out row
    assert rec.metrics[1]["data/skipped_prompts"] == 3.0
    assert {g.prompt for g in rec.samples[1]} <= {"say a", "say b", "say c", "say d"}
    evals = [m for kind, _, m in rec.events if kind == "eval"]
    assert evals and all(m.endswith("on 1 rows") for m in evals)


def test_no_prompt_within_the_limit_fails_clearly(tmp_path: Path) -> None:
    spec = tiny_spec(
        dataset={"rows": [{"prompt": "say something long"}]}, grpo={"max_prompt_tokens": 8}
    )
    with pytest.raises(PromptsTooLong, match=r"max_prompt_tokens \(8 tokens; the longest has"):
        train(spec, Recorder(), output_dir=tmp_path)


def test_file_dataset_must_be_resolved(tmp_path: Path) -> None:
    spec = tiny_spec(dataset={"file_id": "file_123"})
    with pytest.raises(ValueError, match="resolved into rows"):
        train(spec, Recorder(), output_dir=tmp_path)


# --------------------------------------------------------------------------- vLLM


def test_vllm_engine_gets_the_trained_weights(tmp_path: Path) -> None:
    """The engine generates with the weights of the last update: its logprobs of the sampled
    tokens match the trainer's (float32 engine) at every step, also after weights changed."""
    spec = tiny_spec(steps=3, rollout={"engine": "vllm", "dtype": "float32"})
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path)
    diffs = [rec.metrics[s]["logprob_diff/engine_vs_trainer"] for s in (1, 2, 3)]
    assert all(d < 1e-3 for d in diffs), diffs
    assert rec.metrics[2]["time/weight_sync"] > 0
    # The tiny model's KV cache fits the batch: megabytes, not the gigabytes of a fixed size.
    engine_events = [m for kind, _, m in rec.events if kind == "engine"]
    assert len(engine_events) == 1 and "MiB KV cache (sized to the batch)" in engine_events[0]
    assert float(engine_events[0].split(" MiB")[0].split()[-1].replace(",", "")) < 64


# --------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_smollm2_recipe_runs_two_steps(tmp_path: Path) -> None:
    """The real recipe for two steps: about 3 minutes on an otherwise idle 2-core CPU (start-up
    ~25 s, 60-75 s per step, greedy evaluation of 32 held-out rows at the end); up to ~12 minutes
    on a heavily shared one (step 1 took 270 s at load average 6)."""
    from trainer.run.cli import load_recipe

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    spec = load_recipe(recipes / "smollm2-arithmetic.yaml", steps=2)
    rec = Recorder()
    result = train(spec, rec, output_dir=tmp_path)
    assert result.final_step == 2 and result.checkpoint_path is not None
    for metrics in rec.metrics.values():
        assert all(math.isfinite(v) for v in metrics.values())
        # The base model gets single-digit sums right about a quarter of the time.
        assert 0.02 < metrics["reward/numeric/mean"] < 0.9
        # bf16 engine vs fp32 trainer: small but non-zero disagreement.
        assert metrics["logprob_diff/engine_vs_trainer"] < 0.2
    assert 0.0 <= rec.metrics[2]["eval/accuracy"] <= 1.0
    assert rec.metrics[1]["kl_k3"] < 1e-6


def test_prompts_for_round_oversamples_by_the_keep_rate() -> None:
    from trainer.scoring.collect import prompts_for_round

    assert prompts_for_round(8, sampled=0, kept=0, oversample=2.0) == 8  # first round: the batch
    assert prompts_for_round(4, sampled=8, kept=4, oversample=3.0) == 8  # half kept: twice
    assert prompts_for_round(4, sampled=8, kept=1, oversample=3.0) == 12  # capped at 3x
    assert prompts_for_round(4, sampled=8, kept=0, oversample=2.0) == 8  # nothing kept: the cap
    assert prompts_for_round(0, sampled=8, kept=8, oversample=2.0) == 0


def test_conversation_rows_with_their_own_fields_drive_openai_style_graders(
    tmp_path: Path,
) -> None:
    """messages rows (some with a system turn of their own) and extra row fields reach graders
    as `item`: a string_check against {{ item.target }}, combined with a regex by a multi
    grader; the run learns the toy task from that reward."""
    rows = [
        {
            "messages": ([{"role": "system", "content": "Say a digit."}] if i % 2 else [])
            + [{"role": "user", "content": f"say {w}"}],
            "target": "7",
            "note": {"row": i},
        }
        for i, w in enumerate("abcdefgh")
    ]
    graders = [
        {
            "type": "multi",
            "name": "seven",
            "graders": {
                "hit": {
                    "type": "string_check",
                    "input": "{{ sample.output_text }}",
                    "reference": "{{ item.target }}",
                    "operation": "like",
                },
                "short": {"type": "length", "max_chars": 16},
            },
            "calculate_output": "0.9 * hit + 0.1 * short",
        }
    ]
    spec = tiny_spec(dataset={"rows": rows}, graders=graders)
    rec = Recorder()
    train(spec, rec, output_dir=tmp_path)
    rewards = rec.rewards()
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards
    assert all(m["reward/seven/errors"] == 0 for m in rec.metrics.values())
    # The rollout viewer shows the conversation's last user turn as the prompt.
    prompts = {group.prompt for samples in rec.samples.values() for group in samples}
    assert prompts <= {f"say {w}" for w in "abcdefgh"}
