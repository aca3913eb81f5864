"""OpenAI fine-tuning requests as native jobs: the one place that maps a /v1/fine_tuning/jobs
body (app.fine_tuning.schemas) to a JobSpec, resolves "auto", and says which request field a native
field came from, so every refusal names the field the client sent.

The mapping (docs/openai-compat.md has the table):
- model -> the operator's map (GRPO_OPENAI_MODELS: o4-mini -> smollm2-135m-instruct by
  default), else taken as a native model name;
- training_file -> dataset.file_id; validation_file -> dataset.validation_file_id (the held-out
  set for eval/accuracy);
- method.reinforcement.grader -> graders[0];
- batch_size -> grpo.prompts_per_step (auto: 8, at most the training rows);
- n_epochs -> grpo.steps = ceil(n_epochs x training rows / batch_size) (auto: 1 epoch);
- compute_multiplier -> grpo.group_size = max(2, round(8 x m)) (auto: 1);
- learning_rate_multiplier -> grpo.learning_rate = m x the base rate (1e-6 full fine-tuning,
  1e-5 with LoRA) (auto: 1);
- eval_interval -> eval.interval (auto: every ceil(steps / 10) steps with a validation file,
  else only at the end); eval_samples -> eval.max_rows (auto: 64);
- reasoning_effort -> grpo.max_new_tokens = 128 x (low 0.5, default and medium 1, high 2);
- integrations ({type: wandb, wandb: {...}}) -> the native wandb integration;
- seed, metadata as they are (a missing seed is drawn and kept); suffix -> the job's name and
  the fine-tuned model's name;
- method.reinforcement.tools (agent RFT) with grpo_service.tool_implementations -> tools,
  max_episode_steps -> episode.max_turns (app.fine_tuning.tools);
- grpo_service (the SDK's extra_body) -> the native sections it names. An explicit OpenAI
  hyperparameter and the extension may not both set one native field; "auto" yields to it.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.core.errors import ApiError, InvalidRequest
from app.core.field_paths import field_path
from app.datasets import repository as files_repo
from app.fine_tuning.schemas import FineTuningJobCreate, GrpoExtension
from app.fine_tuning.tools import add_agents
from jobspec import MAX_SEED, EvalSpec, GRPOSpec, JobSpec

# The native defaults "auto" starts from (declared by the spec itself).
_GRPO_DEFAULTS = GRPOSpec()
AUTO_BATCH = _GRPO_DEFAULTS.prompts_per_step
AUTO_GROUP = _GRPO_DEFAULTS.group_size
BASE_TOKENS = _GRPO_DEFAULTS.max_new_tokens
BASE_LEARNING_RATE = _GRPO_DEFAULTS.learning_rate
LORA_LEARNING_RATE_FACTOR = 10.0  # LoRA adapters train at about 10x a full fine-tune's rate
AUTO_EVAL_SAMPLES = EvalSpec().max_rows
EFFORT_TOKENS = {"low": 0.5, "default": 1.0, "medium": 1.0, "high": 2.0}
HP = "method.reinforcement.hyperparameters"


@dataclass
class Translation:
    """A request as a native spec, what to store beside it, and where each field came from."""

    spec: JobSpec
    openai: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)

    def param(self, native: str | None) -> str | None:
        return openai_param(native, self.sources)


def openai_param(native: str | None, sources: dict[str, str]) -> str | None:
    """The request field a native param path came from (the longest known prefix), or the
    extension's path for native fields the request did not set."""
    if native is None:
        return None
    best = ""
    for prefix in sources:
        if len(prefix) > len(best) and (
            native == prefix or native.startswith((prefix + ".", prefix + "["))
        ):
            best = prefix
    if not best:
        return f"grpo_service.{native}"
    return sources[best] + native[len(best) :]


def refuse_methods(request: FineTuningJobCreate) -> None:
    """Only reinforcement fine-tuning runs here; the rest is a 400 naming the field."""
    method = request.method
    if method is None:
        raise InvalidRequest(
            "method is required: {type: reinforcement, reinforcement: {grader: ...}} "
            "(only reinforcement fine-tuning runs here)",
            param="method",
        )
    if method.type != "reinforcement":
        raise InvalidRequest(
            f"method.type {method.type!r} is not supported: only 'reinforcement' runs here",
            param="method.type",
        )
    if method.reinforcement is None:
        raise InvalidRequest("method.reinforcement is required", param="method.reinforcement")
    if request.hyperparameters:
        raise InvalidRequest(
            "top-level hyperparameters are for supervised jobs; give "
            "method.reinforcement.hyperparameters",
            param="hyperparameters",
        )
    for i, integration in enumerate(request.integrations or []):
        if integration.get("type") != "wandb" or not isinstance(integration.get("wandb"), dict):
            raise InvalidRequest(
                "an integration is {type: wandb, wandb: {project, entity, name, tags}} (MLflow "
                "export: grpo_service.integrations)",
                param=f"integrations[{i}]",
            )


