"""The phases of one GRPO update, in the order the loop runs them on a step's kept groups:

1. :func:`pack_groups`: the kept completions as a right-padded :class:`~trainer.update.step.Batch`.
2. :func:`shaped_rewards`: task reward plus the optional DAPO overlong penalty.
3. :func:`score_logprobs`: no-grad logprobs of the sampled tokens under the policy before the
   update (``old``, only when :func:`needs_old_logprobs`) and under the reference (``ref``).
4. :func:`reward_kl_penalty` (KL placed in the reward: k1, exact) and
   :func:`compute_advantages`: the task reward's group advantages minus the centred, unscaled
   penalty.
5. the update itself: ``trainer.update.passes.run_updates``, unless :func:`has_signal` says the batch
   has none (then no optimizer step, no schedule step, no sync).
6. the weight sync into the rollout engine (``RolloutEngine.sync_weights``), by the loop.
7. ``trainer.run.metrics.update_step_metrics``: what the update and the token-level values
   report.

Shapes: B = kept groups x G completions, flattened group by group; T = longest completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainer.models.reference import Reference
from trainer.scoring.collect import Group
from trainer.spec import GRPOSpec
from trainer.update import kl as kl_math
from trainer.update.advantages import group_advantages, leave_one_out_centred
from trainer.update.shaping import overlong_penalty, truncation_loss_mask
from trainer.update.step import Batch, forward_logprobs, pack_batch

__all__ = [
    "Scored",
    "advantages_by_group",
    "compute_advantages",
    "has_signal",
    "needs_old_logprobs",
    "pack_groups",
    "reward_kl_penalty",
    "score_logprobs",
    "shaped_rewards",
]


def pack_groups(groups: Sequence[Group], spec: GRPOSpec, device: torch.device) -> Batch:
    """The groups' completions as one batch of B = len(groups) x G rows, each row paired with
    its group's prompt; with ``spec.mask_truncated`` truncated rows get a zero loss mask, and an
    episode's injected tokens (``Completion.loss_mask`` 0) are in no mask."""
    comps = [c for g in groups for c in g.completions]
    truncated = [c.finish_reason == "length" for c in comps]
    return pack_batch(
        [g.prompt_of(j) for g in groups for j in range(spec.group_size)],
        [c.token_ids for c in comps],
        [c.logprobs for c in comps],
        truncated,
        truncation_loss_mask(torch.tensor(truncated, device=device), spec.mask_truncated),
        device,
        token_masks=[c.loss_mask for c in comps],
    )


def shaped_rewards(groups: Sequence[Group], batch: Batch, spec: GRPOSpec) -> Tensor:
    """[B] float32: each completion's task reward (the scorer's total), plus the overlong
    penalty of its length when ``spec.overlong`` is on. The KL penalty, when placed in the
    reward, comes later (:func:`compute_advantages`): it needs the logprobs."""
    device = batch.mask.device
    shaped = torch.tensor([r for g in groups for r in g.rewards], device=device).float()
    if spec.overlong.enabled:
        shaped += overlong_penalty(
            batch.lengths,
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


def compute_advantages(shaped: Tensor, penalty: Tensor | None, spec: GRPOSpec) -> Tensor:
    """[B] advantages: the shaped rewards [B] scaled by ``spec.advantage_scale``, minus the
    reward-side KL ``penalty`` [B] (or None) centred on a leave-one-out baseline and NOT
    scaled; groups of ``spec.group_size`` consecutive rows; ``shaped`` is left unchanged.

    Why the two parts are treated apart: the update's expected policy-gradient is
    ``E[A_i * grad log pi(y_i)]``. For the task part any per-group scaling is the scaling the
    job chose. For the KL part the scale is the point: ``E[penalty_i * grad log pi(y_i)] =
    beta * grad KL(pi || ref)`` (k1 summed, see :func:`reward_kl_penalty`), and the
    leave-one-out baseline, independent of ``y_i``, keeps that expectation whole (c = 1). Had
    the penalty gone through the group std it would be multiplied by a random factor that
    depends on the samples (0.16x to 12x of beta, pointing elsewhere); had it been left out of
    groups whose task rewards are all equal (where most of the late drift happens), the
    penalty would vanish exactly where it is needed. So it holds in every group, under every
    scaling (tests/trainer/test_kl_reward.py enumerates all K^G groups).
    """
    g = spec.group_size
    task = group_advantages(shaped.view(-1, g), spec.advantage_scale).view(-1)
    if penalty is None:
        return task
    return task - leave_one_out_centred(penalty.view(-1, g)).view(-1).to(task.dtype)


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
