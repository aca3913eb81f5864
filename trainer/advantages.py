"""Group-relative advantages (GRPO) and the zero-variance test used by dynamic sampling.

Rewards arrive as [N_groups, G]: one row per prompt, one column per sampled completion.
All standard deviations here are population standard deviations (``unbiased=False``, divide by
``n``): a group is the whole set being normalised, not a sample of a larger one, and with
``unbiased=True`` a group of G = 1 would give NaN.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]
ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)


def _as_float(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N_groups, G], got shape {tuple(rewards.shape)}")
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def group_advantages(rewards: Tensor, scale: AdvantageScale, eps: float = 1e-6) -> Tensor:
    """Advantages of each completion relative to its group: [N_groups, G] -> [N_groups, G].

    - ``group``: ``(r - group mean) / (group std + eps)`` (GRPO).
    - ``batch``: ``(r - group mean) / (std of all rewards in the batch + eps)``: centred per
      group, scaled by one batch-wide std, so that groups with a small spread are not blown up.
    - ``none``: ``r - group mean`` (Dr. GRPO: no std normalisation, which otherwise up-weights
      questions that are too easy or too hard).

    Groups whose rewards are all exactly equal get exactly 0 (not ``rounding / eps``, which is
    what ``r - mean`` can give when the mean is not representable, e.g. three rewards of 0.1).
    The result carries no gradient.
    """
    r = _as_float(rewards).detach()
    mean = r.mean(dim=1, keepdim=True)
    centred = r - mean
    if scale == "group":
        adv = centred / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    elif scale == "batch":
        adv = centred / (r.std(unbiased=False) + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; expected one of {ADVANTAGE_SCALES}")
    constant = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)
    return torch.where(constant, torch.zeros_like(adv), adv)


def zero_variance_groups(rewards: Tensor, tol: float = 1e-6) -> Tensor:
    """Bool [N_groups]: True where the group's rewards are all equal (population std < tol).

    Such groups give zero advantage and so no policy-gradient signal; dynamic sampling drops
    them and samples more prompts.
    """
    r = _as_float(rewards).detach()
    return r.std(dim=1, unbiased=False) < tol
