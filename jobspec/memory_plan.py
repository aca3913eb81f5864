"""How much memory one device of a job holds, from the model's shape and the job's spec.

Torch-free: the API answers it before a job queues (``POST /v1/jobs/validate``; a 422 at create
when it does not fit). Bytes per device, for N devices (docs/scaling.md: FSDP shards the
policy, gradients, AdamW's state and a full fine-tune's reference; each rank has its engine):

- weights: trainable parameters in float32 (master weights, under bfloat16 too), /N; a LoRA
  job's frozen base as ``trainer.models.precision.frozen_reference`` holds a frozen copy
  (float32; bfloat16 Linears under bfloat16: ``store_frozen_linears_for_autocast``), /N.
- gradients (float32) and optimizer (AdamW's two float32 moments): trainable parameters, /N
  (gradients whole where a device accumulates several micro-batches: one reduce-scatter).
- reference (KL active): a full fine-tune's frozen copy, /N; LoRA: 0 (adapters off).
- engine: vLLM holds the model in ``rollout.dtype`` on every rank and its KV cache
  (``rollout.kv_cache_gib``, else as ``trainer.rollout.startup.kv_cache_bytes`` sizes it);
  transformers generates with the policy (one device, float32: no copy), its KV cache alive
  while it generates.
- activations of one micro-batch (prompt + completion tokens): each layer's float32 input
  (checkpointing; without it every layer's intermediates), one layer recomputed with its
  gradients and attention scores, the head's [rows, vocab] float32 chunk and temporaries.

A GPU's sleeping vLLM engine frees its memory in the update: the peak is the larger of rollout
(state + engine) and update (state + gradients + activations); otherwise they add.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobspec.model_shape import Accelerator, ModelShape

if TYPE_CHECKING:
    from jobspec.job import JobSpec

__all__ = [
    "DEFAULT_SAFETY",
    "MemoryPlan",
    "PlanInputs",
    "Suggestion",
    "plan_memory",
    "refusal",
]

GIB = 1 << 30
DEFAULT_SAFETY = 0.9  # allocator fragmentation, the CUDA context, the process itself
KV_HEADROOM, HF_GENERATE_ROWS = 1.25, 64  # read by the trainer too, as HEAD_CHUNK_ELEMENTS
HEAD_CHUNK_ELEMENTS = 1 << 24
HEAD_TEMPORARIES = 4  # logits, log-softmax, their gradient, the recomputation (colocation)
# One decoder layer recomputed in the backward pass: what its backward saves, per token, in
# units of hidden_size (the two norms' inputs and outputs, q, the rotated q, the attention
# output, o_proj's output and the residual; k and v are smaller, grouped heads) and of
# intermediate_size (gate, up, the activation and the product). Checked against measured CPU
# peaks (tests/trainer/test_memory_plan_peak.py).
LAYER_HIDDEN_FACTOR = 10
LAYER_INTERMEDIATE_FACTOR = 4
_ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class PlanInputs:
    """What of a job's spec (and its worker) decides its memory."""

    devices: int = 1
    training_dtype: str = "float32"
    lora_rank: int | None = None
    lora_targets: list[str] | str = "all-linear"
    kl_active: bool = False
    engine: str = "vllm"
    engine_holds_weights: bool = True  # vLLM: its own copy and a KV cache allocated up front
    rollout_dtype: str = "float32"
    kv_cache_gib: float | None = None
    sleep_mode: bool = True
    micro_batch_size: int = 16
    update_rows: int = 64  # completions per optimizer update (over every device)
    sequence_tokens: int = 384
    completion_tokens: int = 128
    rollout_sequences: int = 64
    gradient_checkpointing: bool = True
    accelerator: Accelerator = "cpu"
    # A devices count N is allowed when it divides this (prompts_per_step, mini_batch_size;
    # 1 for an agentic job, which trains on one device).
    device_divisor: int = 0

    @classmethod
    def from_spec(cls, spec: JobSpec, accelerator: Accelerator = "cpu") -> PlanInputs:
        from jobspec.grpo import rollout_dtype
        from jobspec.traits import ROLLOUT_ENGINE_TRAITS

        grpo, rollout, dataset = spec.grpo, spec.rollout, spec.dataset
        eval_rows = 0
        if dataset.holdout:
            eval_rows = min(spec.eval.max_rows, dataset.holdout)
        elif dataset.validation_file_id is not None:
            eval_rows = spec.eval.max_rows
        return cls(
            devices=spec.resources.devices,
            training_dtype=grpo.dtype,
            lora_rank=spec.lora.rank if spec.lora is not None else None,
            lora_targets=spec.lora.target_modules if spec.lora is not None else "all-linear",
            kl_active=grpo.kl.active,
            engine=rollout.engine,
            engine_holds_weights=ROLLOUT_ENGINE_TRAITS[rollout.engine].sizes_kv_cache,
            rollout_dtype=rollout_dtype(rollout.dtype, grpo.dtype, accelerator),
            kv_cache_gib=rollout.kv_cache_gib,
            sleep_mode=rollout.sleep_mode,
            micro_batch_size=grpo.micro_batch_size,
            update_rows=grpo.mini_batch_size or grpo.completions_per_step,
            sequence_tokens=grpo.sequence_tokens,
            completion_tokens=grpo.max_new_tokens,
            rollout_sequences=max(grpo.completions_per_step, eval_rows),
            gradient_checkpointing=grpo.gradient_checkpointing,
            accelerator=accelerator,
            device_divisor=1
            if spec.is_agentic
            else math.gcd(grpo.prompts_per_step, grpo.mini_batch_size or grpo.prompts_per_step),
        )

    def replace(self, **changes: Any) -> PlanInputs:
        return dataclasses.replace(self, **changes)


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
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "per_device": {**self.parts(), "kv_cache": self.kv_cache},
            "total": self.total,
            "device_memory": self.device_memory,
            "usable": self.usable,
            "fits": self.fits,
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


