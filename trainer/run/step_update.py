"""The update half of a step: the kept groups (and the KL-only ones) as a batch, their rewards,
scoring passes and advantages (``trainer.update.inputs``), the optimizer updates
(``trainer.update.policy_update``), the engine put to sleep for them and woken with the new
weights (``trainer.run.engine_sync``), and the update's metrics. The loop
(:mod:`trainer.run.loop`) calls :func:`train_on` once per step that has groups to train on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import Tensor

from trainer.rollout.startup import StartedEngine
from trainer.run.engine_sync import sleep_engine, wake_engine
from trainer.run.rank_batch import (
    RankBatch,
    gather_rows,
    rank_batch,
    rank_update_metrics,
    trained_tokens,
)
from trainer.run.setup import RunSetup
from trainer.scoring.collect import Collected, Group
from trainer.update.inputs import (
    Advantages,
    Scored,
    advantages_by_group,
    has_signal,
    needs_old_logprobs,
    reward_kl_penalty,
    score_logprobs,
    shaped_rewards,
    split_advantages,
)
from trainer.update.policy_update import UpdateInputs, run_updates

__all__ = ["StepContext", "train_on"]


@dataclass(frozen=True)
class StepContext:
    """What a step's update works with: the run's setup, its started engine, the job's seed."""

    setup: RunSetup
    started: StartedEngine
    seed: int


def train_on(
    context: StepContext,
    collected: Collected,
    kl_only: list[Group],
    step: int,
    metrics: dict[str, float],
) -> tuple[dict[int, list[float]], bool]:
    """The update phases (``trainer.update.inputs``) on the kept groups, in order, with
    the ``kl_only`` groups in the KL terms only; fills ``metrics`` and returns the
    advantages by group position in ``collected.kept`` and whether an update ran (False
    when the batch has no signal: every advantage 0 and no loss-side term, see
    :func:`trainer.update.inputs.has_signal`). On several ranks each trains its share of
    the batch (:mod:`trainer.run.rank_batch`)."""
    setup = context.setup
    spec = setup.config.grpo
    clock = time.perf_counter()
    batch = rank_batch(collected.kept, spec, setup.device, setup.world, setup.shares, kl_only)
    if batch.left_out:
        metrics["data/uneven_groups_left_out"] = float(batch.left_out)
    if not (batch.kept or batch.kl_only):  # fewer groups than devices: nothing to share
        metrics["time/update"] = 0.0
        return {}, False
    shaped = shaped_rewards(batch.kept, batch.whole, spec)
    metrics["time/reward"] += time.perf_counter() - clock
    rows = batch.whole.size

    # Without KL in the reward the advantages come from the rewards alone: a batch without
    # signal is known before the engine sleeps or any scoring pass runs.
    advantages = None if spec.kl.in_reward else split_advantages(shaped, None, spec, rows=rows)
    if advantages is not None and not has_signal(advantages.total, spec):
        metrics["time/logprobs"] = 0.0
        return _no_update(context, advantages.total, len(batch.kept), metrics, engine_level=None)

    # The update needs the device memory the engine's KV cache holds (GPU sleep mode).
    level = sleep_engine(context.started)
    clock = time.perf_counter()
    with_old = needs_old_logprobs(spec, rows)
    scored = score_logprobs(
        setup.model, setup.reference, batch.batch, spec, pad_id=setup.pad_id, with_old=with_old
    )
    metrics["time/logprobs"] = time.perf_counter() - clock

    if advantages is None:
        penalty = reward_kl_penalty(scored, batch.batch, spec)
        if penalty is not None:
            penalty = gather_rows(setup.world, batch, penalty, "reward")
            metrics["kl/reward_penalty"] = float(penalty.mean())
        advantages = split_advantages(shaped, penalty, spec, rows=rows)
        if not has_signal(advantages.total, spec):
            return _no_update(
                context, advantages.total, len(batch.kept), metrics, engine_level=level
            )
    _update(context, batch, advantages, scored, step, metrics, with_old=with_old, level=level)
    return advantages_by_group(advantages.total, len(batch.kept), spec.group_size), True


def _update(
    context: StepContext,
    batch: RankBatch,
    advantages: Advantages,
    scored: Scored,
    step: int,
    metrics: dict[str, float],
    *,
    with_old: bool,
    level: int | None,
) -> None:
    """The optimizer updates on ``batch`` (``trainer.update.policy_update``), then the
    engine's wake-up and weight sync, and the update's metrics into ``metrics``."""
    setup = context.setup
    spec = setup.config.grpo
    clock = time.perf_counter()
    stats, pre = run_updates(
        UpdateInputs(
            model=setup.model,
            optimizer=setup.optimizer,
            batch=batch.batch,
            advantages=batch.mine(advantages.total),
            kl_advantages=None if advantages.kl is None else batch.mine(advantages.kl),
            old_logprobs=scored.old,
            ref_logprobs=scored.ref,
            pad_id=setup.pad_id,
            guard=setup.guard,
            step=step,
            seed=context.seed,
            collect_pre_update=not with_old,
            world=setup.world,
        ),
        spec,
    )
    metrics["time/update"] = time.perf_counter() - clock
    metrics["tokens/trained"] = trained_tokens(batch.whole, spec)

    # Only an applied update changed the weights the engine generates with; an engine
    # that dropped its weights to sleep (level 2) needs them back either way.
    applied = stats.updates > stats.skipped
    if applied and setup.mirror is not None:
        setup.mirror.mark_stale()
    metrics["time/weight_sync"] = wake_engine(setup, context.started, applied or level == 2)
    task = advantages.total[: len(batch.kept) * spec.group_size]
    metrics.update(rank_update_metrics(setup.world, batch, stats, task, scored, pre, spec))


def _no_update(
    context: StepContext,
    adv: Tensor,
    groups: int,
    metrics: dict[str, float],
    *,
    engine_level: int | None,
) -> tuple[dict[int, list[float]], bool]:
    """A batch without signal: no optimizer step (AdamW's momentum would still move every
    weight), no schedule step, no sync. An engine put to sleep for it is woken, and synced
    only when a level-2 sleep dropped its weights, which it needs back either way."""
    if engine_level is not None:
        wake_engine(context.setup, context.started, engine_level == 2)
    metrics["time/update"] = 0.0
    return advantages_by_group(adv, groups, context.setup.config.grpo.group_size), False
