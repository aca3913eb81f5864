"""``optim_step``: one AdamW step with the hyperparameters of this call.

Tinker sends every Adam parameter with every step (the cookbook decays the learning rate
step by step), so the optimizer is a plain ``torch.optim.AdamW`` whose group settings are
overwritten before each step: the step is exactly torch's (decoupled weight decay, bias
correction by the parameter's own step count). Weight decay applies to every trainable
tensor; a session trains LoRA adapters, all matrices, so
``trainer.update.optim.decay_groups``'s matrices-only rule would select them all anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

from trainer.primitives.types import PrimitiveError

__all__ = ["AdamParams", "adam_step", "new_optimizer"]


@dataclass(frozen=True)
class AdamParams:
    """One step's settings, as the SDK's ``AdamParams`` names them. ``grad_clip_norm`` > 0
    scales the gradients down to that global norm first (torch's ``clip_grad_norm_``); 0
    leaves them."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def check(self) -> None:
        """PrimitiveError naming the first setting out of its range."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PrimitiveError(f"adam_params.{f.name}: expected a number")
            if not math.isfinite(value) or value < 0:
                raise PrimitiveError(
                    f"adam_params.{f.name}: must be a finite number >= 0, got {value}"
                )
        for name in ("beta1", "beta2"):
            if getattr(self, name) >= 1:
                raise PrimitiveError(
                    f"adam_params.{name}: must be below 1, got {getattr(self, name)}"
                )


def new_optimizer(params: list[nn.Parameter]) -> torch.optim.AdamW:
    """AdamW over ``params``, one group; its settings are set by each :func:`adam_step`."""
    return torch.optim.AdamW(params, lr=0.0)


def adam_step(optimizer: torch.optim.Optimizer, settings: AdamParams) -> tuple[float, bool]:
    """Apply the accumulated gradients with ``settings``, then clear them.

    Returns ``(grad_norm, applied)``: the global gradient norm before clipping, and whether
    the step ran. A non-finite norm skips the step (the parameters and Adam's moments stay as
    they were; a NaN would otherwise poison both for good) and the gradients are cleared all
    the same, so the next call starts clean. Parameters without a gradient are left alone,
    as torch's AdamW leaves them."""
    settings.check()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
    norm = float(total)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, False
    if settings.grad_clip_norm > 0 and grads:
        # What clip_grad_norm_ does, with the norm already at hand.
        torch.nn.utils.clip_grads_with_norm_(params, settings.grad_clip_norm, total)
    for group in optimizer.param_groups:
        group["lr"] = settings.learning_rate
        group["betas"] = (settings.beta1, settings.beta2)
        group["eps"] = settings.eps
        group["weight_decay"] = settings.weight_decay
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, True
