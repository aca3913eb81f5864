"""Per-token KL estimators between the policy and a frozen reference (Schulman 2020).

Notation per sampled token: ``lp = log pi_theta`` (carries the gradient), ``ref = log pi_ref``
(frozen), ``old = log pi_old`` (the policy that sampled the token, detached) and
``d = ref - lp``. ``KL_t = KL(pi(.|y<t) || ref(.|y<t))`` is the KL of position t given its
prefix; ``KL_seq = KL(pi || ref)`` over whole completions, ``= E[sum_t KL_t]`` (chain rule).

Exactly what each gradient is, with ``E`` over completions sampled on-policy:

=============  ===========================  ============================================
estimator      per-token value              expected gradient of ``sum_t`` in the loss
=============  ===========================  ============================================
k1             ``-d``                       0 (``E[grad log pi] = 0``)
k2             ``d^2 / 2``                  ``sum_t E_prefix[grad KL_t]``, prefix held
                                            fixed; biased off-policy
k3             ``exp(d) - d - 1``           ``sum_t E_prefix[grad KL(ref_t || pi_t)]``,
                                            prefix held fixed (GRPO's original)
k3_unbiased    ``r * k3``, ``r`` per token  ``sum_t E_prefix[grad KL_t]``, prefix held
               ``exp(lp - old)``            fixed, on- and off-policy (the prefix then
                                            from pi_old)
k1_causal      ``-d`` (its value is k1)     ``grad KL_seq`` exactly: each token's
                                            ``grad log pi`` weighted by the detached KL
                                            still to come, ``sum_{s>=t} k1_s``
=============  ===========================  ============================================

"Prefix held fixed" is the per-position gradient: it moves each position's next-token
distribution toward the reference but ignores that changing an early token changes which
prefixes the later positions see. On one categorical (a one-token completion) it equals
``grad KL``; on longer completions it does not (Tang & Munos 2025; on the 2-token toy of
tests/trainer/update/test_kl_sequence.py the relative error to ``grad KL_seq`` is 0.3 to 0.9).
``k1_causal`` is the score-function gradient of the sequence KL,
``E[sum_t grad log pi_t * sum_{s>=t} k1_s]`` (terms with ``s < t`` have zero expectation),
which is ``grad KL_seq`` on-policy; like k2 it is biased off-policy (``num_iterations > 1``).

Placement: in the loss the caller adds ``beta * kl_aggregate(per_token_kl(...))``
(``trainer.update.losses.kl_aggregate``: a constant normaliser whatever the policy loss's
aggregation, so its expected gradient is the table's divided by ``max_new_tokens``); in the
reward the loop subtracts :func:`kl_reward_penalty`, centred, from the advantages
(``trainer.update.inputs.split_advantages``) and the update aggregates that part the same way.

In the reward the penalty acts through the policy-gradient term, ``E[penalty * grad log pi]``.
With ``penalty = sum_t k1_t = log pi(y) - log ref(y)`` that is exactly ``grad KL_seq``
(``E[grad log pi] = 0`` removes the rest), and for no other estimator here: enumeration on a
small categorical gives errors of 0.17 (k2) and 0.20 (k3, k3_unbiased). So the reward-side
penalty is always :data:`REWARD_ESTIMATOR`, whatever estimator a job names for its reported
``kl`` metric (tests/trainer/update/test_kl_reward.py enumerates every combination).

Adding an estimator: one function here, an entry in :data:`KL_ESTIMATORS`, its name in
``jobspec.KLEstimatorName`` and its exactness per placement (the table above) in
``jobspec.kl.KL_ESTIMATOR_TRAITS``, which validation's warnings read (the spec declares
the names; a test checks they match).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from jobspec import KLEstimatorName
from jobspec.kl import KL_REWARD_PENALTY


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


class KLEstimatorFn(Protocol):
    """One estimator: ([B, T] lp with gradient, [B, T] ref detached, [B, T] old or None,
    clamp bound, [B, T] mask or None) -> [B, T].

    ``old`` is passed as the caller gave it (``None`` means on-policy); estimators that use it
    detach it and check its shape themselves. ``mask`` (1 on the completion's tokens, None:
    all) matters only to an estimator that looks across positions (k1_causal).
    """

    def __call__(
        self,
        logprobs: Tensor,
        ref: Tensor,
        old: Tensor | None,
        max_log_ratio: float,
        mask: Tensor | None,
    ) -> Tensor: ...


def _none(
    logprobs: Tensor, ref: Tensor, old: Tensor | None, max_log_ratio: float, mask: Tensor | None
) -> Tensor:
    """No KL: [B, T] zeros without a graph."""
    return torch.zeros_like(logprobs, requires_grad=False)


def _k1(
    logprobs: Tensor, ref: Tensor, old: Tensor | None, max_log_ratio: float, mask: Tensor | None
) -> Tensor:
    """k1 = ``-d`` = ``lp - ref``: [B, T]."""
    # No exp: the value is exact and its gradient (+1 per unit of lp) is bounded.
    return -(ref - logprobs)


def _k2(
    logprobs: Tensor, ref: Tensor, old: Tensor | None, max_log_ratio: float, mask: Tensor | None
) -> Tensor:
    """k2 = ``d^2 / 2``: [B, T]."""
    return 0.5 * (ref - logprobs).square()


def _k3(
    logprobs: Tensor, ref: Tensor, old: Tensor | None, max_log_ratio: float, mask: Tensor | None
) -> Tensor:
    """k3 = ``exp(d) - d - 1`` with ``d`` clamped before ``exp``: [B, T]."""
    return _k3_of(clamp_log_ratio(ref - logprobs, max_log_ratio))


def _k3_unbiased(
    logprobs: Tensor, ref: Tensor, old: Tensor | None, max_log_ratio: float, mask: Tensor | None
) -> Tensor:
    """``exp(lp - old) * k3``: [B, T]; ``old`` None means on-policy (``lp`` detached)."""
    old = logprobs.detach() if old is None else old.detach()
    if old.shape != logprobs.shape:
        raise ValueError(f"shape mismatch: logprobs {logprobs.shape}, old {old.shape}")
    # Importance weight per token, kept in the graph: its gradient r * grad(lp) is what turns
    # E_old[r * k3] into an unbiased estimate of grad KL(pi || ref).
    ratio = torch.exp(clamp_log_ratio(logprobs - old, max_log_ratio))
    return ratio * _k3_of(clamp_log_ratio(ref - logprobs, max_log_ratio))


def _k1_causal(
    logprobs: Tensor, ref: Tensor, old: Tensor | None, max_log_ratio: float, mask: Tensor | None
) -> Tensor:
    """Value k1 = ``lp - ref``; gradient ``sum_{s>=t} k1_s`` per unit of ``lp_t``: [B, T].

    The value is left as k1 (so the reported ``kl`` is a KL estimate and the loss term's value
    sums to the sequence's k1); only the gradient carries the causal credit, through
    ``(lp - lp.detach()) * to_come``, which is 0 in value. Positions outside ``mask`` add
    nothing to the KL still to come.
    """
    k1 = (logprobs - ref).detach()
    if mask is not None:
        if mask.shape != logprobs.shape:
            raise ValueError(f"shape mismatch: logprobs {logprobs.shape}, mask {mask.shape}")
        k1 = torch.where(mask != 0, k1, torch.zeros_like(k1))
    to_come = k1.flip(-1).cumsum(-1).flip(-1)  # [B, T]: sum over s >= t
    return k1 + (logprobs - logprobs.detach()) * to_come


# The estimator of the reward-side penalty (see the module docstring): the only one whose
# score-function gradient is the gradient of KL(pi || ref). Declared with the estimators' traits.
REWARD_ESTIMATOR: KLEstimatorName = KL_REWARD_PENALTY

# Keys must equal jobspec.KLEstimatorName and jobspec.kl.KL_ESTIMATOR_TRAITS
# (how exact each is per placement) (tests/trainer/test_registries.py).
KL_ESTIMATORS: dict[KLEstimatorName, KLEstimatorFn] = {
    "none": _none,
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "k3_unbiased": _k3_unbiased,
    "k1_causal": _k1_causal,
}


def per_token_kl(
    estimator: KLEstimatorName,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    old_logprobs: Tensor | None = None,
    *,
    max_log_ratio: float = 20.0,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate whose autograd gradient is the estimator's.

    Args:
        estimator: a key of :data:`KL_ESTIMATORS` (``none``, ``k1``, ``k2``, ``k3``,
            ``k3_unbiased``, ``k1_causal``).
        logprobs: [B, T] ``log pi_theta`` of the sampled tokens, with gradient.
        ref_logprobs: [B, T] ``log pi_ref`` of the same tokens (treated as constant).
        old_logprobs: [B, T] ``log pi_old`` of the sampling policy (treated as constant);
            ``None`` means on-policy, i.e. ``old = logprobs.detach()``. Only k3_unbiased uses it.
        max_log_ratio: log-ratios are clamped to ``[-max_log_ratio, max_log_ratio]`` before
            ``exp`` (see :func:`clamp_log_ratio`). With the default 20, k3_unbiased is bounded
            by about ``exp(40)``, well inside float32.
        mask: [B, T] 1 on the completion's tokens (None: every position); only k1_causal,
            which sums the KL still to come along each row, reads it.

    Returns:
        [B, T] per-token values (padding positions are not masked here; the caller's
        aggregation applies the mask). ``none`` returns zeros without a graph.
    """
    fn = KL_ESTIMATORS.get(estimator)
    if fn is None:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}"
        )
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shape mismatch: logprobs {logprobs.shape}, ref {ref_logprobs.shape}")
    return fn(logprobs, ref_logprobs.detach(), old_logprobs, max_log_ratio, mask)


def kl_reward_penalty(per_token_kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Sequence-level KL penalty for ``placement = "reward"``: [B, T] -> [B], detached.

    Returns ``beta * sum_t mask[b, t] * kl[b, t]``; ``trainer.update.inputs.compute_advantages``
    centres it within its group and subtracts it from the task reward's advantages, unscaled.

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
