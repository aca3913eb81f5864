"""How much memory one device of a job holds, from the model's shape and the job's spec.

Torch-free: the API answers it before a job queues (``POST /v1/jobs/validate``; a 422 at create
when it does not fit). Bytes per device, for N devices: weights, gradients, optimizer state,
the KL reference, the rollout engine (weights and KV cache) and the activations of one
micro-batch; each term, and what it counts, is :mod:`jobspec.memory_terms`'s.

A GPU's sleeping vLLM engine frees its memory in the update: the peak is the larger of rollout
(state + engine) and update (state + gradients + activations); otherwise they add. An async
job's rollout server never sleeps (it generates the next steps while the trainer updates): its
engine and the update always add, on rank 0's device, where the server runs.

Start-up also needs host memory: each rank loads the policy there in float32 and builds a full
fine-tune's reference from it before anything reaches the device (docs/scaling.md, "Start-up
order and memory per rank"); :attr:`MemoryPlan.host_memory_per_rank` counts it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobspec.memory_terms import (
    GIB,
    HEAD_CHUNK_ELEMENTS,
    HF_GENERATE_ROWS,
    KV_HEADROOM,
    PlanInputs,
    activation_bytes,
    engine_bytes,
    frozen_bytes,
    head_chunk_rows,
    largest_micro_batch,
    whole_gradients,
)
from jobspec.model_shape import Accelerator, ModelShape

if TYPE_CHECKING:
    from jobspec.job import JobSpec

__all__ = [
    "DEFAULT_SAFETY",
    "HEAD_CHUNK_ELEMENTS",
    "HF_GENERATE_ROWS",
    "KV_HEADROOM",
    "MemoryPlan",
    "PlanInputs",
    "Suggestion",
    "activation_bytes",
    "auto_micro_batch_size",
    "gib",
    "head_chunk_rows",
    "host_bytes_per_rank",
    "plan_memory",
    "refusal",
    "resolve_micro_batch",
]

DEFAULT_SAFETY = 0.9  # allocator fragmentation, the CUDA context, the process itself


@dataclass(frozen=True)
class Suggestion:
    """A change of the spec that makes the job fit, with the plan's total under it."""

    change: dict[str, Any]
    description: str
    total: int

    def as_dict(self) -> dict[str, Any]:
        return {"change": self.change, "description": self.description, "total": self.total}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device; ``total`` is the peak (module docstring)."""

    devices: int
    micro_batch_size: int  # the plan's (the job's, or what "auto" chose)
    micro_batch_auto: bool
    parameters: int
    trainable_parameters: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    engine_weights: int
    kv_cache: int
    activations: int
    total: int
    device_memory: int
    safety: float
    host_memory_per_rank: int = 0  # at start-up, before the device (module docstring)
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def engine(self) -> int:
        return self.engine_weights + self.kv_cache

    @property
    def usable(self) -> int:
        return int(self.device_memory * self.safety)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def parts(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "reference": self.reference,
            "engine": self.engine,
            "activations": self.activations,
        }

    def as_dict(self) -> dict[str, Any]:
        """The plan as the API answers it (bytes)."""
        return {
            "devices": self.devices,
            "micro_batch_size": self.micro_batch_size,
            "micro_batch_auto": self.micro_batch_auto,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "per_device": {**self.parts(), "kv_cache": self.kv_cache},
            "total": self.total,
            "device_memory": self.device_memory,
            "usable": self.usable,
            "fits": self.fits,
            "host_memory_per_rank": self.host_memory_per_rank,
            "host_memory": self.host_memory_per_rank * self.devices,
            "suggestions": [s.as_dict() for s in self.suggestions],
        }

    def summary(self) -> str:
        """One line naming the numbers: the total against the device, the biggest parts."""
        biggest = sorted(self.parts().items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{name} {gib(size)}" for name, size in biggest if size)
        return (
            f"needs {gib(self.total)} per device ({parts}); the worker's device has "
            f"{gib(self.device_memory)}, {self.safety:.0%} usable ({gib(self.usable)})"
        )


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def auto_micro_batch_size(
    shape: ModelShape, inputs: PlanInputs, *, device_memory: int, safety: float = DEFAULT_SAFETY
) -> int:
    """``grpo.micro_batch_size: auto``: from ``inputs.micro_batch_size`` (a power of two)
    down, halving, the first whose plan fits ``device_memory``; 1 when none does (the plan
    then does not fit and says what would)."""
    micro = inputs.micro_batch_size
    while micro > 1:
        changed = inputs.replace(micro_batch_size=micro, micro_batch_auto=False)
        if _peak(_plan_parts(shape, changed, device_memory), changed) <= device_memory * safety:
            return micro
        micro //= 2
    return 1


def resolve_micro_batch(
    spec: JobSpec, shape: ModelShape, *, device_memory: int, accelerator: Accelerator
) -> int:
    """The rows per forward/backward pass of ``spec``'s update on a device of
    ``device_memory`` bytes: ``grpo.micro_batch_size``, or what ``auto`` chooses there (the
    one rule: the API's plan and the trainer's start-up both call it)."""
    if spec.grpo.micro_batch_setting != "auto":
        return spec.grpo.micro_batch_setting
    inputs = PlanInputs.from_spec(spec, accelerator)
    return auto_micro_batch_size(shape, inputs, device_memory=device_memory)


def _plan_parts(shape: ModelShape, inputs: PlanInputs, device_memory: int) -> dict[str, int]:
    n = inputs.devices
    lora = inputs.lora_rank is not None
    trainable = (
        shape.lora_parameters(inputs.lora_rank or 0, inputs.lora_targets)
        if lora
        else shape.parameters
    )
    frozen = frozen_bytes(shape, inputs.training_dtype) if lora else 0
    reference = frozen_bytes(shape, inputs.training_dtype) if inputs.kl_active and not lora else 0
    engine_weights, kv_cache = engine_bytes(shape, inputs)
    # Several devices reduce-scatter gradients once per minibatch: while its micro-batches
    # accumulate, each device holds the whole float32 gradients (trainer.distributed.sharding.
    # gradient_sync), not its shard.
    accumulates = whole_gradients(
        devices=n, update_rows=inputs.update_rows, micro_batch_size=inputs.micro_batch_size
    )
    return {
        "trainable": trainable,
        "weights": math.ceil((4 * trainable + frozen) / n),
        "gradients": 4 * trainable if accumulates else math.ceil(4 * trainable / n),
        "optimizer": math.ceil(8 * trainable / n),
        "reference": math.ceil(reference / n),
        "engine_weights": engine_weights,
        "kv_cache": kv_cache,
        "activations": activation_bytes(shape, inputs, device_memory),
    }


def host_bytes_per_rank(shape: ModelShape, inputs: PlanInputs) -> int:
    """Host memory one rank holds at start-up (``trainer.run.setup``): the policy loaded in
    float32 (every rank loads it whole, then shards it), plus a full fine-tune's KL reference,
    built from it in host memory in its own dtype. 48 GB at Qwen2.5-7B in bfloat16 with the
    KL on, times the ranks on one machine."""
    lora = inputs.lora_rank is not None
    reference = frozen_bytes(shape, inputs.training_dtype) if inputs.kl_active and not lora else 0
    return 4 * shape.parameters + reference


def _peak(parts: dict[str, int], inputs: PlanInputs) -> int:
    """The state that stays, plus the larger phase (module docstring)."""
    state = parts["weights"] + parts["optimizer"] + parts["reference"]
    update = parts["gradients"] + parts["activations"]
    engine = parts["engine_weights"] + parts["kv_cache"]
    if inputs.async_rollouts:
        return state + engine + update  # the server generates while the trainer updates
    sleeps = inputs.engine_holds_weights and inputs.accelerator == "cuda" and inputs.sleep_mode
    if sleeps:
        return state + max(engine, update)
    if not inputs.engine_holds_weights:
        # Its KV cache lives while it generates, not during the update.
        return state + parts["engine_weights"] + max(parts["kv_cache"], update)
    return state + engine + update


def plan_memory(
    shape: ModelShape,
    inputs: PlanInputs,
    *,
    device_memory: int,
    safety: float = DEFAULT_SAFETY,
    max_devices: int = 8,
    suggest: bool = True,
) -> MemoryPlan:
    """Bytes per device of a job on ``inputs.devices`` devices of ``device_memory`` bytes each
    (at the micro-batch ``auto`` chooses, :func:`auto_micro_batch_size`, when the job asks);
    when it does not fit and ``suggest``, the changes that would (each planned again)."""
    planned = inputs
    if inputs.micro_batch_auto:
        micro = auto_micro_batch_size(shape, inputs, device_memory=device_memory, safety=safety)
        planned = inputs.replace(micro_batch_size=micro)
    parts = _plan_parts(shape, planned, device_memory)
    plan = MemoryPlan(
        devices=inputs.devices,
        micro_batch_size=planned.micro_batch_size,
        micro_batch_auto=inputs.micro_batch_auto,
        parameters=shape.parameters,
        trainable_parameters=parts["trainable"],
        weights=parts["weights"],
        gradients=parts["gradients"],
        optimizer=parts["optimizer"],
        reference=parts["reference"],
        engine_weights=parts["engine_weights"],
        kv_cache=parts["kv_cache"],
        activations=parts["activations"],
        total=_peak(parts, planned),
        device_memory=device_memory,
        safety=safety,
        host_memory_per_rank=host_bytes_per_rank(shape, planned),
    )
    if plan.fits or not suggest:
        return plan
    found = suggestions(shape, inputs, device_memory, safety=safety, max_devices=max_devices)
    return dataclasses.replace(plan, suggestions=found)


def _candidates(
    inputs: PlanInputs, max_devices: int
) -> list[tuple[dict[str, Any], str, PlanInputs]]:
    out: list[tuple[dict[str, Any], str, PlanInputs]] = []
    if inputs.training_dtype == "float32":
        # bfloat16 mixed precision: float32 master weights still, but a LoRA job's frozen base
        # and a full fine-tune's reference in bfloat16, and bfloat16 matmul outputs (the
        # engine's dtype stays as planned).
        bf16 = inputs.replace(training_dtype="bfloat16")
        out.append(({"grpo.dtype": "bfloat16"}, "bfloat16 training", bf16))
    for rank in (16, 8):
        if inputs.lora_rank is None or inputs.lora_rank > rank:
            change = {"lora.rank": rank}
            out.append((change, f"LoRA rank {rank}", inputs.replace(lora_rank=rank)))
    for n in range(inputs.devices + 1, max_devices + 1):
        if inputs.device_divisor and inputs.device_divisor % n:
            continue
        change = {"resources.devices": n}
        more = inputs.replace(devices=n)
        if inputs.micro_batch_auto:  # auto chooses again from its largest on n devices
            more = more.replace(micro_batch_size=largest_micro_batch(inputs.update_rows, n))
        out.append((change, f"{n} devices", more))
    # auto has tried every smaller micro-batch already
    micro = 0 if inputs.micro_batch_auto else inputs.micro_batch_size // 2
    while micro >= 1:
        change = {"grpo.micro_batch_size": micro}
        out.append((change, f"micro_batch_size {micro}", inputs.replace(micro_batch_size=micro)))
        micro //= 2
    return out


def suggestions(
    shape: ModelShape,
    inputs: PlanInputs,
    device_memory: int,
    *,
    safety: float = DEFAULT_SAFETY,
    max_devices: int = 8,
) -> list[Suggestion]:
    """Single changes that fit: bfloat16 training (from float32), LoRA (rank 16, rank 8), the
    fewest devices, the largest smaller micro-batch; one of each kind, each planned again."""
    found: dict[str, Suggestion] = {}
    for change, description, changed in _candidates(inputs, max_devices):
        kind = next(iter(change))
        if kind in found:
            continue
        plan = plan_memory(
            shape, changed, device_memory=device_memory, safety=safety, suggest=False
        )
        if plan.fits:
            found[kind] = Suggestion(change, description, plan.total)
    return list(found.values())


def refusal(plan: MemoryPlan) -> tuple[str, list[dict[str, Any]]]:
    """The 422's message and details for a plan that does not fit: the numbers, then each
    change that would fit."""
    fixes = [
        {
            "param": param,
            "value": value,
            "message": f"{s.description}: {gib(s.total)} per device",
        }
        for s in plan.suggestions
        for param, value in s.change.items()
    ]
    would = "; ".join(f"{f['param']}: {f['value']}" for f in fixes)
    message = f"the job does not fit the worker's device: it {plan.summary()}"
    message += f". These would fit: {would}" if fixes else ". No single change found fits"
    return message, fixes
