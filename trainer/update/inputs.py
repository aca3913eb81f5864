"""The phases of one GRPO update, in the order the loop runs them on a step's kept groups:

1. :func:`pack_groups`: the kept completions as a right-padded :class:`~trainer.update.batch.Batch`.
2. :func:`shaped_rewards`: task reward plus the optional DAPO overlong penalty.
3. :func:`score_logprobs`: no-grad logprobs of the sampled tokens under the policy before the
   update (``old``, only when :func:`needs_old_logprobs`) and under the reference (``ref``).
4. :func:`reward_kl_penalty` (KL placed in the reward: k1, exact) and
   :func:`split_advantages`: the task reward's group advantages minus the centred, unscaled
   penalty, with the penalty's part kept apart (the update aggregates it with a constant
   normaliser, ``trainer.update.losses.kl_aggregate``, whatever the task part uses).
5. the update itself: ``trainer.update.policy_update.run_updates``, unless :func:`has_signal` says the batch
   has none (then no optimizer step, no schedule step, no sync).
6. the weight sync into the rollout engine (``RolloutEngine.sync_weights``), by the loop.
7. ``trainer.run.metrics.update_step_metrics``: what the update and the token-level values
   report.

Shapes: B = kept groups x G completions, flattened group by group; T = longest completion.
With a KL term and dynamic sampling, the groups dynamic sampling left out follow the kept ones
(:func:`kl_only_groups`): the KL acts on every sampled completion, the task's update on the
kept ones only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from jobspec import GRPOSpec
from trainer.models.reference import Reference
from trainer.scoring.collect import Collected, Group
from trainer.update import kl as kl_math
from trainer.update.advantages import group_advantages, leave_one_out_centred
from trainer.update.batch import Batch, forward_logprobs, pack_batch
from trainer.update.shaping import longest_turns, overlong_penalty, truncation_loss_mask

__all__ = [
    "Advantages",
    "Scored",
    "advantages_by_group",
    "compute_advantages",
    "has_signal",
    "kl_only_groups",
    "needs_old_logprobs",
    "pack_groups",
    "reward_kl_penalty",
    "score_logprobs",
    "shaped_rewards",
    "split_advantages",
]


def kl_only_groups(collected: Collected, spec: GRPOSpec) -> list[Group]:
    """The sampled groups the task's update leaves out but the KL must still act on: with a
    KL term (``spec.kl.active``) and dynamic sampling, every group of the step that is not in
    ``collected.kept`` (the flat groups it dropped and the kept ones past the batch); else none.

    Why: dynamic sampling selects groups by their rewards, so the kept groups' completions are
    not a sample of the policy; a KL term computed on them alone pulls toward the reference by
    a biased amount (17-61% off, conditioned on the kept groups, on an exact enumeration).
    Every sampled completion is, so the KL acts on all of them (with a constant normaliser,
    the expectation over the rounds' groups stays a constant multiple of the KL gradient). The
    price: these rows join the update's passes."""
    if not (spec.kl.active and spec.dynamic_sampling.enabled):
        return []
    kept = {id(g) for g in collected.kept}
    return [g for g in collected.groups if id(g) not in kept]


def pack_groups(
    groups: Sequence[Group],
    spec: GRPOSpec,
    device: torch.device,
    *,
    task_groups: int | None = None,
) -> Batch:
    """The groups' completions as one batch of B = len(groups) x G rows, each row paired with
    its group's prompt; with ``spec.mask_truncated`` truncated rows get a zero loss mask, and an
    episode's injected tokens (``Completion.loss_mask`` 0) are in no mask. Only the first
    ``task_groups`` groups (default: all) are in the task's loss mask; the rest are KL-only
    rows (:func:`kl_only_groups`), in ``mask`` only."""
    comps = [c for g in groups for c in g.completions]
    truncated = [c.finish_reason == "length" for c in comps]
    task_rows = len(comps) if task_groups is None else task_groups * spec.group_size
    weight = truncation_loss_mask(torch.tensor(truncated, device=device), spec.mask_truncated)
    weight[task_rows:] = 0.0
    return pack_batch(
        [g.prompt_of(j) for g in groups for j in range(spec.group_size)],
        [c.token_ids for c in comps],
        [c.logprobs for c in comps],
        truncated,
        weight,
        device,
        token_masks=[c.loss_mask for c in comps],
    )


def shaped_rewards(groups: Sequence[Group], batch: Batch, spec: GRPOSpec) -> Tensor:
    """[B_task] float32: each completion's task reward (the scorer's total) of ``groups`` (the
    batch's first rows), plus the overlong penalty of its longest turn's own tokens when
    ``spec.overlong`` is on (an episode's tool results and environment turns do not count
    against ``max_new_tokens``, a budget per turn). The KL penalty, when placed in the reward,
    comes later (:func:`split_advantages`): it needs the logprobs."""
    device = batch.mask.device
    shaped = torch.tensor([r for g in groups for r in g.rewards], device=device).float()
    if spec.overlong.enabled:
        shaped += overlong_penalty(
            longest_turns(batch.mask[: shaped.shape[0]]),
            spec.max_new_tokens,
            spec.overlong.cache_tokens,
            spec.overlong.penalty,
        )
    return shaped


def needs_old_logprobs(spec: GRPOSpec, batch_size: int) -> bool:
    """Whether the pre-update logprobs need a pass of their own.

    With one update over the whole batch, the update's own forward pass runs before its
    optimizer step, so its detached logprobs are the old ones (and the metrics take them from
    there). Several iterations or minibatches change the policy between passes, and a KL in
    the reward needs them before the advantages exist.
    """
    mini = spec.mini_batch_size or batch_size
    return spec.num_iterations > 1 or mini < batch_size or spec.kl.in_reward


@dataclass
class Scored:
    """No-grad values of the sampled tokens before the update; None where not computed."""

    old: Tensor | None  # [B, T] policy logprobs (only when needs_old_logprobs)
    old_entropy: Tensor | None  # [B, T] policy entropies, with ``old``
    ref: Tensor | None  # [B, T] reference logprobs (only with a reference model)


def score_logprobs(
    model: nn.Module,
    reference: Reference | None,
    batch: Batch,
    spec: GRPOSpec,
    *,
    pad_id: int,
    with_old: bool,
) -> Scored:
    """The old-policy pass (``with_old``) and the reference pass (``reference`` given), at the
    sampling temperature, ``spec.micro_batch_size`` rows at a time, in the training dtype."""

    def forward(m: nn.Module, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        return forward_logprobs(
            m,
            batch,
            micro_batch_size=spec.micro_batch_size,
            temperature=spec.temperature,
            pad_id=pad_id,
            with_entropy=with_entropy,
            dtype=spec.dtype,
        )

    old, old_entropy = forward(model, True) if with_old else (None, None)
    ref = None
    if reference is not None:
        with reference.scope():
            ref = forward(reference.model, False)[0]
    return Scored(old=old, old_entropy=old_entropy, ref=ref)


def reward_kl_penalty(scored: Scored, batch: Batch, spec: GRPOSpec) -> Tensor | None:
    """[B] ``beta * sum_t (old - ref)`` (detached) for KL placed in the reward, else None.

    Always k1 (:data:`trainer.update.kl.REWARD_ESTIMATOR`), whatever ``spec.kl.estimator`` names: its
    policy-gradient ``E[penalty * grad log pi]`` is exactly ``beta * grad KL(pi || ref)``; k2, k3
    and k3_unbiased there would be biased (see :mod:`trainer.update.kl`). ``old`` is the sampling
    policy's log-probs, so the penalty is on-policy for the rollout it scores.
    """
    kl = spec.kl
    if not kl.in_reward or scored.old is None or scored.ref is None:
        return None
    per_token = kl_math.per_token_kl(kl_math.REWARD_ESTIMATOR, scored.old, scored.ref)
    return kl_math.kl_reward_penalty(per_token, batch.mask, kl.beta)


@dataclass(frozen=True)
class Advantages:
    """A step's advantages, [B] each."""

    total: Tensor  # the task's part plus the KL's: what the clip decisions see
    kl: Tensor | None  # the reward-side KL penalty's part (None: no KL in the reward)


def split_advantages(
    shaped: Tensor, penalty: Tensor | None, spec: GRPOSpec, *, rows: int | None = None
) -> Advantages:
    """:func:`compute_advantages`, with the KL penalty's part kept apart.

    ``shaped`` [B_task] are the task groups' rewards (the batch's first rows); ``penalty`` [B]
    covers every row, KL-only ones (:func:`kl_only_groups`) included, which get a task
    advantage of 0. ``rows``: B when no penalty is given (default: the penalty's rows, else
    B_task). The update prices ``kl`` apart from the task's part
    (``trainer.update.losses.surrogate_part``) and aggregates it with a constant normaliser, so
    that its expected gradient is ``-beta * grad KL_seq / max_new_tokens`` per completion under
    every loss aggregation."""
    g = spec.group_size
    task = shaped.new_zeros(0)  # no task group: only KL-only rows (kl_only_groups)
    if shaped.numel():
        task = group_advantages(shaped.view(-1, g), spec.advantage_scale).view(-1)
    size = rows if rows is not None else (len(penalty) if penalty is not None else len(task))
    if size < len(task):
        raise ValueError(f"{size} rows cannot hold {len(task)} task rows")
    if size > len(task):
        task = torch.cat([task, task.new_zeros(size - len(task))])
    if penalty is None:
        return Advantages(task, None)
    # The wider of the two dtypes: a float64 penalty (exact tests) is not rounded to float32.
    dtype = torch.promote_types(task.dtype, penalty.dtype)
    kl = -leave_one_out_centred(penalty.view(-1, g)).view(-1).to(dtype)
    return Advantages(task.to(dtype) + kl, kl)


def compute_advantages(shaped: Tensor, penalty: Tensor | None, spec: GRPOSpec) -> Tensor:
    """[B] advantages: the shaped rewards [B] scaled by ``spec.advantage_scale``, minus the
    reward-side KL ``penalty`` [B] (or None) centred on a leave-one-out baseline and NOT
    scaled; groups of ``spec.group_size`` consecutive rows; ``shaped`` is left unchanged.
    (:func:`split_advantages` gives the penalty's part too, which the update needs.)

    Why the two parts are treated apart: the update's expected policy-gradient is
    ``E[A_i * grad log pi(y_i)]``. For the task part any per-group scaling is the scaling the
    job chose. For the KL part the scale is the point: ``E[penalty_i * grad log pi(y_i)] =
    beta * grad KL(pi || ref)`` (k1 summed, see :func:`reward_kl_penalty`), and the
    leave-one-out baseline, independent of ``y_i``, keeps that expectation whole (c = 1). Had
    the penalty gone through the group std it would be multiplied by a random factor that
    depends on the samples (0.16x to 12x of beta, pointing elsewhere); had it been left out of
    groups whose task rewards are all equal (where most of the late drift happens), the
    penalty would vanish exactly where it is needed. So it holds in every group, under every
    scaling (tests/trainer/update/test_kl_reward.py enumerates all K^G groups), and the update keeps
    it exact under every loss aggregation (tests/trainer/update/test_kl_exact.py).
    """
    return split_advantages(shaped, penalty, spec).total


def has_signal(advantages: Tensor, spec: GRPOSpec) -> bool:
    """Whether an update on this batch can move the weights by its own gradient.

    False when every advantage is exactly 0 and no KL term is in the loss: then every gradient
    is 0, and an optimizer step would still move every weight by AdamW's momentum and weight
    decay, the schedule would advance and the engine be re-synced for nothing. The loop skips
    all three and counts the step in ``update/skipped``. Without KL in the reward the
    advantages need no log-probabilities, so the loop asks before any scoring pass.
    """
    return spec.kl.in_loss or bool((advantages != 0).any())


def advantages_by_group(advantages: Tensor, groups: int, group_size: int) -> dict[int, list[float]]:
    """[B] advantages -> {position of the group among the kept groups: its G advantages}."""
    values = advantages.tolist()
    return {i: values[i * group_size : (i + 1) * group_size] for i in range(groups)}
