"""``grpo.micro_batch_size: auto`` resolved once, at a run's start, on the device it trains on.

The rule is the memory plan's (:func:`jobspec.memory_plan.resolve_micro_batch`: the largest
power of two, at most the completions a device trains per update, whose plan fits), so the
worker chooses what ``POST /v1/jobs/validate`` showed when its device has the memory the API
planned for (``GRPO_WORKER_DEVICE_MEMORY_GIB``). Here the device is the one the run has: a
CUDA device's total memory, else the host's (:func:`device_memory`); on several ranks the
smallest choice of any rank, so that every rank runs the same number of passes (FSDP's
collectives pair them up). The run then works with a spec whose ``grpo.micro_batch_size`` is
that number: every reader of it (the update, the scoring passes, the engine's colocation)
takes ``GRPOSpec.micro_batch_size``, an int.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from jobspec import JobSpec
from jobspec.memory_plan import gib, resolve_micro_batch
from jobspec.model_shape import Accelerator, ModelShape, UnsupportedConfig, host_memory
from trainer.distributed.world import World
from trainer.errors import TrainerError

__all__ = ["MicroBatchNotResolved", "device_memory", "resolve_run_micro_batch"]

EventFn = Callable[..., None]


class MicroBatchNotResolved(TrainerError):
    """``grpo.micro_batch_size: auto`` for a model whose shape the memory plan cannot read."""

    reason = "micro_batch_not_resolved"


def device_memory(device: torch.device) -> int:
    """Bytes of ``device``: a CUDA device's total memory, else the host's (what the API's plan
    uses on a worker without ``GRPO_WORKER_DEVICE_MEMORY_GIB``)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return host_memory()


def _shape_of(model: nn.Module) -> ModelShape:
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise MicroBatchNotResolved(
            f"grpo.micro_batch_size auto needs the model's config; {type(model).__name__} has "
            "none: set a number"
        )
    try:
        return ModelShape.from_config(to_dict())
    except UnsupportedConfig as exc:
        raise MicroBatchNotResolved(
            f"grpo.micro_batch_size auto cannot plan this model ({exc}): set a number"
        ) from exc


def resolve_run_micro_batch(
    config: JobSpec, model: nn.Module, device: torch.device, world: World, on_event: EventFn
) -> JobSpec:
    """``config`` with ``grpo.micro_batch_size`` a number: as it is when the job set one,
    else what ``auto`` chooses for ``model`` on ``device`` (the smallest over the ranks), said
    in a ``config`` event."""
    grpo = config.grpo
    if grpo.micro_batch_setting != "auto":
        return config
    memory = device_memory(device)
    accelerator: Accelerator = "cuda" if device.type == "cuda" else "cpu"
    chosen = resolve_micro_batch(
        config, _shape_of(model), device_memory=memory, accelerator=accelerator
    )
    chosen = int(world.all_reduce(torch.tensor([chosen]), "setup", op="min")[0])
    on_event(
        "config",
        f"micro_batch_size auto: {chosen} completions per forward/backward pass (the largest "
        f"whose memory plan fits {gib(memory)} of {accelerator} memory)",
        data={"micro_batch_size": chosen, "device_memory": memory},
    )
    resolved = grpo.model_copy(update={"micro_batch_setting": chosen})
    return config.model_copy(update={"grpo": resolved})
