"""The GRPO job spec: one pydantic model shared by the API (validation) and the trainer (execution).

This module must stay torch-free: the API imports it to validate specs without loading torch.
Every field carries a description and a default; unknown fields are rejected everywhere so a typo
such as ``learnin_rate`` is a 422 naming the field, not a silently ignored setting.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PACKAGED_MODELS: tuple[str, ...] = ("smollm2-135m-instruct", "tiny-random-llama")

KLEstimatorName = Literal["none", "k1", "k2", "k3", "k3_unbiased"]
KLPlacement = Literal["loss", "reward"]
AdvantageScale = Literal["group", "batch", "none"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
RolloutEngineName = Literal["vllm", "transformers"]

MAX_INLINE_ROWS = 100_000
MAX_TEXT_CHARS = 20_000


class StrictModel(BaseModel):
    """Base for every spec section: unknown fields are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------- dataset


class PromptRow(StrictModel):
    prompt: str = Field(
        min_length=1, max_length=MAX_TEXT_CHARS, description="The user prompt sent to the model."
    )
    answer: str | None = Field(
        default=None,
        max_length=MAX_TEXT_CHARS,
        description="Optional reference answer the graders compare completions against.",
    )


class ArithmeticGenerator(StrictModel):
    """A synthetic addition task, useful for smoke tests and recipes ("What is 3+4?" -> "7")."""

    type: Literal["arithmetic"] = Field(description="Generator kind.")
    count: int = Field(default=256, ge=1, le=MAX_INLINE_ROWS, description="Rows to generate.")
    min_operand: int = Field(default=0, ge=0, le=10**6, description="Smallest operand.")
    max_operand: int = Field(default=9, ge=0, le=10**6, description="Largest operand.")
    template: str = Field(
        default="What is {a}+{b}? Answer with a number.",
        min_length=1,
        max_length=500,
        description="Prompt template with {a} and {b} placeholders.",
    )
    seed: int = Field(default=0, description="Seed of the generator (independent of the run seed).")

    @model_validator(mode="after")
    def _check(self) -> ArithmeticGenerator:
        if self.min_operand > self.max_operand:
            raise ValueError("min_operand must be <= max_operand")
        if "{a}" not in self.template or "{b}" not in self.template:
            raise ValueError("template must contain {a} and {b}")
        return self


class DatasetSpec(StrictModel):
    """Where the prompts come from: exactly one of rows, file_id or generator."""

    rows: list[PromptRow] | None = Field(
        default=None, max_length=MAX_INLINE_ROWS, description="Inline prompt rows."
    )
    file_id: str | None = Field(
        default=None,
        max_length=64,
        description="Id of a JSONL file uploaded with POST /v1/files (one {prompt, answer} per line).",
    )
    generator: ArithmeticGenerator | None = Field(
        default=None, description="Generate a synthetic task instead of supplying rows."
    )
    system_prompt: str | None = Field(
        default=None, max_length=MAX_TEXT_CHARS, description="System message prepended to prompts."
    )
    use_chat_template: bool = Field(
        default=True, description="Format prompts with the tokenizer's chat template."
    )
    holdout: int = Field(
        default=0,
        ge=0,
        le=10_000,
        description="Rows held out of training for evaluation (taken from the end of the dataset).",
    )
    shuffle: bool = Field(default=True, description="Shuffle prompts every epoch (seeded).")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DatasetSpec:
        given = [n for n in ("rows", "file_id", "generator") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of dataset.rows, dataset.file_id or dataset.generator "
                f"(got {', '.join(given) or 'none'})"
            )
        if self.rows is not None and len(self.rows) == 0:
            raise ValueError("dataset.rows must not be empty")
        size = len(self.rows) if self.rows is not None else None
        if self.generator is not None:
            size = self.generator.count
        if size is not None and self.holdout >= size:
            raise ValueError(f"dataset.holdout ({self.holdout}) leaves no rows to train on")
        return self


# --------------------------------------------------------------------------- graders


