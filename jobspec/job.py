"""The GRPO job spec: one torch-free pydantic model shared by the API (validation) and the
trainer (execution). Every field has a description and a default; unknown fields are rejected
(a typo such as ``learnin_rate`` is a 422 naming the field); numbers are bounded, floats
finite, text storable (``specbase``). The sections live beside it in :mod:`jobspec`, the
graders' union in :mod:`grading.graders`; this module assembles them into :class:`JobSpec`.
Import every name from :mod:`jobspec`, the one front door.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from grading.graders import GraderSpec, grader_name
from jobspec.adaptation import LoraSpec
from jobspec.agents import (
    MAX_TOOLS,
    EnvironmentSpec,
    EpisodeSpec,
    HttpEnvironment,
    HttpToolImplementation,
    ToolSpec,
)
from jobspec.async_warnings import async_warnings
from jobspec.base import MAX_SEED, MAX_STEPS
from jobspec.checkpoint import CheckpointSpec
from jobspec.dataset import DatasetSpec
from jobspec.grpo import EvalSpec, GRPOSpec, RolloutSpec
from jobspec.integrations import MAX_INTEGRATIONS, IntegrationSpec
from jobspec.kl import KL_ESTIMATOR_TRAITS, KL_REWARD_PENALTY
from jobspec.model_source import hub_repo_id_problem, looks_like_hub_repo_id, revision_problem
from jobspec.resources import ResourcesSpec
from jobspec.traits import ROLLOUT_ENGINE_TRAITS
from specbase import StrictModel, field_error

__all__ = ["PACKAGED_MODELS", "InitFrom", "JobSpec", "spec_limits_violations"]

PACKAGED_MODELS: tuple[str, ...] = ("smollm2-135m-instruct", "tiny-random-llama")


class InitFrom(StrictModel):
    """Start from the weights of a checkpoint of an earlier job of the same project.

    Named by job id and step, never by path: the service checks that the job belongs to the
    caller's project and saved that step, and the worker looks the folder up itself."""

    job_id: str = Field(
        min_length=1, max_length=64, pattern=r"^job_[0-9a-f]{12,60}$", description="Earlier job."
    )
    step: int = Field(ge=1, le=MAX_STEPS, description="A step that job saved a checkpoint of.")


