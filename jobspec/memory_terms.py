"""The bytes of each part of a job's memory plan (``jobspec.memory_plan``), term by term, from
the model's shape and what of the spec decides them (:class:`PlanInputs`). Torch-free.

Per device, for N devices (docs/scaling.md: FSDP shards the policy, gradients, AdamW's state and
a full fine-tune's reference; each rank has its engine):

- weights: trainable parameters in float32 (master weights, under bfloat16 too), /N; a LoRA
  job's frozen base as ``trainer.models.precision.frozen_reference`` holds a frozen copy
  (float32; bfloat16 Linears under bfloat16: ``store_frozen_linears_for_autocast``), /N.
- gradients (float32) and optimizer (AdamW's two float32 moments): trainable parameters, /N
  (gradients whole where a device accumulates several micro-batches: one reduce-scatter).
- reference (KL active): a full fine-tune's frozen copy, /N; LoRA: 0 (adapters off).
- engine: vLLM holds the model in ``rollout.dtype`` on every rank and its KV cache
  (``rollout.kv_cache_gib``, else as ``trainer.rollout.startup.kv_cache_bytes`` sizes it: the
  largest generate call of one engine, :func:`sequences_per_call`, a rank's share of the step);
  transformers generates with the policy (one device, float32: no copy), its KV cache alive
  while it generates. An async job's rollout server (rank 0's device only) is a process of its
  own: it always holds its own copy, and it generates while the trainer updates.
- activations of one micro-batch (prompt + completion tokens): each layer's float32 input
  (checkpointing; without it every layer's intermediates), then the larger of the forward's
  end (the fused output head's chunk, ``trainer.update.fused_head``: its [rows, vocab] float32
  logits and the log-sum-exp's copy of them; under bfloat16, autocast's copies of the
  trainable decoder weights, cached until the forward ends) and the backward's one layer
  recomputed with its gradients and attention scores.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobspec.grpo import MAX_MICRO_BATCH
from jobspec.model_shape import Accelerator, ModelShape

if TYPE_CHECKING:
    from jobspec.job import JobSpec

__all__ = [
    "HEAD_CHUNK_BUFFERS",
    "HEAD_CHUNK_ELEMENTS",
    "HF_GENERATE_ROWS",
    "KV_HEADROOM",
    "PlanInputs",
    "activation_bytes",
    "autocast_copies",
    "engine_bytes",
    "frozen_bytes",
    "head_chunk_rows",
    "head_chunk_rows_for",
    "kv_block_tokens",
    "kv_cache_bytes",
    "largest_micro_batch",
    "sequences_per_call",
    "whole_gradients",
]

GIB = 1 << 30
# Read by the trainer too (through jobspec.memory_plan), as HEAD_CHUNK_ELEMENTS.
KV_HEADROOM, HF_GENERATE_ROWS = 1.25, 64
HEAD_CHUNK_ELEMENTS = 1 << 24
# [rows, vocab] float32 buffers the fused head holds at once: a chunk's logits and logsumexp's
# shifted copy in the forward (its backward recomputes one chunk, in place). Checked against
# torch.cuda.max_memory_allocated on an H200 (BENCHMARKS.md 10c).
HEAD_CHUNK_BUFFERS = 2
# One decoder layer recomputed in the backward pass: what its backward saves, per token, in
# units of hidden_size (the two norms' inputs and outputs, q, the rotated q, the attention
# output, o_proj's output and the residual; k and v are smaller, grouped heads) and of
# intermediate_size (gate, up, the activation and the product). Checked against measured CPU
# peaks (tests/trainer/test_memory_plan_peak.py).
LAYER_HIDDEN_FACTOR = 10
LAYER_INTERMEDIATE_FACTOR = 4
ITEMSIZE = {"float32": 4, "bfloat16": 2}


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
    micro_batch_size: int = 16  # with micro_batch_auto: the largest to try
    micro_batch_auto: bool = False  # grpo.micro_batch_size "auto": the plan chooses
    update_rows: int = 64  # completions per optimizer update (over every device)
    sequence_tokens: int = 384
    completion_tokens: int = 128
    rollout_sequences: int = 64  # completions one step samples, over every device
    group_size: int = 1  # completions of one prompt: a device's share holds whole groups
    eval_sequences: int = 0  # held-out prompts one evaluation generates (one completion each)
    async_rollouts: bool = False  # grpo.async: a rollout server generates during the update
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
        micro, devices = grpo.micro_batch_setting, spec.resources.devices
        update_rows = grpo.mini_batch_size or grpo.completions_per_step
        auto = micro == "auto"  # the plan chooses, from the largest down
        micro_rows = largest_micro_batch(update_rows, devices) if micro == "auto" else micro
        eval_rows = 0
        if dataset.holdout:
            eval_rows = min(spec.eval.max_rows, dataset.holdout)
        elif dataset.validation_file_id is not None:
            eval_rows = spec.eval.max_rows
        return cls(
            devices=devices,
            training_dtype=grpo.dtype,
            lora_rank=spec.lora.rank if spec.lora is not None else None,
            lora_targets=spec.lora.target_modules if spec.lora is not None else "all-linear",
            kl_active=grpo.kl.active,
            engine=rollout.engine,
            engine_holds_weights=ROLLOUT_ENGINE_TRAITS[rollout.engine].sizes_kv_cache,
            rollout_dtype=rollout_dtype(rollout.dtype, grpo.dtype, accelerator),
            kv_cache_gib=rollout.kv_cache_gib,
            sleep_mode=rollout.sleep_mode,
            micro_batch_size=micro_rows,
            micro_batch_auto=auto,
            update_rows=update_rows,
            sequence_tokens=grpo.sequence_tokens,
            completion_tokens=grpo.max_new_tokens,
            rollout_sequences=grpo.completions_per_step,
            group_size=grpo.group_size,
            eval_sequences=eval_rows,
            async_rollouts=grpo.async_.enabled,
            gradient_checkpointing=grpo.gradient_checkpointing,
            accelerator=accelerator,
            device_divisor=1
            if spec.is_agentic
            else math.gcd(grpo.prompts_per_step, grpo.mini_batch_size or grpo.prompts_per_step),
        )

    def replace(self, **changes: Any) -> PlanInputs:
        return dataclasses.replace(self, **changes)

    @property
    def engine_sequences(self) -> int:
        """Sequences the engine's largest generate call holds (:func:`sequences_per_call`)."""
        return sequences_per_call(
            completions=self.rollout_sequences,
            group_size=self.group_size,
            eval_prompts=self.eval_sequences,
            devices=self.devices,
            async_server=self.async_rollouts,
        )


