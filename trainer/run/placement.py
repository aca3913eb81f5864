"""Where the policy and its KL reference go once loaded in host memory (docs/scaling.md,
"Start-up order and memory per rank"): on one rank both move to the device; on several, rank
0's weights are broadcast, the mirror is taken (a meta skeleton, or for the transformers engine
a copy on the device), and the reference then the policy are sharded, ``fully_shard`` moving
one unit at a time onto the device."""

from __future__ import annotations

import torch
from torch import nn

from jobspec import JobSpec
from jobspec.traits import ROLLOUT_ENGINE_TRAITS
from trainer.distributed.sharding import broadcast_module, mesh_for, shard_model
from trainer.distributed.weights import Mirror
from trainer.distributed.world import World
from trainer.models.reference import Reference, reference_for

__all__ = ["place_policy"]


def place_policy(
    config: JobSpec, policy: nn.Module, world: World, device: torch.device
) -> tuple[Reference | None, Mirror | None]:
    """The KL reference taken from the host ``policy``, then both placed: on one rank moved to
    ``device``; on several, rank 0's weights broadcast first (before any copy is taken), the
    mirror taken, then the reference and the policy sharded. The mirror is None on one rank."""
    if not world.distributed:
        reference = _reference(config, policy)
        _to_device(device, policy, reference)
        return reference, None
    broadcast_module(policy, world, device)  # before any copy is taken of it
    reference = _reference(config, policy)
    return reference, _shard(world, device, policy, reference, _mirror_kind(config))


def _reference(config: JobSpec, model: nn.Module) -> Reference | None:
    """The KL reference: the policy as the run starts (the base model, also when resuming,
    since checkpoints are loaded after this; ``trainer.models.reference``); None when the KL is
    off."""
    if not config.grpo.kl.active:
        return None
    return reference_for(model, config.grpo.dtype)


def _mirror_kind(config: JobSpec) -> str:
    """ "lazy" (no weights held: the engine loads its own, and the sync streams to it) when the
    engine loads a folder or runs in an async job's rollout server (a process of its own, which
    loads the folder whatever its engine), else "eager" (the transformers engine generates with
    the module)."""
    if config.grpo.async_.enabled:
        return "lazy"
    return "lazy" if ROLLOUT_ENGINE_TRAITS[config.rollout.engine].loads_folder else "eager"


def _to_device(device: torch.device, policy: nn.Module, reference: Reference | None) -> None:
    """One rank: the host policy, then a separate reference (already in its dtype), to the
    device (in place: a caller's model object stays the trained one)."""
    policy.to(device)
    if reference is not None and not reference.shares_policy:
        reference.model.to(device)


def _shard(
    world: World,
    device: torch.device,
    policy: nn.Module,
    reference: Reference | None,
    mirror_kind: str,
) -> Mirror:
    """Take the mirror of the host policy (eager: on the device, for the transformers engine;
    lazy: a meta skeleton), then shard a separate reference (already in its dtype) and the
    policy over the world's ranks; ``fully_shard`` moves them to the device unit by unit. A
    LoRA reference is the policy itself."""
    if mirror_kind == "eager":
        mirror = Mirror.copy_of(policy, world, device)
    else:
        mirror = Mirror.skeleton_of(policy, world)
    mesh = mesh_for(world, device.type)
    if reference is not None and not reference.shares_policy:
        shard_model(reference.model, mesh)
    shard_model(policy, mesh)
    return mirror
