"""The policy (and a full fine-tune's reference) as FSDP2 shards over the job's ranks.

Each decoder layer is one FSDP unit (its parameters gathered just before its forward and freed
after), then the whole model (embeddings, final norm, output head, tied weights together).
FSDP averages the gradients over the ranks, but the trainer's loss is already normalised by the
global token or sequence count of the minibatch (the rank losses add up to the one-process
loss): the update scales each rank's backward by the world size (:func:`backward_scale`), or
the step on two ranks would be half the one-process step (../shared/environment.md measured
it). A divide factor of 1 would say the same, but FSDP applies it with a pre-multiplied sum,
which gloo does not have.

Start-up order (docs/scaling.md): the policy is loaded in host memory, rank 0's weights are
broadcast (:func:`broadcast_module`: FSDP2 does not, and equal seeds are a convention, not a
guarantee: a LoRA adapter's random init or a caller's model could differ), and only then does
:func:`shard_model` place it: ``fully_shard`` moves one FSDP unit at a time onto the mesh's
device and keeps this rank's shard of it, so the device never holds the whole float32 policy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from trainer.distributed.world import World

__all__ = [
    "backward_scale",
    "broadcast_module",
    "decoder_layers",
    "full_value",
    "gradient_sync",
    "mesh_for",
    "shard_model",
]


def mesh_for(world: World, device_type: str) -> DeviceMesh:
    """A one-dimensional mesh over every rank (data-parallel sharding)."""
    return init_device_mesh(device_type, (world.size,))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face causal LM: modules whose class the model declares
    as not to be split (``_no_split_modules``), else those named ``*DecoderLayer``/``*Block``."""
    declared: set[str] = set()
    for module in model.modules():
        declared.update(getattr(module, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in declared]
    if found:
        return found
    return [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))]


def broadcast_module(model: nn.Module, world: World, device: torch.device) -> None:
    """Give every rank rank 0's parameters and buffers, in place, one tensor at a time and in
    ``state_dict`` order (the same on every rank). Each tensor travels through ``device``
    (NCCL broadcasts device tensors only), so at most one tensor is there at a time; call it
    on the unsharded host model, before :func:`shard_model`."""
    if not world.distributed:
        return
    tensors = [*model.parameters(), *model.buffers()]
    with torch.no_grad(), world.phase("setup"):
        for tensor in tensors:
            moved = tensor.detach().to(device)
            dist.broadcast(moved, src=0)
            if moved.data_ptr() != tensor.data_ptr():
                tensor.detach().copy_(moved)


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` in place (per decoder layer, then the root); returns it. Frozen
    parameters (a LoRA base) are sharded too and get no gradient. ``fully_shard`` moves each
    unit's tensors onto the mesh's device as it shards them: a host model arrives there one
    unit at a time, as shards."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def backward_scale(model: nn.Module, world_size: int) -> float:
    """What a rank's loss is multiplied by before its backward so that FSDP's averaged
    gradient is the sum over ranks: the world size for a sharded model, else 1."""
    return float(world_size) if isinstance(model, FSDPModule) else 1.0


def gradient_sync(model: nn.Module, *, last: bool) -> None:
    """Reduce-scatter gradients in the minibatch's last micro-batch's backward only: FSDP2's
    ``set_requires_gradient_sync(False)`` keeps the earlier ones' gradients unsharded on each
    rank, accumulating, and the last backward reduces their sum once (one reduce-scatter per
    minibatch instead of one per micro-batch). The price is unsharded float32 gradients on
    every rank during the accumulation (4 bytes a trainable parameter: docs/scaling.md). A
    model without the switch (one process) is left alone."""
    switch = getattr(model, "set_requires_gradient_sync", None)
    if callable(switch):
        switch(last)


def full_value(value: Tensor) -> Tensor:
    """A (possibly sharded) tensor whole: a DTensor gathered (a collective: every rank calls
    it, in the same order), anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value
