"""The OpenAI fine-tuning API's bodies (openai-python's types, by field name and meaning), as
served under /v1/fine_tuning. app.fine_tuning.service maps them to and from native jobs.

Requests are strict like the native spec: an unknown field is a 400 naming it. Responses carry
OpenAI's fields first, then a few of ours (`grpo_service`), which the SDK keeps as extras."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from jobspec import (
    MAX_SEED,
    MAX_STEPS,
    MAX_TOOLS,
    GraderSpec,
    StrictModel,
    ToolFunction,
    ToolImplementation,
)

Auto = Literal["auto"]


class ReinforcementHyperparameters(StrictModel):
    """OpenAI's reinforcement hyperparameters; "auto" (the default) lets the service choose
    (docs/openai-compat.md says what each resolves to)."""

    batch_size: Auto | Annotated[int, Field(ge=1, le=1024)] = Field(
        default="auto", description="Prompts per step."
    )
    compute_multiplier: Auto | Annotated[float, Field(gt=0, le=16)] = Field(
        default="auto", description="Scales the completions sampled per prompt."
    )
    eval_interval: Auto | Annotated[int, Field(ge=1, le=MAX_STEPS)] = Field(
        default="auto", description="Steps between evaluations."
    )
    eval_samples: Auto | Annotated[int, Field(ge=1, le=10_000)] = Field(
        default="auto", description="Validation rows per evaluation."
    )
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=100)] = Field(
        default="auto", description="Scales the base learning rate."
    )
    n_epochs: Auto | Annotated[int, Field(ge=1, le=100)] = Field(
        default="auto", description="Passes over the training file."
    )
    reasoning_effort: Literal["default", "low", "medium", "high"] = Field(
        default="default", description="Scales the completion token limit."
    )


_HOSTED = (
    "this service calls no address a job gives: name the operator's tool endpoint, or give "
    "python source, in grpo_service.tool_implementations.<tool name> "
    "({type: http, endpoint: NAME} or {type: python, source})"
)


def _refuse_hosted(value: object) -> None:
    if value is not None:
        raise ValueError(_HOSTED)


class RftTool(StrictModel):
    """A tool of OpenAI's agent RFT: a function tool, in the Chat Completions shape
    (``{type: function, function: {name, description, parameters}}``) or the flat one of the
    Responses API (``{type: function, name, description, parameters}``). How it runs comes from
    ``grpo_service.tool_implementations``: OpenAI's hosted tools call the caller's URL
    (``url``/``server_url``, ``headers``), which is refused naming the field."""

    type: Literal["function"] = Field(default="function", description="A function tool.")
    function: ToolFunction | None = Field(default=None, description="The Chat Completions shape.")
    name: str | None = Field(default=None, max_length=64, description="The flat shape's name.")
    description: str | None = Field(default=None, max_length=4000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Accepted only to be refused with a message saying what to give instead.
    url: SkipJsonSchema[Any] = Field(default=None, exclude=True)
    server_url: SkipJsonSchema[Any] = Field(default=None, exclude=True)
    headers: SkipJsonSchema[Any] = Field(default=None, exclude=True)

    _no_url = field_validator("url", "server_url", "headers", mode="before")(_refuse_hosted)

    def native_function(self) -> dict[str, Any]:
        """The native ``function`` section (``jobspec.ToolFunction``'s fields)."""
        if self.function is not None:
            return self.function.model_dump(exclude_none=True)
        flat = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }
        return {k: v for k, v in flat.items() if v is not None}

    @property
    def tool_name(self) -> str | None:
        return self.function.name if self.function is not None else self.name


class ReinforcementMethod(StrictModel):
    grader: GraderSpec = Field(description="The grader whose score is the reward.")
    tools: list[RftTool] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description=(
            "Agent RFT: function tools the model may call; each runs as "
            "grpo_service.tool_implementations names it (the spec's tools)."
        ),
    )
    max_episode_steps: int | None = Field(
        default=None, ge=1, le=64, description="Agent RFT: the spec's episode.max_turns."
    )
    hyperparameters: ReinforcementHyperparameters = Field(
        default_factory=ReinforcementHyperparameters
    )
    response_format: dict[str, Any] | None = Field(
        default=None,
        description="Accepted for compatibility; completions are not constrained to it.",
    )


