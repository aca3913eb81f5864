"""The loss functions of the Tinker training API, per token, and the registry that names them.

Shapes: B datums by T positions (right-padded). ``lp`` [B, T] is the learner's target
log-probability ``log p_theta(target_tokens[t] | tokens[: t + 1])`` with its gradient; every
input is a [B, T] float tensor, 0 at padding. Each objective returns the per-token loss [B, T];
the call's loss is its plain SUM over tokens and datums (Tinker's convention: no mean, so that
gradients of several calls add up to the gradient of their union).

The input ``logprobs`` is q, the log-probability the sampler gave each token; ``advantages`` A.
``ratio = exp(lp - q)``. A token whose advantage is 0 contributes nothing in every
policy-gradient loss but ``dro``, whose quadratic penalty is Tinker's on every token (see
:func:`dro`): the cookbook marks prompt positions with A = 0 (and q = 0, target 0). Padding
contributes nothing to any loss: its ``lp`` and inputs are 0 and the session masks it.

Clip thresholds are ratio bounds (0.8 and 1.2 by default), not epsilons. They come from the
call's config, and a datum may override them per token with ``loss_fn_inputs`` of the same
names; the objectives read them as [B, T] inputs either way.

The log-ratio is clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``exp`` (float32
overflows near 88): a token whose probability moved by more than ``e^20`` since it was sampled
gets no gradient from the ratio instead of an infinite one. Inside that range every objective is
exactly the formula in its docstring. ``trainer.update.losses.clipped_surrogate`` is not reused:
its bounds are scalar epsilons, here they are per-token ratio bounds.

Adding a loss: its signature in ``jobspec.tinker_losses`` (what the API checks before storing a
call) and its objective here; its name is then in :data:`LOSS_FUNCTIONS`, which validation
and the service read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from jobspec.tinker_losses import (
    CLIP_HIGH,
    CLIP_LOW,
    LOSS_SIGNATURES,
    UNSUPPORTED_LOSSES,
    LossSignature,
)

__all__ = [
    "LOSSES",
    "LOSS_FUNCTIONS",
    "MAX_LOG_RATIO",
    "UNSUPPORTED_LOSSES",
    "LossFunction",
    "cispo",
    "cross_entropy",
    "dro",
    "gspo",
    "importance_sampling",
    "ppo",
]

MAX_LOG_RATIO = 20.0

Inputs = Mapping[str, Tensor]
Objective = Callable[[Tensor, Inputs, Mapping[str, float]], Tensor]


def _log_ratio(lp: Tensor, q: Tensor, active: Tensor) -> Tensor:
    """``lp - q`` where ``active``, 0 elsewhere, clamped: inactive tokens (prompt positions
    with q = 0, padding) can then never put an inf into the forward or a NaN into the
    backward pass (``0 * inf``)."""
    diff = torch.where(active, lp - q, torch.zeros_like(lp))
    return diff.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _clipped_objective(ratio: Tensor, adv: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """``-min(ratio * A, clamp(ratio, low, high) * A)`` per token (PPO's pessimistic bound)."""
    return -torch.minimum(ratio * adv, torch.clamp(ratio, min=low, max=high) * adv)


def cross_entropy(lp: Tensor, x: Inputs, config: Mapping[str, float]) -> Tensor:
    """``-lp * weights`` [B, T]. Weights are any floats (the SDK's client-side custom losses
    send ``-dC/dlp``, which may be negative); absent, they are 1 on every token."""
    return -lp * x["weights"]


def importance_sampling(lp: Tensor, x: Inputs, config: Mapping[str, float]) -> Tensor:
    """``-exp(lp - q) * A`` [B, T]: the policy gradient corrected for the sampler, whose
    gradient is ``-ratio * A * grad lp``."""
    adv = x["advantages"]
    ratio = torch.exp(_log_ratio(lp, x["logprobs"], adv != 0))
    return -ratio * adv


def ppo(lp: Tensor, x: Inputs, config: Mapping[str, float]) -> Tensor:
    """``-min(ratio * A, clamp(ratio, lo, hi) * A)`` [B, T], ``lo``/``hi`` the per-token clip
    thresholds (ratio bounds)."""
    adv = x["advantages"]
    ratio = torch.exp(_log_ratio(lp, x["logprobs"], adv != 0))
    return _clipped_objective(ratio, adv, x[CLIP_LOW], x[CLIP_HIGH])


def cispo(lp: Tensor, x: Inputs, config: Mapping[str, float]) -> Tensor:
    """``-sg(clamp(ratio, lo, hi)) * lp * A`` [B, T]: the clipped ratio is a constant weight
    (no token loses its gradient to the clip, unlike ppo)."""
    adv = x["advantages"]
    ratio = torch.exp(_log_ratio(lp, x["logprobs"], adv != 0))
    weight = torch.clamp(ratio, min=x[CLIP_LOW], max=x[CLIP_HIGH]).detach()
    return -weight * lp * adv


def dro(lp: Tensor, x: Inputs, config: Mapping[str, float]) -> Tensor:
    """``-(lp * A - beta / 2 * (lp - q)^2)`` [B, T] on every token, Tinker's formula.

    The penalty does not vanish with A: a token with advantage 0 (a flat group's, all of
    whose advantages are 0) still gets ``beta / 2 * (lp - q)^2``, gradient ``beta * (lp - q)
    * grad lp``. Padding gets nothing (``lp`` and q are 0 there). Caveat, as on Tinker: the
    prompt positions the cookbook sends (A = 0, q = 0, target 0) are penalised too, which pulls
    ``log p(target | prefix)`` towards 0 there; sending the learner's own log-probabilities
    (from a ``forward`` call) as q on them makes the penalty and its gradient 0 there. ``beta``
    defaults to 0.05 (the Tinker docs' example; the docs state no default)."""
    return -(lp * x["advantages"] - 0.5 * config["beta"] * (lp - x["logprobs"]) ** 2)


def gspo(lp: Tensor, x: Inputs, config: Mapping[str, float]) -> Tensor:
    """GSPO-token [B, T]: per datum, ``s = exp(mean over the tokens with
    sequence_ratio_mask != 0 of (sg(lp) - q))``; per token ``ratio_t = s * exp(lp_t -
    sg(lp_t))`` (the value of s, the gradient of the token's own ratio: ``s * grad lp_t``);
    then ``-min(ratio_t * A_t, clamp(ratio_t, lo, hi) * A_t)``.

    A datum with no masked token has s = 1. The clip thresholds default to 0.8 / 1.2 like
    ppo's (our choice: Tinker's GSPO defaults are not published; the GSPO paper's much
    tighter range, 1 - 3e-4 to 1 + 4e-4, can be given in the config)."""
    adv = x["advantages"]
    in_ratio = x["sequence_ratio_mask"] != 0
    count = in_ratio.sum(dim=-1).clamp(min=1)
    detached = lp.detach()
    diff = torch.where(in_ratio, detached - x["logprobs"], torch.zeros_like(lp))
    log_s = (diff.sum(dim=-1) / count).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_s.unsqueeze(-1) + (lp - detached))
    return _clipped_objective(ratio, adv, x[CLIP_LOW], x[CLIP_HIGH])


@dataclass(frozen=True, kw_only=True)
class LossFunction(LossSignature):
    """A loss of the registry: what it reads (its :class:`~jobspec.tinker_losses.LossSignature`,
    declared torch-free so that the API refuses a call the worker would) and how it computes
    (``objective``)."""

    objective: Objective


_OBJECTIVES: dict[str, Objective] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}

# The one registry of losses this server computes, in the SDK's order: each objective with
# the signature jobspec.tinker_losses declares for its name.
LOSSES: dict[str, LossFunction] = {
    name: LossFunction(
        objective=_OBJECTIVES[name],
        **{f.name: getattr(signature, f.name) for f in fields(signature)},
    )
    for name, signature in LOSS_SIGNATURES.items()
}
LOSS_FUNCTIONS: tuple[str, ...] = tuple(LOSSES)
