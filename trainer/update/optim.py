"""The optimizer of a run: AdamW over the trainable parameters, with decay where it belongs.

Weight decay pulls weights towards zero. On a bias or a normalisation scale that is not a
regulariser but a drift: an RMSNorm weight decayed towards 0 shrinks its layer's output. As in
most fine-tuning code, only matrices (embeddings and linear weights, ``dim >= 2``) decay.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jobspec import GRPOSpec
from trainer.models.lora import trainable_parameters


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices with ``weight_decay``, vectors (biases, norm scales)
    without. With no decay, one group, as a plain ``AdamW(params)`` has (checkpoints written
    before the groups existed load into it unchanged)."""
    if weight_decay == 0:
        return [{"params": params, "weight_decay": 0.0}]
    matrices = [p for p in params if p.dim() >= 2]
    vectors = [p for p in params if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}]
    if vectors:
        groups.append({"params": vectors, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, spec: GRPOSpec) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (all of them, or LoRA's adapters) at
    ``spec.learning_rate``, decaying matrices only (:func:`decay_groups`)."""
    groups = decay_groups(trainable_parameters(model), spec.weight_decay)
    return torch.optim.AdamW(groups, lr=spec.learning_rate)
