"""The policy (and a full fine-tune's reference) as FSDP2 shards over the job's ranks.

Each decoder layer is one FSDP unit (its parameters gathered just before its forward and freed
after), then the whole model (embeddings, final norm, output head, tied weights together).
FSDP averages the gradients over the ranks, but the trainer's loss is already normalised by the
global token or sequence count of the minibatch (the rank losses add up to the one-process
loss): the update scales each rank's backward by the world size (:func:`backward_scale`), or
the step on two ranks would be half the one-process step (../shared/environment.md measured
it). A divide factor of 1 would say the same, but FSDP applies it with a pre-multiplied sum,
which gloo does not have.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from trainer.distributed.world import World

__all__ = ["backward_scale", "decoder_layers", "full_value", "mesh_for", "shard_model"]


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


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` in place (per decoder layer, then the root); returns it. Frozen parameters (a LoRA base) are sharded too and get no gradient."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def backward_scale(model: nn.Module, world_size: int) -> float:
    """What a rank's loss is multiplied by before its backward so that FSDP's averaged
    gradient is the sum over ranks: the world size for a sharded model, else 1."""
    return float(world_size) if isinstance(model, FSDPModule) else 1.0


def full_value(value: Tensor) -> Tensor:
    """A (possibly sharded) tensor whole: a DTensor gathered (a collective: every rank calls
    it, in the same order), anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value