def training_rows(session: Session, *, project_id: str, file_id: str) -> int:
    row = files_repo.get_for_project(session, project_id=project_id, file_id=file_id)
    if row is None:
        raise InvalidRequest(f"file {file_id} not found", param="training_file")
    return row.row_count


@dataclass(frozen=True)
class _Choices:
    """The GRPO settings a request's hyperparameters (or "auto", or the extension) chose."""

    batch: int
    epochs: int
    steps: int
    multiplier: float
    group: int
    base_rate: float
    rate: float
    max_new: int
    interval: int
    samples: int


def _choose(
    request: FineTuningJobCreate,
    ext_grpo: dict[str, Any],
    ext_eval: dict[str, Any],
    *,
    train_rows: int,
    sources: dict[str, str],
) -> _Choices:
    """Each hyperparameter against "auto" and the extension's own setting (`decide`); records in
    `sources` which request field set each native one."""
    assert request.method is not None and request.method.reinforcement is not None
    hp = request.method.reinforcement.hyperparameters
    ext = request.grpo_service
    lora = ext.lora if ext else None

    def decide(section: dict[str, Any], name: str, hp_name: str, auto: Any, value: Any) -> Any:
        """An explicit hyperparameter wins over "auto" and must not meet the extension."""
        path = f"{'eval' if section is ext_eval else 'grpo'}.{name}"
        if getattr(hp, hp_name) not in ("auto", "default"):
            if name in section:
                raise InvalidRequest(
                    f"{HP}.{hp_name} and grpo_service.{path} both set {path}; give one",
                    param=f"grpo_service.{path}",
                )
            sources[path] = f"{HP}.{hp_name}"
            return value
        return section.get(name, auto)

    batch_value = hp.batch_size if hp.batch_size != "auto" else None
    batch = decide(
        ext_grpo, "prompts_per_step", "batch_size", max(1, min(AUTO_BATCH, train_rows)), batch_value
    )
    epochs = hp.n_epochs if hp.n_epochs != "auto" else 1
    steps = decide(
        ext_grpo,
        "steps",
        "n_epochs",
        _steps(epochs, train_rows, batch),
        _steps(epochs, train_rows, batch),
    )
    multiplier = hp.compute_multiplier if hp.compute_multiplier != "auto" else 1.0
    group = decide(
        ext_grpo,
        "group_size",
        "compute_multiplier",
        AUTO_GROUP,
        max(2, round(AUTO_GROUP * multiplier)),
    )
    base_rate = BASE_LEARNING_RATE * (LORA_LEARNING_RATE_FACTOR if lora is not None else 1.0)
    rate_multiplier = hp.learning_rate_multiplier if hp.learning_rate_multiplier != "auto" else 1.0
    rate = decide(
        ext_grpo,
        "learning_rate",
        "learning_rate_multiplier",
        base_rate,
        base_rate * rate_multiplier,
    )
    tokens = max(1, round(BASE_TOKENS * EFFORT_TOKENS[hp.reasoning_effort]))
    max_new = decide(ext_grpo, "max_new_tokens", "reasoning_effort", BASE_TOKENS, tokens)
    auto_interval = math.ceil(steps / 10) if request.validation_file else 0
    interval = decide(ext_eval, "interval", "eval_interval", auto_interval, hp.eval_interval)
    samples = decide(ext_eval, "max_rows", "eval_samples", AUTO_EVAL_SAMPLES, hp.eval_samples)
    return _Choices(
        batch=batch,
        epochs=epochs,
        steps=steps,
        multiplier=multiplier,
        group=group,
        base_rate=base_rate,
        rate=rate,
        max_new=max_new,
        interval=interval,
        samples=samples,
    )


def _add_extension(
    ext: GrpoExtension,
    request: FineTuningJobCreate,
    *,
    native: dict[str, Any],
    dataset: dict[str, Any],
    sources: dict[str, str],
) -> None:
    """The grpo_service extension's own fields, into the translated spec (`native`, its
    `dataset`), each recorded in `sources`."""
    if ext.name:
        sources["name"] = "grpo_service.name"
    for key in ("system_prompt", "use_chat_template"):
        if getattr(ext, key) is not None:
            dataset[key] = getattr(ext, key)
            sources[f"dataset.{key}"] = f"grpo_service.{key}"
    if ext.integrations:  # MLflow (and W&B) in the native form, after OpenAI's
        native["integrations"] = [*native["integrations"], *ext.integrations]
        offset = len(request.integrations or [])
        for j in range(len(ext.integrations)):
            sources[f"integrations[{offset + j}]"] = f"grpo_service.integrations[{j}]"
    for key in ("lora", "rollout", "checkpoint_interval", "checkpoint", "resources"):
        if getattr(ext, key) is not None:
            native[key] = getattr(ext, key)