def _frozen_bytes(shape: ModelShape, dtype: str) -> int:
    """A frozen full copy: float32, or bfloat16 Linear weights of the decoder and the rest
    float32 (``trainer.models.precision.frozen_reference``)."""
    if dtype == "float32":
        return 4 * shape.parameters
    linear = shape.linear_parameters
    return _ITEMSIZE[dtype] * linear + 4 * (shape.parameters - linear)


def _vllm_kv_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    if inputs.kv_cache_gib is not None:
        return int(inputs.kv_cache_gib * GIB)
    block = 128 if inputs.accelerator == "cpu" else 16
    blocks = inputs.rollout_sequences * math.ceil(inputs.sequence_tokens / block)
    per_token = shape.kv_bytes_per_token(_ITEMSIZE[inputs.rollout_dtype])
    return math.ceil(blocks * block * per_token * KV_HEADROOM)


def _engine_bytes(shape: ModelShape, inputs: PlanInputs) -> tuple[int, int]:
    """(engine weights, KV cache) on each device."""
    itemsize = _ITEMSIZE[inputs.rollout_dtype]
    if inputs.engine_holds_weights:
        return itemsize * shape.parameters, _vllm_kv_bytes(shape, inputs)
    own_copy = inputs.devices > 1 or inputs.rollout_dtype != "float32"
    rows = min(HF_GENERATE_ROWS, inputs.rollout_sequences)
    kv = rows * inputs.sequence_tokens * shape.kv_bytes_per_token(itemsize)
    return (itemsize * shape.parameters if own_copy else 0), kv


