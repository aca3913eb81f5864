"""Per-step metrics (the stable catalog of design.md section 6) and rollout samples.

Names emitted by the loop:
``reward/mean``, ``reward/std``, ``reward/<grader>/mean`` (unweighted scores),
``reward/<grader>/errors`` (how many of the step's calls of that grader failed and scored 0:
it raised, returned something that is not a score in [0, 1], or ran past its time limit),
``reward/errors`` (the sum over graders) and ``reward/timeouts`` (of those, the calls that ran
past their time limit; only isolated graders have one, see ``grading.graders.pool``), and
``frac_zero_std_groups``, ``completion_len/mean``, ``completion_len/max``, ``truncated_frac``
over EVERY completion sampled in the step (all dynamic-sampling rounds, kept or dropped: the
honest learning curve; rewards before overlong/KL shaping);
``advantage/abs_mean``, ``loss/policy``, ``loss/kl`` (beta times the aggregated KL, 0 unless
placed in the loss), ``kl/reward_penalty`` (placed in the reward: the mean of the penalty
subtracted from each completion's reward, beta times its summed k1), ``clip_frac/low``,
``clip_frac/high``, ``clip_frac/dual`` (the dual-clip cap binds), ``clip_frac/clamped`` (a
token's gradient was lost to the +-20 log-ratio clamp with no clip bound binding): fractions of
the loss tokens of every update after the step's first, which runs at ratio 1 and cannot clip,
so all four are absent when a step has a single update; ``grad_norm`` (pre-clip), ``lr`` (the
rate this step used), ``entropy``, ``kl`` (mean per-token value of the chosen estimator) and
``kl_k3`` (always k3; only with a reference model), ``logprob_diff/engine_vs_trainer`` (mean
|engine - trainer| logprob of the sampled tokens before the update), ``mismatch/kl``,
``mismatch/ratio_mean``, ``mismatch/ratio_max``, ``mismatch/token_mult_prob_error`` (the mean
of exp|log pi_old - log pi_engine|, NeMo-RL's) and ``mismatch/capped_frac`` (the engine
against the trainer's pi_old, see ``trainer.update.sampler_correction``), over the completions
trained on (an async run adds ``mismatch/engine_token_mult_prob_error`` on a step without lag,
what its guard watches with ``mismatch/capped_frac``: ``trainer.run.async_run``); ``time/rollout``, ``time/reward``, ``time/logprobs``, ``time/update``,
``time/weight_sync``, ``time/step`` (seconds), ``tokens_per_s/rollout``; ``tokens/trained``
(prompt plus completion tokens of the batch trained on, times num_iterations; absent on a step
with nothing to train on);
``update/skipped`` (1 when the step ran no update: no group to train on, or every advantage 0
with no loss-side term, see ``trainer.update.inputs.has_signal``; then the update's metrics above are
absent; 0 otherwise); ``data/skipped_prompts`` (dataset rows the run skipped because their formatted prompt is longer
than ``max_prompt_tokens``: the same value every step, 0 when none; a ``dataset`` event lists
them by row number, see ``trainer.data.dataset.prompts_for_run``); ``eval/accuracy`` on
evaluation steps (greedy decoding of the held-out rows; a row counts as correct when its total
reward reaches the scorer's ``max_total``: for graders, the sum of the positive weights, i.e.
every positively weighted grader gave full marks; with a ``max_total`` of 0 or less, the mean
total reward is reported instead). Values that are not finite (e.g. ``grad_norm`` when every update was skipped)
are left out of the step's metrics rather than sent as NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from grading.graders import Item
from jobspec import GRPOSpec, KLEstimatorName
from trainer.data.dataset import Example
from trainer.rollout.base import RolloutEngine
from trainer.run.callbacks import CompletionSample, RolloutSample
from trainer.scoring.collect import Collected, Group
from trainer.scoring.rewards import Scorer
from trainer.scoring.sampling import Rollout
from trainer.update import kl as kl_math
from trainer.update.batch import Batch
from trainer.update.inputs import Scored
from trainer.update.losses import masked_mean
from trainer.update.policy_update import PreUpdate, UpdateStats
from trainer.update.sampler_correction import mismatch_metrics

__all__ = [
    "build_samples",
    "eval_accuracy",
    "evaluate",
    "rollout_metrics",
    "sampling_report",
    "token_metrics",
    "update_metrics",
    "update_step_metrics",
]


def rollout_metrics(col: Collected, grader_names: list[str]) -> dict[str, float]:
    """Reward, length and timing statistics of the sampling phase."""
    rewards = torch.tensor([r for g in col.groups for r in g.rewards], dtype=torch.float64)
    comps = [c for g in col.groups for c in g.completions]
    lengths = torch.tensor([len(c.token_ids) for c in comps], dtype=torch.float64)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "frac_zero_std_groups": col.num_zero_std / max(1, len(col.groups)),
        "completion_len/mean": float(lengths.mean()),
        "completion_len/max": float(lengths.max()),
        "truncated_frac": sum(c.finish_reason == "length" for c in comps) / max(1, len(comps)),
        "time/rollout": col.rollout_seconds,
        "time/reward": col.reward_seconds,
        "time/logprobs": 0.0,
        "time/update": 0.0,
        "time/weight_sync": 0.0,
        "tokens_per_s/rollout": col.generated_tokens / max(col.rollout_seconds, 1e-9),
    }
    for name in grader_names:
        scores = [s for g in col.groups for s in g.per_grader[name]]
        metrics[f"reward/{name}/mean"] = sum(scores) / max(1, len(scores))
        metrics[f"reward/{name}/errors"] = float(col.grader_errors.get(name, 0))
    metrics["reward/errors"] = float(sum(col.grader_errors.values()))
    metrics["reward/timeouts"] = float(sum(col.grader_timeouts.values()))
    return metrics


def sampling_report(
    col: Collected,
    kl_only: Sequence[Group],
    spec: GRPOSpec,
    step: int,
    on_event: Callable[..., None],
) -> dict[str, float]:
    """What the step's sampling left to say: a warning event per grader that failed (with its
    first error), and with dynamic sampling its metrics (``dynamic_sampling/rounds``,
    ``kept_groups``, ``dropped_groups``, and ``kl_only_groups``: the groups left out of the
    task's update that the KL still acts on, ``trainer.update.inputs.kl_only_groups``) and an
    event when it dropped groups."""
    for name, message in col.grader_messages.items():
        errors = col.grader_errors.get(name, 0)
        on_event(
            "grader",
            f"step {step}: grader {name} failed on {errors} samples (scored 0); "
            f"first error: {message}",
            level="warning",
            data={"grader": name, "errors": errors, "first": message},
        )
    if not spec.dynamic_sampling.enabled:
        return {}
    # Only dynamic sampling drops groups; frac_zero_std_groups covers the rest.
    dropped = col.num_zero_std
    surplus = len(col.groups) - len(col.kept) - dropped
    metrics = {
        "dynamic_sampling/rounds": float(col.rounds),
        "dynamic_sampling/kept_groups": float(len(col.kept)),
        "dynamic_sampling/dropped_groups": float(dropped),
    }
    if kl_only:
        metrics["dynamic_sampling/kl_only_groups"] = float(len(kl_only))
    if dropped:
        kl_note = f", the KL acting on {len(kl_only)} of them" if kl_only else ""
        on_event(
            "dynamic_sampling",
            f"step {step}: dropped {dropped} of {len(col.groups)} groups with equal "
            f"rewards ({col.rounds} sampling rounds, {len(col.kept)} groups trained on, "
            f"{surplus} more left out{kl_note})",
            data={"rounds": col.rounds, "dropped": dropped, "surplus": surplus},
        )
    return metrics


def update_metrics(stats: UpdateStats, advantages: Tensor) -> dict[str, float]:
    return {
        "advantage/abs_mean": float(advantages.abs().mean()),
        "loss/policy": stats.policy_loss,
        "loss/kl": stats.kl_loss,
        "clip_frac/low": stats.clip_low,
        "clip_frac/high": stats.clip_high,
        "clip_frac/dual": stats.clip_dual,
        "clip_frac/clamped": stats.clamped,
        "grad_norm": stats.grad_norm,
    }


def token_metrics(
    mask: Tensor,
    *,
    logprobs: Tensor | None,
    entropy: Tensor | None,
    engine_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    estimator: KLEstimatorName,
) -> dict[str, float]:
    """Token-level metrics from the pre-update trainer logprobs and entropies ([B, T] each)."""
    out: dict[str, float] = {}
    if entropy is not None:
        out["entropy"] = float(masked_mean(entropy, mask))
    if logprobs is None:
        return out
    if engine_logprobs is not None:
        out["logprob_diff/engine_vs_trainer"] = float(
            masked_mean((engine_logprobs - logprobs).abs(), mask)
        )
    if ref_logprobs is not None:
        out["kl"] = float(
            masked_mean(kl_math.per_token_kl(estimator, logprobs, ref_logprobs), mask)
        )
        out["kl_k3"] = float(masked_mean(kl_math.per_token_kl("k3", logprobs, ref_logprobs), mask))
    return out


def evaluate(
    engine: RolloutEngine,
    scorer: Scorer,
    prompt_ids: list[list[int]],
    items: Sequence[Item],
    spec: GRPOSpec,
    *,
    seed: int,
    rollout: tuple[Rollout, Sequence[Example]] | None = None,
) -> float:
    """``eval/accuracy``: greedy completions of the held-out prompts (token ids), scored against
    their rows (``items``), and reduced by :func:`eval_accuracy` against the scorer's
    ``max_total``. With ``rollout`` (an agent job's, and the held-out rows) each prompt is a
    greedy episode, its final answer graded; the accuracy is the graders' (an environment's
    reward, unbounded, is not part of it)."""
    if rollout is not None:
        sampler, examples = rollout
        rolled = sampler.sample(engine, prompt_ids, examples, 1, spec, seed=seed, greedy=True)
        texts = rolled.texts or [g[0].text for g in rolled.completions]
    else:
        results = engine.generate(
            prompt_ids,
            1,
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            seed=seed,
            greedy=True,
        )
        texts = [r[0].text for r in results]
    totals, _ = scorer.score(texts, items)
    return eval_accuracy(totals, scorer.max_total)


def eval_accuracy(totals: list[float], max_total: float) -> float:
    """Share of rows whose total reward reaches ``max_total`` (every positively weighted grader
    gave full marks); the mean total reward when no grader has a positive weight."""
    if not totals:
        return 0.0
    if max_total <= 0:
        return sum(totals) / len(totals)
    return sum(t >= max_total - 1e-9 for t in totals) / len(totals)


def build_samples(
    col: Collected,
    advantages: dict[int, list[float]],
    prompts: list[str],
    answers: list[str | None],
    limit: int,
) -> list[RolloutSample]:
    """The first ``limit`` groups of the step; ``advantages`` maps a position in ``col.kept`` to
    its group's advantages (dropped groups get 0). ``prompts``/``answers`` are by training row.
    An agent episode's sample carries its group's transcript of it (already bounded)."""
    kept_pos = {id(g): i for i, g in enumerate(col.kept)}
    out = []
    for group in col.groups[:limit]:
        adv = advantages.get(kept_pos.get(id(group), -1), [0.0] * len(group.completions))
        completions = [
            CompletionSample(
                text=c.text,
                reward=group.rewards[j],
                rewards={name: s[j] for name, s in group.per_grader.items()},
                advantage=float(adv[j]),
                num_tokens=len(c.token_ids),
                finish_reason=c.finish_reason,
                transcript=None if group.transcripts is None else group.transcripts[j],
            )
            for j, c in enumerate(group.completions)
        ]
        out.append(
            RolloutSample(
                prompt=prompts[group.row], answer=answers[group.row], completions=completions
            )
        )
    return out


def update_step_metrics(
    stats: UpdateStats,
    advantages: Tensor,
    batch: Batch,
    scored: Scored,
    pre: PreUpdate | None,
    spec: GRPOSpec,
) -> dict[str, float]:
    """Loss, clipping and gradient statistics, plus the token-level metrics (entropy, KL,
    engine-vs-trainer logprob gap) of the pre-update policy: from the old-logprob pass, or from
    the single update's own forward pass (which ran before its optimizer step)."""
    out = update_metrics(stats, advantages)
    logprobs: Tensor | None = scored.old
    entropy = scored.old_entropy
    if logprobs is None and pre is not None:
        logprobs, entropy = pre.logprobs, pre.entropy
    out.update(
        token_metrics(
            batch.mask,
            logprobs=logprobs,
            entropy=entropy,
            engine_logprobs=batch.engine_logprobs,
            ref_logprobs=scored.ref,
            estimator=spec.kl.estimator,
        )
    )
    if logprobs is not None and batch.engine_logprobs is not None:
        correction = spec.sampler_correction
        out.update(
            mismatch_metrics(
                logprobs, batch.engine_logprobs, batch.mask, correction.mode, correction.cap
            )
        )
    return out