def translate(
    request: FineTuningJobCreate, *, train_rows: int, models: dict[str, str]
) -> Translation:
    """The native spec of an (already method-checked) request; InvalidRequest naming the
    request's field when the result is not a valid spec."""
    # The caller has run refuse_methods (before reading the training file, so a wrong method
    # is reported first).
    assert request.method is not None and request.method.reinforcement is not None
    hp = request.method.reinforcement.hyperparameters
    ext = request.grpo_service
    ext_grpo = dict(ext.grpo or {}) if ext else {}
    ext_eval = dict(ext.eval or {}) if ext else {}
    sources = {
        "model": "model",
        "dataset.file_id": "training_file",
        "dataset.validation_file_id": "validation_file",
        "dataset": "training_file",
        "graders[0]": "method.reinforcement.grader",
        "graders": "method.reinforcement.grader",
        "seed": "seed",
        "metadata": "metadata",
        "integrations": "integrations",
        "name": "suffix",
    }
    chosen = _choose(request, ext_grpo, ext_eval, train_rows=train_rows, sources=sources)
    batch, epochs, steps, multiplier = chosen.batch, chosen.epochs, chosen.steps, chosen.multiplier
    group, base_rate, rate, max_new = chosen.group, chosen.base_rate, chosen.rate, chosen.max_new
    interval, samples = chosen.interval, chosen.samples
    seed = request.seed if request.seed is not None else secrets.randbelow(MAX_SEED + 1)

    dataset: dict[str, Any] = {
        "file_id": request.training_file,
        "validation_file_id": request.validation_file,
    }
    native: dict[str, Any] = {
        "name": (ext.name if ext and ext.name else None) or request.suffix,
        "model": models.get(request.model, request.model),
        "dataset": dataset,
        "graders": [request.method.reinforcement.grader.model_dump(mode="json")],
        "grpo": {
            **ext_grpo,
            "steps": steps,
            "prompts_per_step": batch,
            "group_size": group,
            "learning_rate": rate,
            "max_new_tokens": max_new,
        },
        "eval": {**ext_eval, "interval": interval, "max_rows": samples},
        "seed": seed,
        "metadata": dict(request.metadata or {}),
        # OpenAI's {type: wandb, wandb: {...}} is the native {type: wandb, ...}.
        "integrations": [{"type": "wandb", **i["wandb"]} for i in request.integrations or []],
    }
    for i in range(len(request.integrations or [])):
        sources[f"integrations[{i}]"] = f"integrations[{i}].wandb"
    if ext is not None:
        _add_extension(ext, request, native=native, dataset=dataset, sources=sources)
    add_agents(request, native=native, sources=sources)
    resolved = {
        "batch_size": batch,
        "compute_multiplier": multiplier,
        "eval_interval": interval,
        "eval_samples": samples,
        "learning_rate_multiplier": rate / base_rate,
        "n_epochs": None if "steps" in ext_grpo else epochs,  # the extension chose steps
        "reasoning_effort": hp.reasoning_effort,
    }
    stored = {
        "model": request.model,
        "suffix": request.suffix,
        "hyperparameters": resolved,
        "requested": hp.model_dump(mode="json"),
        "response_format": request.method.reinforcement.response_format,
    }
    try:
        spec = JobSpec.model_validate(native)
    except ValidationError as exc:
        raise _refusal(exc, sources) from None
    return Translation(spec=spec, openai=stored, sources=sources)


def _steps(epochs: int, rows: int, batch: int) -> int:
    return max(1, math.ceil(epochs * rows / max(1, batch)))


def _refusal(exc: ValidationError, sources: dict[str, str]) -> InvalidRequest:
    """The spec's validation errors, with params in the request's terms."""
    details = []
    for err in exc.errors():
        native = field_path(err.get("loc", ()))
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        details.append({"param": openai_param(native, sources), "message": message})
    first = details[0]
    return InvalidRequest(
        f"{first['param']}: {first['message']}", param=first["param"], details=details
    )


def in_request_terms(error: ApiError, translation: Translation) -> ApiError:
    """`error` (raised while admitting the native spec) with its param named as the request
    names it."""
    error.param = translation.param(error.param)
    return error


def resolved_hyperparameters(job_openai: dict[str, Any] | None) -> dict[str, Any]:
    """The hyperparameters a job shows: what "auto" resolved to (native jobs: none)."""
    if job_openai and isinstance(job_openai.get("hyperparameters"), dict):
        return dict(job_openai["hyperparameters"])
    return {}