def sequences_per_call(
    *, completions: int, group_size: int, eval_prompts: int, devices: int, async_server: bool
) -> int:
    """Sequences one engine's largest ``generate`` call holds, which its KV cache is sized to.

    A step's ``completions`` (``prompts * group_size``) are sampled in ``devices`` shares of
    whole groups, one call per share (``trainer.scoring.collect``): on N ranks each rank's
    engine samples its share, and an async job's single server samples the N shares one after
    the other; the first ranks take one prompt more. An evaluation generates one completion
    per held-out prompt, split over the ranks the same way, except on an async job's server,
    which evaluates every row in one call (``trainer.run.async_run``)."""
    groups = devices if devices > 0 else 1
    prompts = math.ceil(completions / max(1, group_size))
    train = math.ceil(prompts / groups) * max(1, group_size)
    evaluation = eval_prompts if async_server else math.ceil(eval_prompts / groups)
    return max(train, evaluation)


def whole_gradients(*, devices: int, update_rows: int, micro_batch_size: int) -> bool:
    """Whether a device holds the whole float32 gradients during the update: on several
    devices, gradients are reduce-scattered once per minibatch (``trainer.distributed.
    sharding.gradient_sync``), so a device that accumulates several micro-batches per update
    holds them unsharded until then; one micro-batch per device keeps its shard."""
    return devices > 1 and update_rows > devices * micro_batch_size


def largest_micro_batch(update_rows: int, devices: int) -> int:
    """The largest power of two at most the completions one device trains per update (and
    at most ``MAX_MICRO_BATCH``): where ``auto`` starts."""
    rows = min(MAX_MICRO_BATCH, max(1, math.ceil(update_rows / devices)))
    return 1 << (rows.bit_length() - 1)


def frozen_bytes(shape: ModelShape, dtype: str) -> int:
    """A frozen full copy: float32, or bfloat16 Linear weights of the decoder and the rest
    float32 (``trainer.models.precision.frozen_reference``)."""
    if dtype == "float32":
        return 4 * shape.parameters
    linear = shape.linear_parameters
    return ITEMSIZE[dtype] * linear + 4 * (shape.parameters - linear)


def kv_block_tokens(accelerator: str) -> int:
    """Tokens per KV block: vLLM's own default per platform (vLLM-CPU's attention kernels prefer
    128; GPU backends take 16). The trainer builds its engine with this block size, so the
    cache is sized with the block the engine really uses, here and in the plan."""
    return 128 if accelerator == "cpu" else 16


