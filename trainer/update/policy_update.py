"""The minibatched clipped policy-gradient updates of one GRPO step, and the guard that skips
non-finite ones.

Shapes: B completions in the step's batch, T = the longest completion (right padding),
micro-batches of at most ``micro_batch_size`` rows are re-padded to their own widths.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from jobspec import GRPOSpec
from trainer.distributed.sharding import backward_scale, full_value, gradient_sync
from trainer.distributed.world import World
from trainer.errors import NonFiniteLossError
from trainer.models.memory import release_free_memory
from trainer.models.precision import autocast
from trainer.seeding import derive_seed
from trainer.update import kl as kl_math
from trainer.update import losses
from trainer.update.batch import Batch, by_length, micro_inputs
from trainer.update.logprobs import completion_logprobs
from trainer.update.sampler_correction import correction_weights

__all__ = [
    "NON_FINITE_LIMIT",
    "ClipCounts",
    "NonFiniteGuard",
    "PreUpdate",
    "UpdateInputs",
    "UpdateStats",
    "run_updates",
]

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
class UpdateInputs:
    """What one step's update works on: the model and its optimizer, the step's batch with its
    advantages and scored logprobs, and the step's place in the run.

    ``old_logprobs`` None means on-policy with a single update (one iteration, one minibatch):
    then old = the logprobs of the update's own forward pass, detached. With
    ``collect_pre_update`` (only valid in that on-policy case, where every forward pass runs
    before the optimizer step) the pass's logprobs and entropies come back for the metrics.
    """

    model: nn.Module
    optimizer: Optimizer
    batch: Batch
    advantages: Tensor  # [B]
    old_logprobs: Tensor | None  # [B, T]
    ref_logprobs: Tensor | None  # [B, T]
    pad_id: int
    guard: NonFiniteGuard
    step: int
    seed: int
    collect_pre_update: bool = False
    # [B] the reward-side KL penalty's part of ``advantages`` (None: no KL in the reward);
    # aggregated apart from the task's part (see _micro_losses).
    kl_advantages: Tensor | None = None
    # The job's ranks: the batch is this rank's share, and the token counts, losses and clip
    # counts are summed over the ranks (FSDP sums the gradients).
    world: World = field(default_factory=World)


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
    inputs: UpdateInputs,
    rows: list[int],
    *,
    spec: GRPOSpec,
    totals: tuple[float, float],
    with_entropy: bool,
) -> _MicroResult:
    """Forward and backward of one micro-batch; gradients accumulate into the model.

    ``totals`` are the GLOBAL (tokens, sequences) counts of the minibatch's task rows, so that
    the micro-batch losses sum to the loss of the whole minibatch.
    """
    batch, old_logprobs = inputs.batch, inputs.old_logprobs
    device = batch.mask.device
    ids, att, p_width, t_width = micro_inputs(batch, rows, inputs.pad_id, device)
    # Autocast covers the forward pass only; backward runs each op in its forward's dtype.
    with autocast(spec.dtype, device):
        lp, ent = completion_logprobs(
            inputs.model, ids, att, p_width, temperature=spec.temperature, with_entropy=with_entropy
        )
    lp = lp if lp.dtype == torch.float64 else lp.float()  # float64 stays (exact tests)
    index = torch.tensor(rows, device=device)
    old = lp.detach() if old_logprobs is None else old_logprobs[index, :t_width].to(lp.dtype)
    surrogate = losses.clipped_surrogate(
        lp,
        old,
        inputs.advantages[index],
        spec.eps_low,
        spec.eps_high,
        clip_ratio_c=spec.clip_ratio_c,
    )
    parts = _micro_losses(inputs, index, t_width, lp, old, surrogate, spec=spec, totals=totals)
    loss = parts.policy if parts.kl is None else parts.policy + parts.kl
    (loss * backward_scale(inputs.model, inputs.world.size)).backward()
    valid = batch.loss_mask[index, :t_width] > 0
    return _MicroResult(
        policy=float(parts.policy.detach()),
        kl=0.0 if parts.kl is None else float(parts.kl.detach()),
        clipped_low=float((surrogate.clipped_low & valid).sum()),
        clipped_high=float((surrogate.clipped_high & valid).sum()),
        clipped_dual=float((surrogate.dual_clipped & valid).sum()),
        clamped=float((surrogate.clamped & valid).sum()),
        tokens=float(valid.sum()),
        logprobs=lp.detach(),
        entropy=None if ent is None else ent.float(),
    )


@dataclass
class _Losses:
    policy: Tensor  # scalar: the task's part (the job's aggregation) + the reward KL's part
    kl: Tensor | None  # scalar: beta * the loss-side KL (None: not in the loss)


def _micro_losses(
    inputs: UpdateInputs,
    index: Tensor,
    t_width: int,
    lp: Tensor,
    old: Tensor,
    surrogate: losses.SurrogateResult,
    *,
    spec: GRPOSpec,
    totals: tuple[float, float],
) -> _Losses:
    """A micro-batch's loss terms from its logprobs ``lp`` [b, t] and surrogate.

    The task's part is aggregated as the job says (``loss_aggregation``, over the task rows'
    ``loss_mask``). The KL parts (the reward-side penalty's share of the advantages, priced
    under the whole advantage's clip decisions, and the loss-side KL) are aggregated over every
    sampled token with the constant normaliser of ``losses.kl_aggregate``: any other weight
    per token depends on the samples and biases their expected gradient."""
    batch = inputs.batch
    loss_mask = batch.loss_mask[index, :t_width]
    kl_mask = batch.mask[index, :t_width]
    weights = None
    correction = spec.sampler_correction
    if batch.engine_logprobs is not None and correction.mode != "none":
        # The engine sampled, the trainer scores: weight by pi_old / pi_sampler (capped). Over
        # the sampled tokens: the task's mask differs only on rows it leaves out whole.
        engine = batch.engine_logprobs[index, :t_width].to(lp.dtype)
        weights = correction_weights(old, engine, kl_mask, correction.mode, correction.cap).weights

    def weighted(values: Tensor) -> Tensor:
        return values if weights is None else values * weights

    def kl_agg(values: Tensor) -> Tensor:
        return losses.kl_aggregate(
            values, kl_mask, max_completion_len=spec.max_new_tokens, rows=spec.kl_normaliser_rows
        )

    task_part = surrogate.per_token_loss
    kl_adv = inputs.kl_advantages
    if kl_adv is not None:
        task_part = losses.surrogate_part(surrogate, inputs.advantages[index] - kl_adv[index])
    policy = losses.aggregate(
        weighted(task_part),
        loss_mask,
        spec.loss_aggregation,
        max_completion_len=spec.max_new_tokens,
        total_tokens=totals[0],
        total_sequences=totals[1],
    )
    if kl_adv is not None:
        policy = policy + kl_agg(weighted(losses.surrogate_part(surrogate, kl_adv[index])))
    kl_term = None
    if spec.kl.in_loss and inputs.ref_logprobs is not None:
        per_token = kl_math.per_token_kl(
            spec.kl.estimator,
            lp,
            inputs.ref_logprobs[index, :t_width].to(lp.dtype),
            None if inputs.old_logprobs is None else old,
            mask=kl_mask,
        )
        kl_term = spec.kl.beta * kl_agg(per_token)
    return _Losses(policy=policy, kl=kl_term)


@dataclass
class ClipCounts:
    """Loss tokens of a step's updates that could clip (every update but the first, which runs
    at ratio 1), by what removed their gradient, and the loss tokens themselves."""

    low: float = 0.0  # the lower bound 1 - eps_low binds (A < 0)
    high: float = 0.0  # the upper bound 1 + eps_high binds (A > 0)
    dual: float = 0.0  # the dual-clip cap binds
    clamped: float = 0.0  # the +-20 log-ratio clamp, no bound binding
    tokens: float = 0.0  # loss tokens

    def add(self, res: _MicroResult) -> None:
        self.low += res.clipped_low
        self.high += res.clipped_high
        self.dual += res.clipped_dual
        self.clamped += res.clamped
        self.tokens += res.tokens

    def fractions(self, world: World) -> tuple[float, float, float, float]:
        """(low, high, dual, clamped) over the loss tokens of every rank; NaN without any."""
        low, high, dual, clamped, tokens = world.sum_floats(
            [self.low, self.high, self.dual, self.clamped, self.tokens], "update"
        )
        if not tokens:
            return (float("nan"),) * 4
        return low / tokens, high / tokens, dual / tokens, clamped / tokens


class _Pre:
    """The pre-update logprobs and entropies being collected ([B, T] each), when asked for."""

    def __init__(self, batch: Batch, collect: bool) -> None:
        shape, device = (batch.size, batch.width), batch.mask.device
        self.logprobs = torch.zeros(*shape, device=device) if collect else None
        self.entropy = torch.zeros(*shape, device=device) if collect else None

    def record(self, rows: list[int], res: _MicroResult) -> None:
        if self.logprobs is None or self.entropy is None:
            return
        t_width = res.logprobs.shape[1]
        self.logprobs[rows, :t_width] = res.logprobs
        if res.entropy is not None:
            self.entropy[rows, :t_width] = res.entropy

    def result(self) -> PreUpdate | None:
        return PreUpdate(self.logprobs, self.entropy) if self.logprobs is not None else None


def _minibatch(
    inputs: UpdateInputs,
    mb_rows: list[int],
    *,
    spec: GRPOSpec,
    stats: UpdateStats,
    counts: ClipCounts,
    pre: _Pre | None,
) -> tuple[float, float]:
    """Forward and backward of one minibatch, micro-batch by micro-batch; the gradients
    accumulate (the caller steps the optimizer). Adds the clip counts of an update that could
    clip to ``counts`` and records the pre-update values into ``pre`` (the first iteration's
    passes, when collected); returns the minibatch's (policy loss, KL loss)."""
    local = losses.valid_counts(inputs.batch.loss_mask[mb_rows])
    tokens, sequences = inputs.world.sum_floats(list(local), "update")
    totals = (tokens, sequences)
    policy_sum = kl_sum = 0.0
    starts = range(0, len(mb_rows), spec.micro_batch_size)
    for start in starts:
        rows = mb_rows[start : start + spec.micro_batch_size]
        gradient_sync(inputs.model, last=start == starts[-1])
        res = _micro_step(inputs, rows, spec=spec, totals=totals, with_entropy=pre is not None)
        release_free_memory()  # this micro-batch's activations, before the next
        policy_sum += res.policy
        kl_sum += res.kl
        if stats.updates > 0:  # the step's first update runs at ratio 1: cannot clip
            counts.add(res)
        if pre is not None:
            pre.record(rows, res)
    return policy_sum, kl_sum


