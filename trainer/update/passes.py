"""The minibatched clipped policy-gradient updates of one GRPO step, and the guard that skips
non-finite ones.

Shapes: B completions in the step's batch, T = the longest completion (right padding),
micro-batches of at most ``micro_batch_size`` rows are re-padded to their own widths.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainer.config import GRPOSpec
from trainer.errors import NonFiniteLossError
from trainer.models.memory import release_free_memory
from trainer.models.precision import autocast
from trainer.update import kl as kl_math
from trainer.update import losses
from trainer.update.logprobs import completion_logprobs
from trainer.update.sampler_correction import correction_weights
from trainer.update.step import Batch, by_length, derive_seed, micro_inputs

__all__ = ["NON_FINITE_LIMIT", "NonFiniteGuard", "PreUpdate", "UpdateStats", "run_updates"]

NON_FINITE_LIMIT = 3

EventFn = Callable[..., None]


class NonFiniteGuard:
    """Skips updates whose loss or gradient norm is not finite; ``limit`` in a row is fatal."""

    def __init__(self, on_event: EventFn, limit: int = NON_FINITE_LIMIT, streak: int = 0) -> None:
        self.on_event = on_event
        self.limit = limit
        self.streak = streak
        self.skipped = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when the update may be applied; raises NonFiniteLossError at the limit."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak = 0
            return True
        self.streak += 1
        self.skipped += 1
        message = (
            f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
            f"update skipped ({self.streak} in a row)"
        )
        self.on_event(
            "non_finite",
            message,
            level="warning",
            data={"step": step, "loss": str(loss), "grad_norm": str(grad_norm)},
        )
        if self.streak >= self.limit:
            raise NonFiniteLossError(
                f"{self.streak} updates in a row had a non-finite loss or gradient norm "
                f"(last at step {step}); stopping"
            )
        return False


@dataclass
class UpdateStats:
    policy_loss: float = 0.0  # mean over applied-or-skipped updates of the aggregated loss
    kl_loss: float = 0.0  # mean over updates of beta * aggregated KL (loss placement only)
    # Fractions of the loss tokens of the updates that could clip: every update but the first
    # of a step, whose policy still equals pi_old (ratio 1 up to rounding). NaN when the step
    # had no other update (one iteration, one minibatch): not reported rather than a 0 that
    # reads like "nothing clipped".
    clip_low: float = 0.0  # the lower bound 1 - eps_low binds (A < 0)
    clip_high: float = 0.0  # the upper bound 1 + eps_high binds (A > 0)
    clip_dual: float = 0.0  # the dual-clip cap binds (A < 0, ratio > clip_ratio_c)
    clamped: float = 0.0  # gradient lost to the +-20 log-ratio clamp, no bound binding
    grad_norm: float = 0.0  # mean pre-clip norm over the applied updates (NaN if none)
    updates: int = 0
    skipped: int = 0


@dataclass
class PreUpdate:
    """Trainer-side values of the sampled tokens before any optimizer step, for metrics."""

    logprobs: Tensor  # [B, T]
    entropy: Tensor | None  # [B, T]


@dataclass
class _MicroResult:
    policy: float
    kl: float
    clipped_low: float  # loss tokens where the lower clip binds
    clipped_high: float
    clipped_dual: float
    clamped: float
    tokens: float  # loss tokens
    logprobs: Tensor  # [b, t] detached
    entropy: Tensor | None  # [b, t]


def _micro_step(
    model: nn.Module,
    batch: Batch,
    rows: list[int],
    advantages: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    *,
    spec: GRPOSpec,
    totals: tuple[float, float],
    pad_id: int,
    with_entropy: bool,
) -> _MicroResult:
    """Forward and backward of one micro-batch; gradients accumulate into the model.

    ``totals`` are the GLOBAL (tokens, sequences) counts of the minibatch, so that the
    micro-batch losses sum to the loss of the whole minibatch.
    """
    device = batch.mask.device
    ids, att, p_width, t_width = micro_inputs(batch, rows, pad_id, device)
    # Autocast covers the forward pass only; backward runs each op in its forward's dtype.
    with autocast(spec.dtype, device):
        lp, ent = completion_logprobs(
            model, ids, att, p_width, temperature=spec.temperature, with_entropy=with_entropy
        )
    lp = lp.float()
    index = torch.tensor(rows, device=device)
    loss_mask = batch.loss_mask[index, :t_width]
    old = lp.detach() if old_logprobs is None else old_logprobs[index, :t_width]
    surrogate = losses.clipped_surrogate(
        lp, old, advantages[index], spec.eps_low, spec.eps_high, clip_ratio_c=spec.clip_ratio_c
    )

    per_token_policy = surrogate.per_token_loss
    correction = spec.sampler_correction
    if batch.engine_logprobs is not None and correction.mode != "none":
        # The engine sampled, the trainer scores: weight by pi_old / pi_sampler (capped).
        weights = correction_weights(
            old, batch.engine_logprobs[index, :t_width], loss_mask, correction.mode, correction.cap
        ).weights
        per_token_policy = per_token_policy * weights

    def agg(values: Tensor) -> Tensor:
        return losses.aggregate(
            values,
            loss_mask,
            spec.loss_aggregation,
            max_completion_len=spec.max_new_tokens,
            total_tokens=totals[0],
            total_sequences=totals[1],
        )

    policy = agg(per_token_policy)
    loss = policy
    kl_value = 0.0
    kl_spec = spec.kl
    if kl_spec.active and kl_spec.placement == "loss" and ref_logprobs is not None:
        per_token = kl_math.per_token_kl(
            kl_spec.estimator,
            lp,
            ref_logprobs[index, :t_width],
            None if old_logprobs is None else old,
            mask=loss_mask,
        )
        kl_term = kl_spec.beta * agg(per_token)
        loss = loss + kl_term
        kl_value = float(kl_term.detach())
    loss.backward()
    valid = loss_mask > 0
    return _MicroResult(
        policy=float(policy.detach()),
        kl=kl_value,
        clipped_low=float((surrogate.clipped_low & valid).sum()),
        clipped_high=float((surrogate.clipped_high & valid).sum()),
        clipped_dual=float((surrogate.dual_clipped & valid).sum()),
        clamped=float((surrogate.clamped & valid).sum()),
        tokens=float(valid.sum()),
        logprobs=lp.detach(),
        entropy=None if ent is None else ent.float(),
    )


def run_updates(
    model: nn.Module,
    optimizer: Optimizer,
    batch: Batch,
    advantages: Tensor,
    *,
    spec: GRPOSpec,
    step: int,
    seed: int,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    pad_id: int,
    guard: NonFiniteGuard,
    collect_pre_update: bool,
) -> tuple[UpdateStats, PreUpdate | None]:
    """``num_iterations`` passes of minibatched updates over the batch.

    ``old_logprobs`` None means on-policy with a single update (one iteration, one minibatch):
    then old = the logprobs of the update's own forward pass, detached. ``advantages`` is [B].
    With ``collect_pre_update`` (only valid in that on-policy case, where every forward pass runs
    before the optimizer step) the pass's logprobs and entropies come back for the metrics.
    Minibatches are a seeded random split of the batch, redrawn every iteration.
    """
    device = batch.mask.device
    mini = spec.mini_batch_size or batch.size
    if old_logprobs is None and (spec.num_iterations > 1 or mini < batch.size):
        raise ValueError("old_logprobs are required with several updates per batch")
    params = [p for p in model.parameters() if p.requires_grad]
    pre_lp = torch.zeros(batch.size, batch.width, device=device) if collect_pre_update else None
    pre_ent = torch.zeros(batch.size, batch.width, device=device) if collect_pre_update else None

    stats = UpdateStats()
    # Token counts of the updates that could clip: [low, high, dual, clamped, loss tokens].
    counts = [0.0] * 5
    norms: list[float] = []
    model.train()
    generator = torch.Generator().manual_seed(derive_seed(seed, step, 7))
    for iteration in range(spec.num_iterations):
        order = list(range(batch.size))
        if mini < batch.size:
            order = torch.randperm(batch.size, generator=generator).tolist()
        for mb_start in range(0, batch.size, mini):
            mb_rows = by_length(batch, order[mb_start : mb_start + mini])
            totals = losses.valid_counts(batch.loss_mask[mb_rows])
            policy_sum = kl_sum = 0.0
            optimizer.zero_grad(set_to_none=True)
            for start in range(0, len(mb_rows), spec.micro_batch_size):
                rows = mb_rows[start : start + spec.micro_batch_size]
                first_pass = pre_lp is not None and iteration == 0
                res = _micro_step(
                    model,
                    batch,
                    rows,
                    advantages,
                    old_logprobs,
                    ref_logprobs,
                    spec=spec,
                    totals=totals,
                    pad_id=pad_id,
                    with_entropy=first_pass,
                )
                release_free_memory()  # this micro-batch's activations, before the next
                policy_sum += res.policy
                kl_sum += res.kl
                if stats.updates > 0:  # the step's first update runs at ratio 1: cannot clip
                    counts[0] += res.clipped_low
                    counts[1] += res.clipped_high
                    counts[2] += res.clipped_dual
                    counts[3] += res.clamped
                    counts[4] += res.tokens
                if first_pass and pre_lp is not None and pre_ent is not None:
                    t_width = res.logprobs.shape[1]
                    pre_lp[rows, :t_width] = res.logprobs
                    if res.entropy is not None:
                        pre_ent[rows, :t_width] = res.entropy
            norm = float(torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm))
            stats.updates += 1
            stats.policy_loss += policy_sum
            stats.kl_loss += kl_sum
            if guard.check(step, policy_sum + kl_sum, norm):
                optimizer.step()
                norms.append(norm)
            else:
                stats.skipped += 1
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    if stats.updates:
        stats.policy_loss /= stats.updates
        stats.kl_loss /= stats.updates
    tokens = counts[4]
    frac = [c / tokens if tokens else float("nan") for c in counts[:4]]
    stats.clip_low, stats.clip_high, stats.clip_dual, stats.clamped = frac
    stats.grad_norm = sum(norms) / len(norms) if norms else float("nan")
    pre = PreUpdate(pre_lp, pre_ent) if pre_lp is not None else None
    return stats, pre
