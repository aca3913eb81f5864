"""The trainer and vLLM on one GPU: how much of the device the engine may take, and when it
sleeps.

vLLM's ``gpu_memory_utilization`` is a fraction of the device's TOTAL memory that the engine
may use for everything it holds (weights, activations, KV cache), and vLLM refuses to start
when less than that is free. The trainer places its policy (and reference) first, so the share
has to come from what is free then, less what the update will still allocate (gradients,
optimizer state on the first step, activations):

    share = (free - update_reserve) * (1 - margin) / total

A share below :data:`MIN_ENGINE_SHARE` means the job does not fit on this device; that is an
error naming the fix (a smaller micro-batch, LoRA, or ``rollout.gpu_memory_utilization``), not
a vLLM crash at start-up. ``rollout.gpu_memory_utilization`` overrides the derived share.

An async job's rollout server (``trainer.rollout.rollout_server``, rank 0's device) takes its
share by the same rule, decided once the trainer is placed (``trainer.run.setup``): it never
sleeps, since it generates the next steps while the trainer updates, so the update's reserve
must stay free beside it for the whole run. Without a share vLLM takes its default 0.92 of the
device and refuses to start beside any trainer that holds more than 8% of it.

Sleep mode (CUDA only: vLLM refuses it on CPU): during the update the engine releases its KV
cache (level 1 also moves the weights to host memory, level 2 drops them). The run pushes every
weight after each update anyway (merged sync), so level 2 is right then; with a LoRA adapter
hot-swap the base weights must survive, so level 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "MIN_ENGINE_SHARE",
    "Colocation",
    "engine_memory_share",
    "sleep_level",
    "trainable_params_on_rank",
    "trainable_params_whole",
    "update_reserve_bytes",
]

MIN_ENGINE_SHARE = 0.05
DEFAULT_MARGIN = 0.10  # allocator fragmentation and CUDA context: kept free
# Activations of one micro-batch, in units of (tokens x hidden x layers) elements: with
# gradient checkpointing a layer's input is kept per layer plus one layer's worth recomputed
# (~2 + the MLP's 4x intermediate); without it every intermediate of every layer (~34 for a
# Llama block in float32 is the usual estimate). Estimates, hence the margin.
ACTIVATION_FACTOR = {True: 6, False: 34}


class DoesNotFit(ValueError):
    """The trainer leaves too little of the device for the rollout engine."""


def trainable_params_on_rank(model: nn.Module) -> int:
    """The trainable parameters whose gradients and optimizer state this rank allocates: all
    of them on one rank; under FSDP this rank's shards (a DTensor's local part: its
    ``numel()`` is the whole tensor's). The update reserve is per device, so this local share
    is what it means; FSDP's transient unsharded layer during a pass counts with the
    activations' margin."""
    total = 0
    for param in model.parameters():
        if param.requires_grad:
            local = param.to_local() if isinstance(param, DTensor) else param
            total += local.numel()
    return total


def trainable_params_whole(model: nn.Module) -> int:
    """Every trainable parameter, sharded or not (a DTensor's ``numel()`` is the whole
    tensor's): the gradients a rank holds while it accumulates micro-batches under FSDP."""
    return sum(param.numel() for param in model.parameters() if param.requires_grad)


def update_reserve_bytes(
    *,
    trainable_params: int,
    micro_batch_tokens: int,
    hidden_size: int,
    layers: int,
    gradient_checkpointing: bool,
    optimizer_allocated: bool,
    gradient_params: int | None = None,
) -> int:
    """What the update still allocates once the models are placed, on one device:
    ``trainable_params`` is that device's (:func:`trainable_params_on_rank`); float32
    gradients (4 bytes a parameter of ``gradient_params``, default ``trainable_params``: the
    whole model's where a rank accumulates micro-batches before FSDP's one reduce-scatter,
    ``jobspec.memory_terms.whole_gradients``), AdamW's two float32 moments (8 bytes a
    trainable parameter, on the first step only: ``optimizer_allocated`` False), and one
    micro-batch's activations (float32)."""
    grads = 4 * (trainable_params if gradient_params is None else gradient_params)
    adam = 0 if optimizer_allocated else 8 * trainable_params
    elements = micro_batch_tokens * hidden_size * layers
    activations = 4 * elements * ACTIVATION_FACTOR[gradient_checkpointing]
    return grads + adam + activations


def engine_memory_share(
    *, total_bytes: int, free_bytes: int, reserve_bytes: int, margin: float = DEFAULT_MARGIN
) -> float:
    """vLLM's ``gpu_memory_utilization``: the fraction of the device's total memory the engine
    may take, from what is free after the trainer placed its models (module docstring).
    DoesNotFit when it would be under :data:`MIN_ENGINE_SHARE`."""
    if total_bytes <= 0 or not 0 <= margin < 1:
        raise ValueError("total_bytes must be positive and margin in [0, 1)")
    share = max(0, free_bytes - reserve_bytes) * (1 - margin) / total_bytes
    if share < MIN_ENGINE_SHARE:
        raise DoesNotFit(
            f"the trainer leaves {share:.1%} of the device for the rollout engine "
            f"({free_bytes / 2**30:.1f} GiB free, {reserve_bytes / 2**30:.1f} GiB kept for the "
            "update): use a smaller micro_batch_size, LoRA, bfloat16, or set "
            "rollout.gpu_memory_utilization"
        )
    return min(share, 0.95)


def sleep_level(lora_sync: str) -> int:
    """2 (drop the weights) when every weight is pushed after each update; 1 (keep them in host
    memory) when only an adapter is, and the base must survive the sleep."""
    return 1 if lora_sync == "adapter" else 2


@dataclass(frozen=True)
class Colocation:
    """What the run decided for its engine on this device (for its ``engine`` event)."""

    gpu_memory_utilization: float | None  # None on CPU
    derived: bool  # False when rollout.gpu_memory_utilization set it
    sleep_level: int | None  # None: no sleep mode (CPU, or turned off)
