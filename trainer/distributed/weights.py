"""Whole weights out of a sharded policy: the rank's mirror, an unsharded copy that its rollout
engine and the checkpoints read.

:meth:`Mirror.refresh` gathers every tensor of the sharded policy (``full_tensor()``, one at a
time, in ``state_dict`` order, which is the same on every rank) into the mirror, and only then
does a rank talk to its engine. Interleaving gathers with engine calls ties the ranks' progress
to the engines' (one rank's engine asking for a tensor its peers have not gathered yet is the
deadlock TRL and open-instruct hit); gathering first keeps the collectives in lockstep whatever
the engines do. Every gather runs under the world's timeout, in phase ``sync``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from trainer.distributed.sharding import full_value
from trainer.distributed.world import World

__all__ = ["Mirror"]


class Mirror:
    """An unsharded copy of the policy on this rank (the same module structure, LoRA wrappers
    included), kept equal to the sharded policy by :meth:`refresh`."""

    def __init__(self, policy: nn.Module, world: World, device: torch.device) -> None:
        """Copy ``policy`` BEFORE it is sharded, onto ``device``: the host for an engine that
        loads its weights from tensors handed to it (vLLM), so that the copy costs no device
        memory; the policy's device for one that generates with the module itself."""
        self.model = copy.deepcopy(policy).to(device).eval().requires_grad_(False)
        self.world = world
        self.fresh = True

    def mark_stale(self) -> None:
        """The policy changed (an optimizer step): the next :meth:`ensure_fresh` gathers."""
        self.fresh = False

    def refresh(self, sharded: nn.Module) -> None:
        """Gather every tensor of ``sharded`` into the mirror (every rank calls this)."""
        target = self.model.state_dict()
        with torch.no_grad(), self.world.phase("sync"):
            for name, value in sharded.state_dict().items():
                target[name].copy_(full_value(value).to(target[name].device))
        self.fresh = True

    def ensure_fresh(self, sharded: nn.Module) -> None:
        if not self.fresh:
            self.refresh(sharded)
