"""Group-relative advantages (GRPO) and the baseline of the reward-side KL penalty.

Rewards arrive as [N_groups, G]: one row per prompt, one column per sampled completion.
All standard deviations here are population standard deviations (``unbiased=False``, divide by
``n``): a group is the whole set being normalised, not a sample of a larger one, and with
``unbiased=True`` a group of G = 1 would give NaN.

Adding a scale: one function here, an entry in :data:`ADVANTAGE_SCALES`, and its name in
``jobspec.AdvantageScale`` (the spec declares the names; a test checks they match).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from jobspec import AdvantageScale


def _as_float(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N_groups, G], got shape {tuple(rewards.shape)}")
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def _group_std(rewards: Tensor, centred: Tensor, eps: float) -> Tensor:
    """GRPO: each group's centred rewards over that group's std. [N_groups, G] -> same."""
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def _batch_std(rewards: Tensor, centred: Tensor, eps: float) -> Tensor:
    """Centred rewards over one std of every reward in the batch. [N_groups, G] -> same."""
    return centred / (rewards.std(unbiased=False) + eps)


def _unscaled(rewards: Tensor, centred: Tensor, eps: float) -> Tensor:
    """Dr. GRPO: the centred rewards as they are. [N_groups, G] -> same."""
    return centred


# (rewards [N_groups, G], rewards minus their group mean [N_groups, G], eps) -> advantages.
# Keys must equal jobspec.AdvantageScale (tests/trainer/test_registries.py).
ADVANTAGE_SCALES: dict[AdvantageScale, Callable[[Tensor, Tensor, float], Tensor]] = {
    "group": _group_std,
    "batch": _batch_std,
    "none": _unscaled,
}


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
    scale_fn = ADVANTAGE_SCALES.get(scale)
    if scale_fn is None:
        raise ValueError(
            f"unknown advantage scale {scale!r}; expected one of {', '.join(ADVANTAGE_SCALES)}"
        )
    r = _as_float(rewards).detach()
    centred = r - r.mean(dim=1, keepdim=True)
    adv = scale_fn(r, centred, eps)
    constant = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)
    return torch.where(constant, torch.zeros_like(adv), adv)


def leave_one_out_centred(values: Tensor) -> Tensor:
    """Each value minus the mean of the OTHER values of its group: [N_groups, G] -> same.

    The baseline of the reward-side KL penalty. Because ``v_i``'s baseline does not depend on
    ``y_i``, ``E[(v_i - baseline_i) * grad log pi(y_i)] = E[v_i * grad log pi(y_i)]``: centring
    this way lowers the variance and keeps the expectation exactly (a mean that includes
    ``v_i`` itself would shrink it by ``(G - 1) / G``). With G = 1 there is no other value and
    the value is returned as it is (still unbiased, only noisier).
    """
    v = _as_float(values).detach()
    g = v.shape[1]
    if g == 1:
        return v.clone()
    others = (v.sum(dim=1, keepdim=True) - v) / (g - 1)
    return v - others
