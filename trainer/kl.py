"""Per-token KL estimators between the policy and a frozen reference (Schulman 2020).

Notation per sampled token: ``lp = log pi_theta`` (carries the gradient), ``ref = log pi_ref``
(frozen), ``old = log pi_old`` (the policy that sampled the token, detached) and
``d = ref - lp``.

=============  =========================  ==============================================
estimator      per-token value            expected gradient when placed in the loss
=============  =========================  ==============================================
k1             ``-d``                     0 on-policy (only meaningful in the reward)
k2             ``d^2 / 2``                grad KL(pi || ref) on-policy; biased off-policy
k3             ``exp(d) - d - 1``         grad KL(ref || pi) on-policy (GRPO's original)
k3_unbiased    ``r * k3``, ``r`` per      grad KL(pi || ref) on- and off-policy
               token ``exp(lp - old)``
=============  =========================  ==============================================

Placement: in the loss the caller adds ``beta * aggregate(per_token_kl(...))``; in the reward
it subtracts :func:`kl_reward_penalty` from the sequence reward before computing advantages.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from torch import Tensor

KLEstimator = Literal["none", "k1", "k2", "k3", "k3_unbiased"]
KLPlacement = Literal["loss", "reward"]

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
KL_PLACEMENTS: tuple[str, ...] = get_args(KLPlacement)


class _StraightThroughClamp(torch.autograd.Function):
    """Forward: ``clamp(x, -bound, bound)``. Backward: the incoming gradient, unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bound: float) -> Tensor:
        return x.clamp(-bound, bound)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None]:
        return grad_output, None


def clamp_log_ratio(log_ratio: Tensor, max_log_ratio: float) -> Tensor:
    """Clamp a log-ratio to ``[-max_log_ratio, max_log_ratio]`` with a pass-through gradient.

    Why not ``torch.clamp``: its gradient is zero outside the range. For k3 that silently drops
    the ``exp(d)`` term's gradient and keeps the ``-d`` term's, so at ``d > bound`` the gradient
    points the wrong way (it pushes ``lp`` further below ``ref``). Here the value is clamped, so
    ``exp`` never overflows (float32 overflows near 88), and the gradient is the estimator's
    gradient evaluated at the boundary: the right sign, magnitude at most ``exp(bound)``. A
    custom autograd function rather than ``x + (clamp(x) - x).detach()`` so that an infinite
    input still gives a finite value instead of ``inf - inf = nan``.
    """
    if max_log_ratio <= 0:
        raise ValueError(f"max_log_ratio must be positive, got {max_log_ratio}")
    out = _StraightThroughClamp.apply(  # type: ignore[no-untyped-call,unused-ignore]
        log_ratio, float(max_log_ratio)
    )
    assert isinstance(out, Tensor)
    return out


def _k3_of(log_ratio: Tensor) -> Tensor:
    # exp(d) - d - 1 >= 0; expm1 keeps precision when d is tiny (near on-policy, where
    # exp(d) - 1 would cancel catastrophically in float32).
    return torch.expm1(log_ratio) - log_ratio


def per_token_kl(
    estimator: KLEstimator,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    old_logprobs: Tensor | None = None,
    *,
    max_log_ratio: float = 20.0,
) -> Tensor:
    """Per-token KL estimate whose autograd gradient is the estimator's.

    Args:
        estimator: one of ``none``, ``k1``, ``k2``, ``k3``, ``k3_unbiased``.
        logprobs: [B, T] ``log pi_theta`` of the sampled tokens, with gradient.
        ref_logprobs: [B, T] ``log pi_ref`` of the same tokens (treated as constant).
        old_logprobs: [B, T] ``log pi_old`` of the sampling policy (treated as constant);
            ``None`` means on-policy, i.e. ``old = logprobs.detach()``. Only k3_unbiased uses it.
        max_log_ratio: log-ratios are clamped to ``[-max_log_ratio, max_log_ratio]`` before
            ``exp`` (see :func:`clamp_log_ratio`). With the default 20, k3_unbiased is bounded
            by about ``exp(40)``, well inside float32.

    Returns:
        [B, T] per-token values (padding positions are not masked here; the caller's
        aggregation applies the mask). ``none`` returns zeros without a graph.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shape mismatch: logprobs {logprobs.shape}, ref {ref_logprobs.shape}")
    if estimator == "none":
        return torch.zeros_like(logprobs, requires_grad=False)
    ref = ref_logprobs.detach()
    d = ref - logprobs
    if estimator == "k1":
        # No exp: the value is exact and its gradient (+1 per unit of lp) is bounded.
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return _k3_of(clamp_log_ratio(d, max_log_ratio))
    if estimator == "k3_unbiased":
        old = logprobs.detach() if old_logprobs is None else old_logprobs.detach()
        if old.shape != logprobs.shape:
            raise ValueError(f"shape mismatch: logprobs {logprobs.shape}, old {old.shape}")
        # Importance weight per token, kept in the graph: its gradient r * grad(lp) is what turns
        # E_old[r * k3] into an unbiased estimate of grad KL(pi || ref).
        ratio = torch.exp(clamp_log_ratio(logprobs - old, max_log_ratio))
        return ratio * _k3_of(clamp_log_ratio(d, max_log_ratio))
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def kl_reward_penalty(per_token_kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Sequence-level KL penalty for ``placement = "reward"``: [B, T] -> [B], detached.

    Returns ``beta * sum_t mask[b, t] * kl[b, t]``, to be subtracted from the sequence reward
    before advantages are computed.

    Sum, not mean, over tokens: the KL between the sequence distributions of two
    autoregressive policies is the sum of the per-token KLs (chain rule), so the sum is the
    estimate of the quantity the penalty is meant to bound. A mean would make the penalty
    blind to length: a long completion far from the reference would cost the same as a
    short one. Note that this makes ``beta`` scale with completion length; a beta tuned for
    loss placement (where the KL is averaged) is not directly comparable.

    Args:
        per_token_kl: [B, T] values from :func:`per_token_kl` (any graph is cut).
        mask: [B, T] 1 for valid completion tokens, 0 for padding (bool or float).
        beta: KL coefficient.
    """
    if per_token_kl.shape != mask.shape:
        raise ValueError(f"shape mismatch: kl {per_token_kl.shape}, mask {mask.shape}")
    kl = per_token_kl.detach()
    valid = mask.to(kl.dtype)
    # where() rather than a product so that a non-finite value at a padding slot cannot leak.
    masked = torch.where(valid != 0, kl * valid, torch.zeros_like(kl))
    return beta * masked.sum(dim=-1)