class _GraderBase(StrictModel):
    name: str | None = Field(
        default=None,
        pattern=r"^[a-z][a-z0-9_]{0,39}$",
        description="Name used in per-grader metrics (reward/<name>/mean); defaults to the type.",
    )
    weight: float = Field(
        default=1.0, ge=-100, le=100, description="Weight of this grader in the total reward."
    )


class ExactMatchGrader(_GraderBase):
    """1.0 when the completion equals the reference answer (after optional normalisation)."""

    type: Literal["exact_match"]
    case_sensitive: bool = Field(default=False, description="Compare case-sensitively.")
    strip: bool = Field(default=True, description="Strip surrounding whitespace before comparing.")


class NumericMatchGrader(_GraderBase):
    """1.0 when the last number in the completion equals the reference answer's number."""

    type: Literal["numeric_match"]
    tolerance: float = Field(
        default=1e-6, ge=0, description="Absolute tolerance of the numeric comparison."
    )


class RegexGrader(_GraderBase):
    """1.0 when the pattern matches the completion (a format check)."""

    type: Literal["regex"]
    pattern: str = Field(min_length=1, max_length=500, description="Python regular expression.")
    full_match: bool = Field(
        default=False, description="Require the whole completion to match, not just a part."
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"pattern does not compile: {exc}") from exc
        return pattern


class LengthGrader(_GraderBase):
    """1.0 inside [min_chars, max_chars], falling linearly to 0 over `slack_chars` outside it."""

    type: Literal["length"]
    min_chars: int = Field(default=0, ge=0, description="Shortest length with full reward.")
    max_chars: int = Field(default=200, ge=1, description="Longest length with full reward.")
    slack_chars: int = Field(
        default=50, ge=1, description="Distance outside the range over which reward falls to 0."
    )

    @model_validator(mode="after")
    def _range(self) -> LengthGrader:
        if self.min_chars > self.max_chars:
            raise ValueError("min_chars must be <= max_chars")
        return self


GraderSpec = Annotated[
    ExactMatchGrader | NumericMatchGrader | RegexGrader | LengthGrader,
    Field(discriminator="type"),
]


def grader_name(grader: ExactMatchGrader | NumericMatchGrader | RegexGrader | LengthGrader) -> str:
    return grader.name or grader.type


# --------------------------------------------------------------------------- GRPO settings


class KLSpec(StrictModel):
    estimator: KLEstimatorName = Field(
        default="k3_unbiased",
        description=(
            "Per-token KL estimator against the reference model: k1 (-d), k2 (d^2/2), "
            "k3 (exp(d)-d-1), k3_unbiased (importance-weighted k3, DeepSeek-V3.2), or none."
        ),
    )
    beta: float = Field(
        default=0.0,
        ge=0.0,
        le=10.0,
        description="KL coefficient; 0 (or estimator none) loads no reference model.",
    )
    placement: KLPlacement = Field(
        default="loss",
        description="Add beta*KL to the loss, or subtract it (detached) from the reward.",
    )

    @property
    def active(self) -> bool:
        return self.beta > 0 and self.estimator != "none"


class DynamicSamplingSpec(StrictModel):
    enabled: bool = Field(
        default=False,
        description="Drop groups whose rewards are all equal and sample more prompts.",
    )
    max_rounds: int = Field(
        default=3, ge=1, le=20, description="Most sampling rounds per step to fill the batch."
    )


class OverlongSpec(StrictModel):
    enabled: bool = Field(default=False, description="Apply DAPO's soft overlong penalty.")
    cache_tokens: int = Field(
        default=16,
        ge=1,
        description="L_cache: the penalty ramps from 0 to -penalty over the last cache_tokens tokens.",
    )
    penalty: float = Field(default=1.0, ge=0, le=100, description="Penalty at max_new_tokens.")


