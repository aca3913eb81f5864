"""The KL reference model: what the policy was when the run started, frozen.

Full fine-tuning keeps a frozen copy (in the training dtype, ``trainer.models.precision``). LoRA needs
no copy: the base weights never change, so the reference is the policy itself with its adapters
switched off (``trainer.models.lora``), which saves a whole model's memory.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn

from jobspec import TrainingDtype
from trainer.models.lora import adapters_disabled, is_lora
from trainer.models.precision import frozen_reference

__all__ = ["Reference", "reference_for"]


@dataclass(frozen=True)
class Reference:
    """The module to score reference log-probabilities with, and the context to do it in."""

    model: nn.Module
    shares_policy: bool  # True for LoRA: ``model`` is the policy, adapters off in ``scope``

    def scope(self) -> Any:
        return adapters_disabled(self.model) if self.shares_policy else nullcontext()


def reference_for(policy: nn.Module, dtype: TrainingDtype) -> Reference:
    """The reference of ``policy`` as it is now (call before any update or checkpoint load)."""
    if is_lora(policy):
        return Reference(policy, shares_policy=True)
    return Reference(frozen_reference(policy, dtype), shares_policy=False)