class JobSpec(StrictModel):
    """Everything needed to run one GRPO fine-tune."""

    name: str | None = Field(default=None, max_length=120, description="Human-readable job name.")
    model: str = Field(
        default="smollm2-135m-instruct",
        min_length=1,
        max_length=1000,
        description=(
            "A packaged model name (" + ", ".join(PACKAGED_MODELS) + "), "
            "a Hugging Face Hub repo id (owner/name, e.g. Qwen/Qwen2.5-0.5B-Instruct) read "
            "through the worker's Hugging Face cache, "
            "or an absolute path to a Hugging Face model folder on the worker."
        ),
    )
    model_revision: str | None = Field(
        default=None,
        max_length=128,
        description="Branch, tag or 40-hex commit of a Hub `model` (default: main).",
    )
    init_from: InitFrom | None = Field(
        default=None,
        description=(
            "Start from a checkpoint of an earlier job of this project instead of the model's "
            "own weights (the reference model for KL is then that checkpoint too)."
        ),
    )
    dataset: DatasetSpec = Field(description="Prompts (and reference answers).")
    graders: list[GraderSpec] = Field(
        min_length=1,
        max_length=16,
        description="Graders whose weighted sum is the reward of a completion.",
    )
    grpo: GRPOSpec = Field(default_factory=GRPOSpec, description="GRPO hyperparameters.")
    tools: list[ToolSpec] = Field(
        default_factory=list,
        max_length=MAX_TOOLS,
        description=(
            f"Tools the model may call (at most {MAX_TOOLS}): OpenAI function tools with a python "
            "or http implementation. With tools or an environment, each completion is a "
            "multi-turn episode trained only on the tokens the model sampled."
        ),
    )
    environment: EnvironmentSpec | None = Field(
        default=None,
        description="An environment the episode steps through (reset(item), step(messages)).",
    )
    episode: EpisodeSpec = Field(
        default_factory=EpisodeSpec, description="Per-episode budgets (tools or environment)."
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="Train LoRA adapters instead of every weight (none: full fine-tuning).",
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout engine.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Held-out evaluation.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Devices the job trains on."
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed of the whole run.")
    checkpoint_interval: int = Field(
        default=10,
        ge=0,
        le=MAX_STEPS,
        description="Save a checkpoint every N steps (0: only at the end).",
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec,
        description="Which checkpoints are kept (the newest N and the best by a metric).",
    )
    metadata: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description="Free-form string labels (at most 16) stored with the job.",
    )
    integrations: list[IntegrationSpec] = Field(
        default_factory=list,
        max_length=MAX_INTEGRATIONS,
        description=(
            f"Experiment trackers (at most {MAX_INTEGRATIONS}: mlflow, wandb) the run's params, "
            "step metrics and final checkpoint are exported to, from the worker. A tracker "
            "outage never fails or slows the job; what was not exported is a job event."
        ),
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, model: str) -> str:
        if model in PACKAGED_MODELS or model.startswith("/"):
            return model
        problem = hub_repo_id_problem(model)
        if problem is None:
            return model
        kinds = (
            f"model must be one of {', '.join(PACKAGED_MODELS)}, a Hugging Face Hub repo id "
            "(owner/name) or an absolute path to a model folder"
        )
        detail = f"; {problem}" if looks_like_hub_repo_id(model) else ""
        raise ValueError(f"{kinds}{detail}; got {model!r:.120}")

    @field_validator("model_revision")
    @classmethod
    def _hub_revision(cls, revision: str | None, info: ValidationInfo) -> str | None:
        if revision is None:
            return None
        problem = revision_problem(revision)
        if problem is not None:
            raise ValueError(f"{problem}; got {revision!r:.140}")
        model = info.data.get("model")
        if model is not None and hub_repo_id_problem(model) is not None:
            raise ValueError("model_revision applies only to a Hub repo id (owner/name) model")
        return revision

    @field_validator("rollout")
    @classmethod
    def _adapter_sync_needs_lora_and_an_adapter_engine(
        cls, rollout: RolloutSpec, info: ValidationInfo
    ) -> RolloutSpec:
        if rollout.lora_sync == "adapter":
            if not ROLLOUT_ENGINE_TRAITS[rollout.engine].serves_lora_adapters:
                serving = " or ".join(
                    name
                    for name, traits in ROLLOUT_ENGINE_TRAITS.items()
                    if traits.serves_lora_adapters
                )
                raise ValueError(
                    f"lora_sync 'adapter' is a {serving} engine mode; use engine {serving}"
                )
            if info.data.get("lora") is None:
                raise ValueError("lora_sync 'adapter' needs a LoRA job (set lora)")
        return rollout

    @field_validator("resources", mode="wrap")
    @classmethod
    def _devices_are_whole_numbers(
        cls, resources: Any, handler: ValidatorFunctionWrapHandler
    ) -> ResourcesSpec:
        # Pydantic's lax mode reads "2" as 2 and true as 1: a device count is a JSON integer.
        # Checked strictly here, where the section is read; its errors keep their location
        # (resources.devices).
        if isinstance(resources, Mapping):
            ResourcesSpec.model_validate(resources, strict=True)
        validated: ResourcesSpec = handler(resources)
        return validated

    @field_validator("resources")
    @classmethod
    def _one_device_jobs(cls, resources: ResourcesSpec, info: ValidationInfo) -> ResourcesSpec:
        # The trainer runs agent episodes (trainer.run.episodes.agent_refusal) for one rank
        # only: such a job could only fail on its worker, after waiting for a worker of its
        # size.
        if resources.devices > 1 and (info.data.get("tools") or info.data.get("environment")):
            why = "a job with tools or an environment trains on one device"
        else:
            return resources
        raise field_error(
            ("devices",),
            f"{why} (got {resources.devices}): set resources.devices to 1",
            resources.devices,
        )

    @field_validator("resources")
    @classmethod
    def _devices_split_the_batch_evenly(
        cls, resources: ResourcesSpec, info: ValidationInfo
    ) -> ResourcesSpec:
        # Every rank samples an equal share of whole groups and runs as many passes as its
        # peers (FSDP's collectives pair up pass for pass).
        grpo = info.data.get("grpo")
        devices = resources.devices
        if devices > 1 and isinstance(grpo, GRPOSpec):
            if grpo.prompts_per_step % devices:
                raise ValueError(
                    f"devices ({devices}) must divide grpo.prompts_per_step "
                    f"({grpo.prompts_per_step}): each device samples an equal share of prompts"
                )
            if grpo.mini_batch_size is not None and grpo.mini_batch_size % devices:
                raise ValueError(
                    f"devices ({devices}) must divide grpo.mini_batch_size "
                    f"({grpo.mini_batch_size}): each device trains an equal share of it"
                )
        return resources

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

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ToolSpec]) -> list[ToolSpec]:
        names = [t.function.name for t in tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique: {', '.join(duplicates)}")
        return tools

    @model_validator(mode="after")
    def _agents_need_the_chat_template(self) -> JobSpec:
        # Episodes are chat conversations (tool calls and results are turns): without the
        # template the trainer refuses the job on its worker (agent_refusal).
        if self.is_agentic and not self.dataset.use_chat_template:
            raise field_error(
                ("dataset", "use_chat_template"),
                "a job with tools or an environment needs the chat template: set "
                "dataset.use_chat_template to true",
                False,
            )
        return self

    @property
    def is_agentic(self) -> bool:
        """Whether completions are multi-turn episodes (tools or an environment)."""
        return bool(self.tools) or self.environment is not None

    @property
    def agent_endpoints(self) -> list[tuple[str, str]]:
        """The operator endpoints its http tools and http environment name, each with the
        field that names it (``tools[0].implementation.endpoint``, ``environment.endpoint``)."""
        out = [
            (f"tools[{i}].implementation.endpoint", impl.endpoint)
            for i, t in enumerate(self.tools)
            if isinstance(impl := t.implementation, HttpToolImplementation)
        ]
        if isinstance(self.environment, HttpEnvironment):
            out.append(("environment.endpoint", self.environment.endpoint))
        return out

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
        traits = KL_ESTIMATOR_TRAITS[kl.estimator]
        if kl.in_loss and traits.loss == "zero":
            out.append(
                f"kl.estimator {kl.estimator} placed in the loss has zero expected gradient "
                "on-policy; use k1_causal, placement 'reward' or k3_unbiased"
            )
        off_policy = self.grpo.num_iterations > 1
        if kl.in_loss and traits.loss_biased_off_policy and off_policy:
            out.append(
                f"{kl.estimator} in the loss is biased off-policy (num_iterations > 1); "
                "prefer k3_unbiased, or placement 'reward'"
            )
        if "flat_groups" in kl.model_fields_set:
            out.append(
                "kl.flat_groups is ignored: the reward-side KL penalty applies, unscaled, in "
                "every group"
            )
        if kl.in_reward and kl.estimator != KL_REWARD_PENALTY:
            out.append(
                f"kl.placement 'reward' penalises with {KL_REWARD_PENALTY} (log pi - log ref per "
                "token), the only estimator whose policy-gradient is exactly grad KL(pi || ref); "
                f"kl.estimator {kl.estimator} only names the reported kl metric"
            )
        if kl.beta > 0 and kl.estimator == "none":
            out.append("kl.beta is ignored because kl.estimator is none")
        out.extend(async_warnings(self.grpo))
        return out


def spec_limits_violations(
    spec: JobSpec,
    *,
    max_completions_per_step: int | None = None,
    max_tokens_per_step: int | None = None,
    max_total_tokens: int | None = None,
) -> list[tuple[str, str]]:
    """The ways ``spec`` exceeds a service's limits, as ``(param path, message)`` pairs in the
    API's path style (``grpo.prompts_per_step``); empty when it fits. A limit of None is no
    limit. Each field is bounded on its own by the spec; these are limits on their products,
    which only the operator can size (GPU memory and time):

    - ``max_completions_per_step`` against ``grpo.sampled_completions_per_step``: prompts_per_step
      x group_size (with dynamic sampling on, each round after the first adds up to
      ``oversample`` times the prompts);
    - ``max_tokens_per_step`` against ``grpo.tokens_per_step``: those completions x
      (max_prompt_tokens + max_new_tokens);
    - ``max_total_tokens`` against ``grpo.total_tokens``: tokens_per_step x steps x num_iterations.

    Each message gives the product, how it is computed, and the limit, and is reported on the
    field the user most likely wants to lower.
    """
    grpo = spec.grpo
    out: list[tuple[str, str]] = []
    sampled = grpo.sampled_completions_per_step
    if max_completions_per_step is not None and sampled > max_completions_per_step:
        rounds = grpo.dynamic_sampling.enabled and grpo.completions_per_step <= (
            max_completions_per_step
        )
        how = f"prompts_per_step ({grpo.prompts_per_step}) x group_size ({grpo.group_size})"
        if grpo.dynamic_sampling.enabled:
            ds = grpo.dynamic_sampling
            how = (
                f"(prompts_per_step ({grpo.prompts_per_step}) + (dynamic_sampling.max_rounds "
                f"({ds.max_rounds}) - 1) x ceil(prompts_per_step x dynamic_sampling.oversample "
                f"({ds.oversample:g}))) x group_size ({grpo.group_size})"
            )
        out.append(
            (
                "grpo.dynamic_sampling.max_rounds" if rounds else "grpo.prompts_per_step",
                f"{how} = {sampled} completions per step exceeds this service's limit of "
                f"{max_completions_per_step}",
            )
        )
    if max_tokens_per_step is not None and grpo.tokens_per_step > max_tokens_per_step:
        out.append(
            (
                "grpo.max_new_tokens",
                f"{sampled} completions per step x (max_prompt_tokens ({grpo.max_prompt_tokens}) "
                f"+ max_new_tokens ({grpo.max_new_tokens})) = {grpo.tokens_per_step} tokens per "
                f"step exceeds this service's limit of {max_tokens_per_step}",
            )
        )
    if max_total_tokens is not None and grpo.total_tokens > max_total_tokens:
        out.append(
            (
                "grpo.steps",
                f"{grpo.tokens_per_step} tokens per step x steps ({grpo.steps}) x "
                f"num_iterations ({grpo.num_iterations}) = {grpo.total_tokens} tokens exceeds "
                f"this service's limit of {max_total_tokens}",
            )
        )
    return out
