"""The learning-rate schedule of a run: linear warmup, then constant, linear or cosine decay,
stepped once per training step that trained."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from jobspec import GRPOSpec

__all__ = ["lr_factor", "make_scheduler"]


def lr_factor(spec: GRPOSpec, step: int) -> float:
    """Multiplier of the base learning rate at 1-based training ``step``: linear warmup over
    ``warmup_steps`` (step k of the warmup gets k/warmup), then constant, linear or cosine decay
    that reaches its end just after the last step (so the last step still learns)."""
    warmup = spec.warmup_steps
    if warmup > 0 and step <= warmup:
        return step / warmup
    if spec.lr_schedule == "constant":
        return 1.0
    progress = (step - warmup - 1) / max(1, spec.steps - warmup)
    progress = min(max(progress, 0.0), 1.0)
    if spec.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: Optimizer, spec: GRPOSpec) -> LambdaLR:
    """Per training-step schedule: call ``scheduler.step()`` once after every step."""
    return LambdaLR(optimizer, lambda i: lr_factor(spec, i + 1))
