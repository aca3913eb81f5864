"""Clipped policy-gradient surrogate and loss aggregation over tokens and sequences.

Shapes: B sequences (completions) by T completion positions; ``mask`` [B, T] is 1 on valid
completion tokens and 0 on padding or on tokens removed from the loss (bool or 0/1 float, e.g.
the token mask times the per-sequence truncation mask from :mod:`trainer.update.shaping`).

The KL terms (the loss-side KL and the reward-side penalty's part of the advantages) are
aggregated apart from the policy's task term, with the constant normaliser of
:func:`kl_aggregate`, so that their expected gradient is exactly the estimator's under every
aggregation.

Adding an aggregation: one function here, an entry in :data:`LOSS_AGGREGATIONS`, and its name in
``jobspec.LossAggregation`` (the spec declares the names; a test checks they match).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from jobspec import LossAggregation


class SurrogateResult(NamedTuple):
    """Output of :func:`clipped_surrogate`; every field is [B, T]."""

    per_token_loss: Tensor
    """``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``, with gradient."""
    clipped_low: Tensor
    """Bool: ``ratio < 1 - eps_low`` and ``A < 0`` (the lower bound binds; no gradient)."""
    clipped_high: Tensor
    """Bool: ``ratio > 1 + eps_high`` and ``A > 0`` (the upper bound binds; no gradient)."""
    ratio: Tensor
    """Detached ``exp(clamp(lp - old))``, for metrics."""
    clamped: Tensor
    """Bool: ``|lp - old|`` exceeds ``max_log_ratio`` where the unclipped term is the one
    selected, so the clamp (not a clip bound) removed the token's gradient. Counted apart from
    the clip fractions, so that a dropped token never goes unreported."""
    dual_clipped: Tensor
    """Bool: the dual-clip cap binds (``A < 0`` and ``ratio > clip_ratio_c``; no gradient)."""
    factor: Tensor
    """The ratio term each token's loss selected, with its gradient: ``per_token_loss = -A *
    factor`` (the ratio where the unclipped term is taken, the clip bound or the dual-clip
    cap, constants, where a bound binds). :func:`surrogate_part` prices a part of ``A`` with
    it, under the clip decisions the whole ``A`` made."""


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    *,
    max_log_ratio: float = 20.0,
    clip_ratio_c: float | None = None,
) -> SurrogateResult:
    """PPO/DAPO clipped surrogate with decoupled clip bounds, per token.

    Args:
        logprobs: [B, T] ``log pi_theta`` of the sampled tokens, with gradient.
        old_logprobs: [B, T] ``log pi_old`` of the sampling policy (treated as constant).
        advantages: [B] per-sequence advantages (broadcast over tokens), or [B, T].
        eps_low, eps_high: the ratio is clipped to ``[1 - eps_low, 1 + eps_high]``
            (DAPO: 0.2 and 0.28).
        max_log_ratio: ``lp - old`` is clamped to this range before ``exp``. A plain clamp
            (zero gradient outside) is the right choice here, unlike in :mod:`trainer.update.kl`: a
            token whose probability moved by a factor above ``e^20`` within one rollout batch is
            far outside any trust region, and dropping its gradient is safer than letting a
            ``-A * e^20`` term through (the unclipped cases are ``A < 0`` with a huge ratio and
            ``A > 0`` with a vanishing one). Such tokens are reported in ``clamped``.
        clip_ratio_c: dual clip (Ye et al. 2020, as in verl): for ``A < 0`` the per-token loss
            is capped at ``-clip_ratio_c * A``, so a token whose ratio ran above
            ``clip_ratio_c`` cannot push the loss up without bound. ``None``: off. Must be > 1.

    Returns:
        :class:`SurrogateResult`. Padding positions are not masked: aggregate with the mask.
    """
    if logprobs.shape != old_logprobs.shape:
        raise ValueError(f"shape mismatch: logprobs {logprobs.shape}, old {old_logprobs.shape}")
    if eps_low < 0 or eps_high < 0 or eps_low >= 1:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    adv = advantages.detach().to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    if adv.shape[0] != logprobs.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)} do not match {logprobs.shape}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1, got {clip_ratio_c}")
    raw_log_ratio = logprobs - old_logprobs.detach()
    log_ratio = raw_log_ratio.clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - eps_low, 1.0 + eps_high
    unclipped = ratio * adv
    clipped = ratio.clamp(low, high) * adv
    per_token_loss = -torch.minimum(unclipped, clipped)
    # -min(r A, c A) = -A min(r, c) for A > 0 and -A max(r, c) for A < 0: the factor taken.
    clipped_ratio = ratio.clamp(low, high)
    factor = torch.where(
        adv > 0, torch.minimum(ratio, clipped_ratio), torch.maximum(ratio, clipped_ratio)
    )
    dual_clipped = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_ratio_c is not None:
        cap = -clip_ratio_c * adv  # positive where A < 0
        dual_clipped = ((adv < 0) & (per_token_loss > cap)).detach()
        per_token_loss = torch.where(dual_clipped, cap.expand_as(per_token_loss), per_token_loss)
        factor = torch.where(dual_clipped, torch.full_like(factor, clip_ratio_c), factor)
    with torch.no_grad():
        # The clipped term is selected (and the gradient vanishes) exactly in these cases.
        clipped_low = (ratio < low) & (adv < 0)
        clipped_high = (ratio > high) & (adv > 0)
        # The unclipped term is selected but its ratio sits on the clamp: zero gradient that no
        # clip bound explains (a dual-clipped token is already accounted for).
        clamped = (
            ((raw_log_ratio > max_log_ratio) & (adv < 0))
            | ((raw_log_ratio < -max_log_ratio) & (adv > 0))
        ) & ~dual_clipped
    return SurrogateResult(
        per_token_loss, clipped_low, clipped_high, ratio.detach(), clamped, dual_clipped, factor
    )


def surrogate_part(surrogate: SurrogateResult, advantages: Tensor) -> Tensor:
    """The per-token loss [B, T] of a part of the advantages (``advantages`` [B] or [B, T])
    under the clip decisions :func:`clipped_surrogate` made for the whole: ``-A_part * factor``.

    The parts of a split advantage (the task's and the reward-side KL penalty's) sum to
    ``per_token_loss`` and can each be aggregated with a normaliser of its own
    (:func:`kl_aggregate` for the KL part), while the trust region stays the whole update's.
    """
    adv = advantages.detach().to(surrogate.factor.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    return -adv * surrogate.factor


def _masked(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``values * mask`` with padding forced to 0 (so NaN/inf there cannot leak), and the mask
    as the values' dtype."""
    if values.shape != mask.shape:
        raise ValueError(f"shape mismatch: values {values.shape}, mask {mask.shape}")
    m = mask.to(values.dtype)
    return torch.where(m != 0, values * m, torch.zeros_like(values)), m


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is non-zero ([B, T] -> scalar, or
    reduced over ``dim``). An empty selection gives 0, not NaN."""
    masked, m = _masked(values, mask)
    if dim is None:
        return masked.sum() / _nonzero(m.sum())
    return masked.sum(dim=dim) / _nonzero(m.sum(dim=dim))


def valid_counts(mask: Tensor) -> tuple[float, float]:
    """(valid tokens, sequences with at least one valid token) of a [B, T] mask.

    These are the denominators :func:`aggregate` uses by default. A caller that splits a batch
    into micro-batches sums them over the whole batch and passes them as ``total_tokens`` /
    ``total_sequences`` to every micro-batch call.
    """
    m = mask.to(torch.float64)
    return float(m.sum().item()), float((m.sum(dim=-1) > 0).sum().item())


class AggregationFn(Protocol):
    """One aggregation: masked values [B, T] (0 at padding) and mask [B, T] as the values' dtype
    -> scalar. ``total_tokens`` / ``total_sequences`` are the global denominators of a
    micro-batched call (None: this batch's own); see :func:`aggregate`."""

    def __call__(
        self,
        masked: Tensor,
        mask: Tensor,
        *,
        max_completion_len: int,
        total_tokens: float | Tensor | None,
        total_sequences: float | Tensor | None,
    ) -> Tensor: ...


def _over_sequences(
    per_seq: Tensor, mask: Tensor, total_sequences: float | Tensor | None
) -> Tensor:
    """Mean of per-sequence values [B] over the sequences with at least one valid token."""
    n_seq = (mask.sum(dim=-1) > 0).sum() if total_sequences is None else total_sequences
    return per_seq.sum() / _nonzero(n_seq, per_seq)


def _token_mean(
    masked: Tensor,
    mask: Tensor,
    *,
    max_completion_len: int,
    total_tokens: float | Tensor | None,
    total_sequences: float | Tensor | None,
) -> Tensor:
    """DAPO: ``sum_i sum_t x_it / sum_i |o_i|``. [B, T] -> scalar."""
    denom = mask.sum() if total_tokens is None else total_tokens
    return masked.sum() / _nonzero(denom, masked)


def _seq_mean_token_mean(
    masked: Tensor,
    mask: Tensor,
    *,
    max_completion_len: int,
    total_tokens: float | Tensor | None,
    total_sequences: float | Tensor | None,
) -> Tensor:
    """GRPO: ``(1/N) sum_i (1/|o_i|) sum_t x_it``. [B, T] -> scalar."""
    per_seq = masked.sum(dim=-1) / _nonzero(mask.sum(dim=-1))
    return _over_sequences(per_seq, mask, total_sequences)


def _seq_mean_token_sum_norm(
    masked: Tensor,
    mask: Tensor,
    *,
    max_completion_len: int,
    total_tokens: float | Tensor | None,
    total_sequences: float | Tensor | None,
) -> Tensor:
    """Dr. GRPO: ``(1/N) sum_i (1/max_completion_len) sum_t x_it``. [B, T] -> scalar."""
    if max_completion_len <= 0:
        raise ValueError(f"max_completion_len must be positive, got {max_completion_len}")
    per_seq = masked.sum(dim=-1) / float(max_completion_len)
    return _over_sequences(per_seq, mask, total_sequences)


# Keys must equal jobspec.LossAggregation (tests/trainer/test_registries.py).
LOSS_AGGREGATIONS: dict[LossAggregation, AggregationFn] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: LossAggregation,
    *,
    max_completion_len: int,
    total_tokens: float | Tensor | None = None,
    total_sequences: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token values [B, T] to a scalar loss with the aggregation named ``mode``.

    Modes (``|o_i|`` = number of valid tokens of sequence i, ``N`` = number of sequences):

    - ``token_mean`` (DAPO): ``sum_i sum_t x_it / sum_i |o_i|``. Every token weighs the same,
      so long completions are not down-weighted.
    - ``seq_mean_token_mean`` (GRPO): ``(1/N) sum_i (1/|o_i|) sum_t x_it``.
    - ``seq_mean_token_sum_norm`` (Dr. GRPO): ``(1/N) sum_i (1/max_completion_len) sum_t x_it``;
      dividing by a constant removes GRPO's length bias.

    ``N`` counts only sequences with at least one valid token: a completion removed from the
    loss entirely (e.g. truncated, with masking on) does not dilute the others. Such a sequence
    contributes 0, never NaN; an all-padding batch gives 0.

    Micro-batching: splitting the batch by rows and calling this per micro-batch with the
    GLOBAL ``total_tokens`` / ``total_sequences`` (see :func:`valid_counts`) makes the sum of
    the micro-batch results equal the full-batch value. ``total_tokens`` is only used by
    ``token_mean``; ``total_sequences`` by the two ``seq_mean`` modes.
    """
    fn = LOSS_AGGREGATIONS.get(mode)
    if fn is None:
        raise ValueError(
            f"unknown aggregation {mode!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}"
        )
    masked, m = _masked(values, mask)
    return fn(
        masked,
        m,
        max_completion_len=max_completion_len,
        total_tokens=total_tokens,
        total_sequences=total_sequences,
    )


def kl_aggregate(values: Tensor, mask: Tensor, *, max_completion_len: int, rows: float) -> Tensor:
    """The KL part of the loss: ``sum_i sum_t x_it / (rows * max_completion_len)`` over the
    sampled tokens ``mask`` [B, T] of ``values`` [B, T] -> scalar, WHATEVER aggregation the
    policy's task part uses.

    Why a constant normaliser: the estimators' stated gradients (``trainer.update.kl``, and the
    reward-side penalty's ``beta * grad KL_seq``) hold for ``E[sum_t grad x_t]`` per sampled
    completion. A weight per token that depends on the samples (``1 / tokens of the batch``
    for ``token_mean``, ``1 / |o_i|`` for ``seq_mean_token_mean``) multiplies each completion's
    term by a random factor correlated with it, and the expectation is no longer a multiple of
    that gradient (4-24% off on a 2-token enumeration). Dividing by ``rows`` (the step's
    nominal rows, not the rows that happened to be kept) times ``max_completion_len`` keeps it
    exactly ``grad / max_completion_len`` per completion (tests/trainer/update/test_kl_exact.py).
    Micro-batches pass the same ``rows``, so their results sum to the whole batch's.
    """
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    return aggregate(
        values,
        mask,
        "seq_mean_token_sum_norm",
        max_completion_len=max_completion_len,
        total_sequences=rows,
    )


def _nonzero(denominator: float | Tensor, like: Tensor | None = None) -> Tensor:
    """The denominator as a tensor (on ``like``'s device and dtype when given), with 0 replaced
    by 1: the numerator is then 0 too, so an empty selection gives 0 rather than NaN."""
    if like is None:
        assert isinstance(denominator, Tensor)
        d = denominator
    else:
        d = torch.as_tensor(denominator, dtype=like.dtype, device=like.device)
    return torch.where(d != 0, d, torch.ones_like(d))