def kv_cache_bytes(
    per_token: int, *, sequences: int, tokens_per_sequence: int, block_tokens: int
) -> int:
    """KV-cache bytes that hold ``sequences`` sequences of ``tokens_per_sequence`` tokens at
    once, each in whole blocks of ``block_tokens``, at ``per_token`` bytes a token
    (``jobspec.model_shape.kv_bytes_per_token``) and KV_HEADROOM over it (vLLM-CPU stores
    about 1.2x the computed bytes, measured). The engine the trainer starts is given this
    cache; the memory plan counts the same. A cache that fits the whole batch never preempts;
    a larger one is memory the trainer needs more."""
    if sequences < 1 or tokens_per_sequence < 1:
        raise ValueError("sequences and tokens_per_sequence must be positive")
    blocks = sequences * math.ceil(tokens_per_sequence / block_tokens)
    return math.ceil(blocks * block_tokens * per_token * KV_HEADROOM)


def head_chunk_rows_for(vocab_size: int, *, free_bytes: int | None) -> int:
    """Rows per output-head chunk: on CPU (``free_bytes`` None) about HEAD_CHUNK_ELEMENTS
    logits (341 rows for a 49,152-token vocabulary; larger chunks were no faster on CPU); on a
    device, as many [rows, V] float32 logits (and about three temporaries of the same size) as
    fit in 5% of its free memory, at most 8192 rows. Never fewer than 16."""
    vocab = max(1, vocab_size)
    if free_bytes is None:
        return max(16, HEAD_CHUNK_ELEMENTS // vocab)
    return max(16, min(8192, math.floor(free_bytes * 0.05 / (16 * vocab))))


def _vllm_kv_bytes(shape: ModelShape, inputs: PlanInputs) -> int:
    if inputs.kv_cache_gib is not None:
        return int(inputs.kv_cache_gib * GIB)
    return kv_cache_bytes(
        shape.kv_bytes_per_token(ITEMSIZE[inputs.rollout_dtype]),
        sequences=max(1, inputs.engine_sequences),
        tokens_per_sequence=max(1, inputs.sequence_tokens),
        block_tokens=kv_block_tokens(inputs.accelerator),
    )


def engine_bytes(shape: ModelShape, inputs: PlanInputs) -> tuple[int, int]:
    """(engine weights, KV cache) on each device (on rank 0's for an async job's server)."""
    itemsize = ITEMSIZE[inputs.rollout_dtype]
    if inputs.engine_holds_weights:
        return itemsize * shape.parameters, _vllm_kv_bytes(shape, inputs)
    # The rollout server loads the folder in a process of its own: never the policy itself.
    own_copy = inputs.async_rollouts or inputs.devices > 1 or inputs.rollout_dtype != "float32"
    rows = min(HF_GENERATE_ROWS, inputs.engine_sequences)
    kv = rows * inputs.sequence_tokens * shape.kv_bytes_per_token(itemsize)
    return (itemsize * shape.parameters if own_copy else 0), kv


def head_chunk_rows(shape: ModelShape, inputs: PlanInputs, device_memory: int) -> int:
    """Rows of the output head's chunk (:func:`head_chunk_rows_for` on the device), at most
    a micro-batch's completion tokens."""
    free = None if inputs.accelerator == "cpu" else device_memory
    rows = head_chunk_rows_for(shape.vocab_size, free_bytes=free)
    return min(rows, inputs.micro_batch_size * inputs.completion_tokens)


def activation_bytes(shape: ModelShape, inputs: PlanInputs, device_memory: int) -> int:
    """One micro-batch's forward and backward at their peak (module docstring): the decoder's
    saved inputs [layers, tokens, H], plus the larger of the forward's end (the head's
    ``HEAD_CHUNK_BUFFERS`` [rows, V] float32 buffers, its [tokens, H] float32 states and
    gradient, autocast's weight copies) and one layer recomputed in the backward pass."""
    tokens = inputs.micro_batch_size * inputs.sequence_tokens
    inner = ITEMSIZE[inputs.training_dtype]  # autocast's matmul outputs
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
        saved, recomputed = shape.num_hidden_layers * residual, layer + scores
    else:
        saved, recomputed = shape.num_hidden_layers * (residual + layer + scores), 0
    rows = head_chunk_rows(shape, inputs, device_memory)
    head = HEAD_CHUNK_BUFFERS * rows * shape.vocab_size * 4 + 2 * residual
    return saved + max(head + autocast_copies(shape, inputs), recomputed)


def autocast_copies(shape: ModelShape, inputs: PlanInputs) -> int:
    """bfloat16 autocast caches a bfloat16 copy of each float32 trainable weight a matmul
    reads until the forward pass ends: a full fine-tune's decoder Linears (whole, also when
    FSDP gathers them layer by layer), a LoRA job's adapters; 0 in float32."""
    if inputs.training_dtype == "float32":
        return 0
    itemsize = ITEMSIZE[inputs.training_dtype]
    if inputs.lora_rank is not None:
        return itemsize * shape.lora_parameters(inputs.lora_rank, inputs.lora_targets)
    return itemsize * shape.linear_parameters