class GRPOSpec(StrictModel):
    steps: int = Field(
        default=20, ge=1, le=100_000, description="Optimizer steps (rollout batches)."
    )
    prompts_per_step: int = Field(
        default=8, ge=1, le=4096, description="Prompts per rollout batch."
    )
    group_size: int = Field(
        default=8, ge=2, le=256, description="Completions sampled per prompt (G)."
    )
    learning_rate: float = Field(default=1e-6, gt=0, le=1.0, description="AdamW learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="Learning-rate schedule after warmup."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(default=0.0, ge=0, le=1.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    max_new_tokens: int = Field(
        default=128, ge=1, le=32_768, description="Completion token limit (L_max)."
    )
    max_prompt_tokens: int = Field(
        default=256, ge=1, le=32_768, description="Prompts longer than this are truncated."
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
    kl: KLSpec = Field(default_factory=KLSpec, description="KL regularisation.")
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
        description="Completions per optimizer update; default is the whole rollout batch.",
    )
    micro_batch_size: int = Field(
        default=16, ge=1, description="Completions per forward/backward pass (memory bound)."
    )
    gradient_checkpointing: bool = Field(
        default=True,
        description=(
            "Recompute the decoder's activations in the backward pass instead of keeping them: "
            "about half the activation memory for about a quarter more update time."
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
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


class RolloutSpec(StrictModel):
    engine: RolloutEngineName = Field(
        default="vllm", description="vllm (fast, weights pushed every step) or transformers."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="Precision of the rollout engine."
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


class EvalSpec(StrictModel):
    interval: int = Field(
        default=0,
        ge=0,
        description="Evaluate greedy accuracy on the held-out rows every N steps (0: only at the end).",
    )
    max_rows: int = Field(default=64, ge=1, le=10_000, description="Held-out rows per evaluation.")


# --------------------------------------------------------------------------- the job spec


class JobSpec(StrictModel):
    """Everything needed to run one GRPO fine-tune."""

    name: str | None = Field(default=None, max_length=120, description="Human-readable job name.")
    model: str = Field(
        default="smollm2-135m-instruct",
        min_length=1,
        max_length=1000,
        description=(
            "A packaged model name (" + ", ".join(PACKAGED_MODELS) + ") "
            "or an absolute path to a Hugging Face model folder on the worker."
        ),
    )
    dataset: DatasetSpec = Field(description="Prompts (and reference answers).")
    graders: list[GraderSpec] = Field(
        min_length=1,
        max_length=16,
        description="Graders whose weighted sum is the reward of a completion.",
    )
    grpo: GRPOSpec = Field(default_factory=GRPOSpec, description="GRPO hyperparameters.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout engine.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Held-out evaluation.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seed of the whole run.")
    checkpoint_interval: int = Field(
        default=10, ge=0, description="Save a checkpoint every N steps (0: only at the end)."
    )
    metadata: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description="Free-form string labels (at most 16) stored with the job.",
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, model: str) -> str:
        if model not in PACKAGED_MODELS and not model.startswith("/"):
            raise ValueError(
                f"model must be one of {', '.join(PACKAGED_MODELS)} or an absolute path "
                f"to a model folder, got {model!r}"
            )
        return model

    @field_validator("graders")
    @classmethod
    def _unique_names(cls, graders: list[GraderSpec]) -> list[GraderSpec]:
        names = [grader_name(g) for g in graders]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"grader names must be unique; give each a distinct name: {', '.join(duplicates)}"
            )
        return graders

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, metadata: dict[str, str]) -> dict[str, str]:
        for key, value in metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("metadata keys are at most 64 chars and values at most 512")
        return metadata

    def warnings(self) -> list[str]:
        """Legal but probably unintended settings, reported by the validate endpoint."""
        out: list[str] = []
        kl = self.grpo.kl
        if kl.active and kl.estimator == "k1" and kl.placement == "loss":
            out.append(
                "kl.estimator k1 placed in the loss has zero expected gradient on-policy; "
                "use placement 'reward' or k3_unbiased"
            )
        if kl.active and kl.estimator == "k2" and self.grpo.num_iterations > 1:
            out.append(
                "k2 in the loss is biased off-policy (num_iterations > 1); prefer k3_unbiased"
            )
        if kl.beta > 0 and kl.estimator == "none":
            out.append("kl.beta is ignored because kl.estimator is none")
        return out