def head_chunk_rows(shape: ModelShape, inputs: PlanInputs, device_memory: int) -> int:
    """Rows of the output head's chunk (``trainer.rollout.colocation.head_chunk_rows_for``)."""
    vocab = max(1, shape.vocab_size)
    if inputs.accelerator == "cpu":
        rows = max(16, HEAD_CHUNK_ELEMENTS // vocab)
    else:
        rows = max(16, min(8192, math.floor(device_memory * 0.05 / (16 * vocab))))
    return min(rows, inputs.micro_batch_size * inputs.completion_tokens)


def activation_bytes(shape: ModelShape, inputs: PlanInputs, device_memory: int) -> int:
    """One micro-batch's forward and backward (module docstring)."""
    tokens = inputs.micro_batch_size * inputs.sequence_tokens
    inner = _ITEMSIZE[inputs.training_dtype]  # autocast's matmul outputs
    h, i = shape.hidden_size, shape.intermediate_size
    layer = tokens * (LAYER_HIDDEN_FACTOR * h + LAYER_INTERMEDIATE_FACTOR * i) * inner
    # Attention probabilities and their gradient (CPU's SDPA materialises them; on a GPU the
    # fused kernels do not).
    scores = 0
    if inputs.accelerator == "cpu":
        per_row = shape.num_attention_heads * inputs.sequence_tokens**2
        scores = 2 * inputs.micro_batch_size * per_row * 4
    residual = tokens * h * 4  # the float32 residual stream between layers
    if inputs.gradient_checkpointing:
        decoder = shape.num_hidden_layers * residual + layer + scores
    else:
        decoder = shape.num_hidden_layers * (residual + layer + scores)
    rows = head_chunk_rows(shape, inputs, device_memory)
    head = HEAD_TEMPORARIES * rows * shape.vocab_size * 4 + 2 * residual
    return decoder + head


def _plan_parts(shape: ModelShape, inputs: PlanInputs, device_memory: int) -> dict[str, int]:
    n = inputs.devices
    lora = inputs.lora_rank is not None
    trainable = (
        shape.lora_parameters(inputs.lora_rank or 0, inputs.lora_targets)
        if lora
        else shape.parameters
    )
    frozen = _frozen_bytes(shape, inputs.training_dtype) if lora else 0
    reference = _frozen_bytes(shape, inputs.training_dtype) if inputs.kl_active and not lora else 0
    engine_weights, kv_cache = _engine_bytes(shape, inputs)
    # Several devices reduce-scatter gradients once per minibatch: while its micro-batches
    # accumulate, each device holds the whole float32 gradients (trainer.distributed.sharding.
    # gradient_sync), not its shard.
    accumulates = n > 1 and inputs.update_rows > n * inputs.micro_batch_size
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


def _peak(parts: dict[str, int], inputs: PlanInputs) -> int:
    """The state that stays, plus the larger phase (module docstring)."""
    state = parts["weights"] + parts["optimizer"] + parts["reference"]
    update = parts["gradients"] + parts["activations"]
    engine = parts["engine_weights"] + parts["kv_cache"]
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
    """Bytes per device of a job on ``inputs.devices`` devices of ``device_memory`` bytes each;
    when it does not fit and ``suggest``, the changes that would (each planned again)."""
    parts = _plan_parts(shape, inputs, device_memory)
    plan = MemoryPlan(
        devices=inputs.devices,
        parameters=shape.parameters,
        trainable_parameters=parts["trainable"],
        weights=parts["weights"],
        gradients=parts["gradients"],
        optimizer=parts["optimizer"],
        reference=parts["reference"],
        engine_weights=parts["engine_weights"],
        kv_cache=parts["kv_cache"],
        activations=parts["activations"],
        total=_peak(parts, inputs),
        device_memory=device_memory,
        safety=safety,
    )
    if plan.fits or not suggest:
        return plan
    found = suggestions(shape, inputs, device_memory, safety=safety, max_devices=max_devices)
    return dataclasses.replace(plan, suggestions=found)


def _candidates(
    inputs: PlanInputs, max_devices: int
) -> list[tuple[dict[str, Any], str, PlanInputs]]:
    out: list[tuple[dict[str, Any], str, PlanInputs]] = []
    for rank in (16, 8):
        if inputs.lora_rank is None or inputs.lora_rank > rank:
            change = {"lora.rank": rank}
            out.append((change, f"LoRA rank {rank}", inputs.replace(lora_rank=rank)))
    for n in range(inputs.devices + 1, max_devices + 1):
        if inputs.device_divisor and inputs.device_divisor % n:
            continue
        change = {"resources.devices": n}
        out.append((change, f"{n} devices", inputs.replace(devices=n)))
    micro = inputs.micro_batch_size // 2
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
    """Single changes that fit: LoRA (rank 16, rank 8), the fewest devices, the largest
    smaller micro-batch; one of each kind, each planned again."""
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