def run_updates(inputs: UpdateInputs, spec: GRPOSpec) -> tuple[UpdateStats, PreUpdate | None]:
    """``num_iterations`` passes of minibatched updates over ``inputs.batch`` (see
    :class:`UpdateInputs`). Minibatches are a seeded random split of the batch, redrawn every
    iteration."""
    batch, model, optimizer, world = inputs.batch, inputs.model, inputs.optimizer, inputs.world
    # The minibatch is split over the ranks like the batch (the spec makes it divide evenly).
    mini = spec.mini_batch_size // world.size if spec.mini_batch_size else batch.size
    if inputs.old_logprobs is None and (spec.num_iterations > 1 or mini < batch.size):
        raise ValueError("old_logprobs are required with several updates per batch")
    params = [p for p in model.parameters() if p.requires_grad]
    pre = _Pre(batch, inputs.collect_pre_update)

    stats = UpdateStats()
    counts = ClipCounts()
    norms: list[float] = []
    model.train()
    generator = torch.Generator().manual_seed(derive_seed(inputs.seed, inputs.step, 7))
    for iteration in range(spec.num_iterations):
        order = list(range(batch.size))
        if mini < batch.size:
            order = torch.randperm(batch.size, generator=generator).tolist()
        for mb_start in range(0, batch.size, mini):
            mb_rows = by_length(batch, order[mb_start : mb_start + mini])
            optimizer.zero_grad(set_to_none=True)
            first_pass = pre.logprobs is not None and iteration == 0
            policy_sum, kl_sum = _minibatch(
                inputs,
                mb_rows,
                spec=spec,
                stats=stats,
                counts=counts,
                pre=pre if first_pass else None,
            )
            # The norm of the whole gradient: FSDP's shards reduce it over the ranks.
            norm = float(full_value(torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)))
            # Each rank's loss is its share of the global one (normalised by global counts).
            policy_sum, kl_sum = world.sum_floats([policy_sum, kl_sum], "update")
            stats.updates += 1
            stats.policy_loss += policy_sum
            stats.kl_loss += kl_sum
            if inputs.guard.check(inputs.step, policy_sum + kl_sum, norm):
                optimizer.step()
                norms.append(norm)
            else:
                stats.skipped += 1
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    if stats.updates:
        stats.policy_loss /= stats.updates
        stats.kl_loss /= stats.updates
    stats.clip_low, stats.clip_high, stats.clip_dual, stats.clamped = counts.fractions(world)
    stats.grad_norm = sum(norms) / len(norms) if norms else float("nan")
    return stats, pre.result()
