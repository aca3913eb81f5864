"""Kept importable under its old name: ``trainer.phases.compute_advantages(shaped, penalty,
spec)`` is the documented place where the task reward and the reward-side KL penalty are
combined (issue 23), and outside checks call it by that path. The phases live in
:mod:`trainer.update.phases`."""

from __future__ import annotations

from trainer.update.phases import (
    Scored,
    advantages_by_group,
    compute_advantages,
    has_signal,
    needs_old_logprobs,
    pack_groups,
    reward_kl_penalty,
    score_logprobs,
    shaped_rewards,
)

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
