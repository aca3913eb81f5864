"""The ``grpo``, ``rollout`` and ``eval`` sections of the job spec, and the names they choose
(``grpo``'s own sub-sections of DAPO options and asynchrony are in :mod:`jobspec.grpo_options`)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from jobspec.adaptation import TrainingDtype
from jobspec.base import MAX_STEPS, MAX_TOKENS
from jobspec.grpo_options import MAX_STALENESS, AsyncSpec, DynamicSamplingSpec, OverlongSpec
from jobspec.kl import KLSpec
from specbase import StrictModel

__all__ = [
    "CPU_ROLLOUT_DTYPE",
    "MAX_COMPLETIONS_PER_UPDATE",
    "MAX_STALENESS",
    "AdvantageScale",
    "AsyncSpec",
    "DynamicSamplingSpec",
    "EvalSpec",
    "GRPOSpec",
    "LossAggregation",
    "OverlongSpec",
    "RolloutEngineName",
    "RolloutSpec",
    "SamplerCorrectionMode",
    "SamplerCorrectionSpec",
    "UnresolvedMicroBatch",
    "rollout_dtype",
]

# The names a job can choose, declared once, here: pydantic rejects anything else with a 422
# naming the field. Each is implemented by a name-keyed registry whose keys must equal these
# (tests/trainer/test_registries.py checks):
#   KLEstimatorName   -> trainer.update.kl.KL_ESTIMATORS (the name, its traits and the KL
#                        section are jobspec.kl's)
#   AdvantageScale    -> trainer.update.advantages.ADVANTAGE_SCALES
#   LossAggregation   -> trainer.update.losses.LOSS_AGGREGATIONS
#   RolloutEngineName -> trainer.rollout.registry.ROLLOUT_ENGINES
#   SamplerCorrectionMode -> trainer.update.sampler_correction.SAMPLER_CORRECTIONS
# Grader types are the `type` tags of GraderSpecUnion's members (grading.graders, one module each).
# What engines are beyond their names (traits) is declared in jobspec.traits.
AdvantageScale = Literal["group", "batch", "none"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
RolloutEngineName = Literal["vllm", "transformers"]
SamplerCorrectionMode = Literal[
    "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]

MAX_PROMPTS_PER_STEP = 4096
MAX_MICRO_BATCH = 4096
# grpo.micro_batch_size: rows per forward/backward pass, or "auto" (the memory plan chooses).
MicroBatchSetting = Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH)] | Literal["auto"]
MAX_GROUP_SIZE = 256
# The most completions one step can train on (prompts_per_step x group_size at their maxima).
MAX_COMPLETIONS_PER_UPDATE = MAX_PROMPTS_PER_STEP * MAX_GROUP_SIZE


class SamplerCorrectionSpec(StrictModel):
    """Truncated importance sampling between the rollout engine and the trainer.

    The engine (vLLM: other kernels, often another dtype) samples from a distribution that is
    close to, not equal to, the trainer's pi_old, so the update is slightly off-policy. Each
    token's policy loss is weighted by ``pi_old(trainer) / pi_sampler`` (per token, or the
    product over the completion), capped at ``cap`` (truncate) or zeroed above it (mask)."""

    mode: SamplerCorrectionMode = Field(
        default="token_truncate",
        description=(
            "none, token_truncate (min(w_t, cap) per token), token_mask (w_t, or 0 where "
            "w_t > cap), sequence_truncate / sequence_mask (the same with the completion's "
            "product of ratios)."
        ),
    )
    cap: float = Field(
        default=2.0,
        gt=1.0,
        le=100.0,
        description="C: the largest importance weight kept (truncate) or allowed (mask).",
    )


class UnresolvedMicroBatch(ValueError):
    """``grpo.micro_batch_size`` read while still ``auto``."""


class GRPOSpec(StrictModel):
    # ``async`` is a Python keyword: the field is ``async_`` in code and ``async`` in every
    # spec a user writes or reads (validation takes either, dumps write the alias).
    model_config = StrictModel.model_config | ConfigDict(
        validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    steps: int = Field(
        default=20, ge=1, le=MAX_STEPS, description="Optimizer steps (rollout batches)."
    )
    prompts_per_step: int = Field(
        default=8, ge=1, le=MAX_PROMPTS_PER_STEP, description="Prompts per rollout batch."
    )
    group_size: int = Field(
        default=8, ge=2, le=MAX_GROUP_SIZE, description="Completions sampled per prompt (G)."
    )
    learning_rate: float = Field(default=1e-6, gt=0, le=1.0, description="AdamW learning rate.")
    dtype: TrainingDtype = Field(
        default="float32",
        description=(
            "Training precision: float32, or bfloat16 mixed precision (bfloat16 matmuls, float32 "
            "master weights, optimizer state and log-probabilities; the KL reference in bfloat16)."
        ),
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="Learning-rate schedule after warmup."
    )
    warmup_steps: int = Field(
        default=0, ge=0, le=MAX_STEPS, description="Linear warmup steps (at most steps)."
    )
    weight_decay: float = Field(default=0.0, ge=0, le=1.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6, description="Gradient clipping norm.")
    max_new_tokens: int = Field(
        default=128, ge=1, le=MAX_TOKENS, description="Completion token limit (L_max)."
    )
    max_prompt_tokens: int = Field(
        default=256,
        ge=1,
        le=MAX_TOKENS,
        description=(
            "Rows whose formatted prompt is longer are skipped, never cut (a dataset event "
            "lists them)."
        ),
    )
    temperature: float = Field(
        default=1.0,
        gt=0,
        le=10.0,
        description="Sampling temperature; log-probabilities are recomputed at the same temperature.",
    )
    eps_low: float = Field(default=0.2, ge=0, lt=1, description="Lower clip: ratio >= 1 - eps_low.")
    eps_high: float = Field(
        default=0.28,
        ge=0,
        le=10,
        description="Upper clip: ratio <= 1 + eps_high (DAPO clip-higher).",
    )
    clip_ratio_c: float | None = Field(
        default=None,
        gt=1,
        le=100,
        description=(
            "Dual clip (as in verl): for negative advantages the per-token loss is capped at "
            "-clip_ratio_c * A, so a token whose ratio ran above clip_ratio_c stops pushing. "
            "Typical value 3; null turns it off."
        ),
    )
    kl: KLSpec = Field(default_factory=KLSpec, description="KL regularisation.")
    sampler_correction: SamplerCorrectionSpec = Field(
        default_factory=SamplerCorrectionSpec,
        description="Importance-sampling correction for the engine/trainer mismatch.",
    )
    advantage_scale: AdvantageScale = Field(
        default="group",
        description="Divide centred rewards by the group std, the batch std, or not at all (Dr. GRPO).",
    )
    loss_aggregation: LossAggregation = Field(
        default="token_mean",
        description=(
            "token_mean (DAPO), seq_mean_token_mean (GRPO), seq_mean_token_sum_norm (Dr. GRPO)."
        ),
    )
    dynamic_sampling: DynamicSamplingSpec = Field(
        default_factory=DynamicSamplingSpec, description="DAPO dynamic sampling."
    )
    overlong: OverlongSpec = Field(
        default_factory=OverlongSpec, description="DAPO overlong reward shaping."
    )
    mask_truncated: bool = Field(
        default=False, description="Leave completions that hit max_new_tokens out of the loss."
    )
    num_iterations: int = Field(
        default=1, ge=1, le=16, description="Updates per rollout batch (mu)."
    )
    mini_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_COMPLETIONS_PER_UPDATE,
        description="Completions per optimizer update; default is the whole rollout batch.",
    )
    # ``micro_batch_size`` in every spec (the alias): what the job asked, a number or "auto";
    # the property ``micro_batch_size`` is the number the update uses (auto resolved first).
    micro_batch_setting: MicroBatchSetting = Field(
        default=16,
        alias="micro_batch_size",
        description=(
            "Completions per forward/backward pass (memory bound), or auto: the largest "
            "power of two, at most the completions a device trains per update, whose memory "
            "plan fits the device (validate shows it; the worker chooses it again for its own "
            "device when the job starts)."
        ),
    )
    async_: AsyncSpec = Field(
        default_factory=AsyncSpec,
        alias="async",
        description="Asynchronous GRPO: rollouts ahead of the update by at most max_staleness versions.",
    )
    gradient_checkpointing: bool = Field(
        default=True,
        description=(
            "Recompute the decoder's activations in the backward pass instead of keeping them: "
            "about half the activation memory for about a quarter more update time."
        ),
    )
    compile: bool = Field(
        default=False,
        description=(
            "torch.compile each decoder layer of the policy (the output head and the "
            "optimizer stay eager): fewer kernel launches and fused elementwise work, about "
            "1.4x the update's speed on a GPU (H200, 0.5B model). The first steps pay the "
            "compilation (tens of seconds; again for a new shape or mode), so it pays back on "
            "GPU jobs of many steps; on a CPU rarely."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> GRPOSpec:
        if self.overlong.enabled and self.overlong.cache_tokens >= self.max_new_tokens:
            raise ValueError("overlong.cache_tokens must be smaller than max_new_tokens")
        if self.warmup_steps > self.steps:
            raise ValueError("warmup_steps must not exceed steps")
        return self

    @property
    def micro_batch_size(self) -> int:
        """Completions per forward/backward pass: the job's number, or what ``auto`` was
        resolved to at start-up; UnresolvedMicroBatch while it is still ``auto``."""
        if self.micro_batch_setting == "auto":
            raise UnresolvedMicroBatch(
                "grpo.micro_batch_size is auto: resolve it with the memory plan first "
                "(jobspec.memory_plan.resolve_micro_batch)"
            )
        return self.micro_batch_setting

    @property
    def completions_per_step(self) -> int:
        """Completions one step trains on: ``prompts_per_step * group_size``."""
        return self.prompts_per_step * self.group_size

    @property
    def kl_normaliser_rows(self) -> int:
        """The rows an update's KL terms are divided by (times ``max_new_tokens``): the
        nominal rows of one optimizer update (``mini_batch_size``, else
        ``completions_per_step``), a constant, never the rows a step happened to keep
        (``trainer.update.losses.kl_aggregate``)."""
        return self.mini_batch_size or self.completions_per_step

    @property
    def sampled_completions_per_step(self) -> int:
        """The most completions one step samples and grades: ``completions_per_step``, plus,
        when dynamic sampling may sample again, ``max_rounds - 1`` rounds of at most
        ``oversample`` times the batch's prompts."""
        ds = self.dynamic_sampling
        if not ds.enabled:
            return self.completions_per_step
        later = math.ceil(self.prompts_per_step * ds.oversample) * (ds.max_rounds - 1)
        return (self.prompts_per_step + later) * self.group_size

    @property
    def sequence_tokens(self) -> int:
        """The longest sequence (prompt and completion) a step handles, in tokens."""
        return self.max_prompt_tokens + self.max_new_tokens

    @property
    def tokens_per_step(self) -> int:
        """Upper bound of the tokens one step's rollout holds (prompts included):
        ``sampled_completions_per_step * (max_prompt_tokens + max_new_tokens)``."""
        return self.sampled_completions_per_step * self.sequence_tokens

    @property
    def total_tokens(self) -> int:
        """Upper bound of the sequence tokens the run's training passes go over:
        ``steps * num_iterations * tokens_per_step`` (each of a step's ``num_iterations``
        updates passes over at most ``tokens_per_step`` tokens)."""
        return self.steps * self.num_iterations * self.tokens_per_step