class Method(StrictModel):
    type: Literal["supervised", "dpo", "reinforcement"] = Field(description="Fine-tuning method.")
    reinforcement: ReinforcementMethod | None = None
    # Accepted only to be refused with a clear error naming method.type.
    supervised: dict[str, Any] | None = None
    dpo: dict[str, Any] | None = None


class GrpoExtension(StrictModel):
    """Native settings beyond OpenAI's, passed with the SDK's ``extra_body={"grpo_service":
    {...}}``: sections of the native job spec (docs/spec.md). A setting an explicit OpenAI
    hyperparameter also decides is refused (say it once)."""

    grpo: dict[str, Any] | None = Field(default=None, description="The spec's grpo section.")
    lora: dict[str, Any] | None = Field(default=None, description="The spec's lora section.")
    rollout: dict[str, Any] | None = Field(default=None, description="The spec's rollout section.")
    eval: dict[str, Any] | None = Field(default=None, description="The spec's eval section.")
    checkpoint_interval: int | None = Field(default=None, ge=0, le=MAX_STEPS)
    checkpoint: dict[str, Any] | None = Field(
        default=None, description="The spec's checkpoint section (retention)."
    )
    resources: dict[str, Any] | None = Field(
        default=None, description="The spec's resources section (devices)."
    )
    integrations: list[dict[str, Any]] | None = Field(
        default=None, max_length=4, description="Native integrations (MLflow, W&B)."
    )
    tool_implementations: dict[str, ToolImplementation] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description=(
            "How each of method.reinforcement.tools runs, by tool name: {type: http, endpoint: "
            "NAME} (an operator endpoint) or {type: python, source}."
        ),
    )
    environment: dict[str, Any] | None = Field(
        default=None, description="The spec's environment section."
    )
    episode: dict[str, Any] | None = Field(
        default=None, description="The spec's episode section (budgets)."
    )
    system_prompt: str | None = Field(default=None, max_length=20_000)
    use_chat_template: bool | None = None
    name: str | None = Field(default=None, max_length=120)


class FineTuningJobCreate(StrictModel):
    model: str = Field(min_length=1, max_length=1000, description="The base model.")
    training_file: str = Field(min_length=1, max_length=64, description="An uploaded file id.")
    validation_file: str | None = Field(default=None, min_length=1, max_length=64)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    suffix: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Added to the fine-tuned model's name (letters, digits, - and _).",
    )
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    method: Method | None = None
    hyperparameters: dict[str, Any] | None = Field(
        default=None, description="Deprecated by OpenAI: give method.reinforcement.hyperparameters."
    )
    integrations: list[dict[str, Any]] | None = Field(default=None, max_length=8)
    grpo_service: GrpoExtension | None = Field(
        default=None, description="Native GRPO settings (extra_body)."
    )


# ---- responses -----------------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class FineTuningError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJobOut(_Out):
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    id: str
    created_at: int
    error: FineTuningError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: dict[str, Any]
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: str = Field(
        description="OpenAI's names (queued, running, succeeded, failed, cancelled), and ours "
        "where OpenAI has none: pausing, paused, cancelling."
    )
    trained_tokens: int | None
    training_file: str | None
    validation_file: str | None
    estimated_finish: int | None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None
    method: dict[str, Any] | None


class FineTuningJobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobOut]
    has_more: bool


class FineTuningEventOut(_Out):
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    id: str
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"]
    data: dict[str, Any] | None


class FineTuningEventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningEventOut]
    has_more: bool


class FineTuningCheckpointOut(_Out):
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, float]
    step_number: int


class FineTuningCheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningCheckpointOut]
    has_more: bool
    first_id: str | None
    last_id: str | None
