"""Truncated importance sampling for the sampler/trainer mismatch (Yao et al., 2025).

The rollout engine samples token ``y_t`` with probability ``pi_sampler`` (its own kernels, often
another dtype), while the update is computed for the trainer's ``pi_old`` of the same weights.
The two differ slightly, so the policy gradient is taken on samples of the wrong distribution.
Weighting each token's policy loss by ``w = pi_old / pi_sampler`` makes it on-policy again;
capping ``w`` at ``C`` bounds the variance a rare, badly mismatched token would add. Under
asynchronous GRPO (``grpo.async``) ``pi_sampler`` is also an older version of the weights, and
the same weights correct for it (the KL term in the loss is not weighted); which settings make
the expected update exactly the on-policy one is in docs/trainer.md
(tests/trainer/update/test_async_exact.py).

Modes (a name-keyed registry; the spec's ``SamplerCorrectionMode`` lists the same names):

=====================  ===========================================================
``token_truncate``     ``min(w_t, C)`` per token
``token_mask``         ``w_t``, or 0 (the token leaves the loss) where ``w_t > C``
``sequence_truncate``  ``min(prod_t w_t, C)`` on every token of the completion
``sequence_mask``      ``prod_t w_t``, or 0 for the whole completion where it exceeds ``C``
``none``               1 everywhere
=====================  ===========================================================

The sequence weight is exact for a sequence-level reward (the completion's probability ratio)
and has the larger variance; the token weights are what most trainers use. Log-ratios are
clamped to +-20 before ``exp``. Weights carry no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from jobspec import SamplerCorrectionMode

__all__ = ["SAMPLER_CORRECTIONS", "Correction", "correction_weights", "mismatch_metrics"]

MAX_LOG_RATIO = 20.0


class Correction(NamedTuple):
    """Per-token importance weights [B, T] (0 at padding) and where the cap acted [B, T]."""

    weights: Tensor
    capped: Tensor


def _log_ratios(trainer: Tensor, sampler: Tensor, mask: Tensor) -> Tensor:
    """[B, T] ``log pi_old - log pi_sampler``, 0 at padding, clamped before any ``exp``."""
    diff = torch.where(mask > 0, trainer.detach() - sampler.detach(), torch.zeros_like(trainer))
    return diff.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _sequence_log_ratios(log_ratio: Tensor) -> Tensor:
    """[B, T] -> [B, T]: each row's summed log-ratio, repeated on its tokens."""
    total = log_ratio.sum(dim=-1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return total.expand_as(log_ratio)


def _truncate(log_w: Tensor, cap: float) -> Correction:
    w = torch.exp(log_w)
    return Correction(w.clamp(max=cap), w > cap)


def _mask(log_w: Tensor, cap: float) -> Correction:
    w = torch.exp(log_w)
    over = w > cap
    return Correction(torch.where(over, torch.zeros_like(w), w), over)


def _none(log_ratio: Tensor, cap: float) -> Correction:
    return Correction(torch.ones_like(log_ratio), torch.zeros_like(log_ratio, dtype=torch.bool))


# mode -> ([B, T] clamped per-token log-ratios, cap) -> Correction (before padding is zeroed).
# Keys must equal jobspec.SamplerCorrectionMode (tests/trainer/test_registries.py).
SAMPLER_CORRECTIONS: dict[SamplerCorrectionMode, Callable[[Tensor, float], Correction]] = {
    "none": _none,
    "token_truncate": _truncate,
    "token_mask": _mask,
    "sequence_truncate": lambda lr, cap: _truncate(_sequence_log_ratios(lr), cap),
    "sequence_mask": lambda lr, cap: _mask(_sequence_log_ratios(lr), cap),
}


def correction_weights(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    mode: SamplerCorrectionMode,
    cap: float,
) -> Correction:
    """Importance weights of the sampled tokens.

    Args:
        trainer_logprobs: [B, T] ``log pi_old`` of the sampled tokens under the trainer.
        sampler_logprobs: [B, T] the engine's log-probabilities of the same tokens (at the
            sampling temperature).
        mask: [B, T] 1 on completion tokens, 0 on padding.
        mode: a key of :data:`SAMPLER_CORRECTIONS`.
        cap: ``C > 1``.

    Returns:
        :class:`Correction` with [B, T] weights (detached, 0 at padding) and the capped mask.
    """
    fn = SAMPLER_CORRECTIONS.get(mode)
    if fn is None:
        raise ValueError(f"unknown sampler correction {mode!r}; known: {list(SAMPLER_CORRECTIONS)}")
    if cap <= 1:
        raise ValueError(f"cap must be greater than 1, got {cap}")
    if not trainer_logprobs.shape == sampler_logprobs.shape == mask.shape:
        raise ValueError(
            f"shape mismatch: trainer {trainer_logprobs.shape}, sampler {sampler_logprobs.shape}, "
            f"mask {mask.shape}"
        )
    valid = mask > 0
    out = fn(_log_ratios(trainer_logprobs, sampler_logprobs, mask), cap)
    return Correction(
        torch.where(valid, out.weights, torch.zeros_like(out.weights)).detach(),
        out.capped & valid,
    )


def mismatch_metrics(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    mode: SamplerCorrectionMode,
    cap: float,
) -> dict[str, float]:
    """How far the sampler is from the trainer, over the valid tokens of [B, T] tensors.

    ``mismatch/kl``: the k3 estimate of KL(pi_sampler || pi_old) from the sampled tokens,
    ``r - 1 - log r`` with ``r = pi_old / pi_sampler`` (unbiased for samples of the sampler,
    never negative); ``mismatch/ratio_mean`` and ``mismatch/ratio_max`` of the per-token ``r``;
    ``mismatch/token_mult_prob_error``: the mean of ``exp(|log pi_old - log pi_sampler|)``
    = ``max(r, 1 / r)`` (NeMo-RL's measure: 1 when the two agree, a token whose probability
    differs by a factor f either way counts f, so over- and under-estimates cannot cancel as
    in ``ratio_mean``; NeMo-RL's checks keep it below 1.1); ``mismatch/capped_frac``: the share of tokens whose weight the
    cap truncated or masked under ``mode`` (0 with ``none``). Log-ratios are clamped to +-20,
    as for the weights, so every value is finite.

    With stale samples (``grpo.async``) ``pi_sampler`` is an older version: the ratios then
    hold the policy's movement since it, which the weights correct, as well as the engine's
    numeric mismatch. The async guard (``trainer.run.async_run.mismatch_guard``) therefore reads
    ``token_mult_prob_error`` only on steps without lag, and ``capped_frac`` on every step.
    """
    valid = mask > 0
    tokens = int(valid.sum())
    if tokens == 0:
        return {}
    log_r = _log_ratios(trainer_logprobs, sampler_logprobs, mask)[valid].double()
    ratio = torch.exp(log_r)
    capped = correction_weights(trainer_logprobs, sampler_logprobs, mask, mode, cap).capped
    return {
        "mismatch/kl": float((torch.expm1(log_r) - log_r).mean()),
        "mismatch/ratio_mean": float(ratio.mean()),
        "mismatch/ratio_max": float(ratio.max()),
        "mismatch/token_mult_prob_error": float(torch.exp(log_r.abs()).mean()),
        "mismatch/capped_frac": float(capped.sum()) / tokens,
    }