class RolloutSpec(StrictModel):
    engine: RolloutEngineName = Field(
        default="vllm", description="vllm (fast, weights pushed every step) or transformers."
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        default=None,
        description=(
            "Precision of the rollout engine. Default: chosen at start by the device "
            "(rollout_dtype): bfloat16 on a GPU, whatever grpo.dtype, float32 elsewhere."
        ),
    )
    kv_cache_gib: float | None = Field(
        default=None,
        gt=0,
        le=512,
        description=(
            "KV-cache memory of the vLLM engine (GiB). Default: sized to hold the step's whole "
            "rollout batch (and the evaluation batch) at once, nothing more."
        ),
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        ge=0.05,
        le=0.95,
        description=(
            "GPU only: the share of the device's memory vLLM may take. Default: derived from "
            "what the trainer leaves free after placing its models and keeping room for the "
            "update (docs/trainer.md, GPU)."
        ),
    )
    enforce_eager: bool | None = Field(
        default=None,
        description=(
            "Run vLLM without CUDA graphs (on: faster start, less memory; off: faster decoding "
            "on a GPU once captured). Default: off on a GPU, on elsewhere (vLLM on CPU runs "
            "eagerly either way)."
        ),
    )
    sleep_mode: bool = Field(
        default=True,
        description=(
            "GPU only: vLLM releases its KV cache (and weights) during the update and wakes "
            "before the next weight sync. vLLM on CPU does not support it (an event says so)."
        ),
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        default="merged",
        description=(
            "How a LoRA job's weights reach the vLLM engine after each update: merged (the "
            "adapters merged into the base in float32 and every weight pushed) or adapter (the "
            "adapter alone saved and hot-swapped as a vLLM LoRA adapter; the base stays put)."
        ),
    )


CPU_ROLLOUT_DTYPE: Literal["float32"] = "float32"


def rollout_dtype(
    asked: Literal["float32", "bfloat16"] | None, training_dtype: str, device_type: str
) -> Literal["float32", "bfloat16"]:
    """The rollout engine's dtype on a ``device_type`` device (torch's: "cuda", "cpu"):
    ``rollout.dtype`` when the job set it, else bfloat16 on CUDA whatever the training dtype
    (a float32 vLLM engine there takes the slow attention path with twice the KV memory) and
    float32 elsewhere (vLLM-CPU's bfloat16 is slow or generic on many CPUs). The one rule: the
    run's engine, its async server and the memory plan all call it. The spec cannot know the
    device, so the default is resolved here when the run starts."""
    if asked is not None:
        return asked
    if device_type == "cuda":
        if training_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unknown training dtype {training_dtype!r}")
        return "bfloat16"
    return CPU_ROLLOUT_DTYPE


class EvalSpec(StrictModel):
    interval: int = Field(
        default=0,
        ge=0,
        le=MAX_STEPS,
        description="Evaluate greedy accuracy on the held-out rows every N steps (0: only at the end).",
    )
    max_rows: int = Field(default=64, ge=1, le=10_000, description="Held-out rows per evaluation.")
