"""Admission: what a valid job spec may still not ask of *this* service.

`jobspec.JobSpec` checks a spec on its own (types, bounds, storable text). Whether this
deployment accepts it depends on the operator: which model folders a job may read, and how big
a job may be. `admit` checks both, at submission (`POST /v1/jobs`) and in the dry run
(`POST /v1/jobs/validate`), and raises a 422 naming the field. The worker checks the model
again before it loads anything (defense in depth), so this is the first gate, not the only one.

Model folders: a job may name a packaged model, or a Hugging Face folder under one of the
operator's model roots (`GRPO_MODEL_ROOTS`), by the rule of `jobspec.paths`, which the
worker applies again: every refusal gives the same message, which names no path. Or a Hugging
Face Hub repo id, when the operator allows Hub models (`GRPO_ALLOW_HUB_MODELS`) and the id
matches `GRPO_HUB_MODEL_ALLOWLIST` (when set); whether the worker's cache holds it is only known
on the worker.

Devices: a job's `resources.devices` at most `GRPO_MAX_DEVICES_PER_JOB` (and no more than its
project may hold at once, `GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT`).

Judge, tool and environment endpoints: a score_model grader, an http tool or an http
environment names one of the operator's (`GRPO_JUDGE_ENDPOINTS`, `GRPO_TOOL_ENDPOINTS`: the
registry of grading.endpoints, which the API and the workers share).

Experiment trackers: a job's `integrations` may export only to the operator's MLflow tracking
servers (`GRPO_MLFLOW_TRACKING_URIS`) and to W&B only when `GRPO_WANDB_MODE` allows it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session

from app.core.errors import InvalidRequest
from app.core.settings import Settings
from app.jobs import checkpoints_repository as checkpoints_repo
from app.jobs import repository as jobs_repo
from grading.endpoints import EndpointKind, unknown_endpoint
from jobspec import (
    PACKAGED_MODELS,
    GraderSpecBase,
    JobSpec,
    is_hub_repo_id,
    spec_limits_violations,
    text_problem,
)
from jobspec.paths import (
    allowed_dataset_folder,
    allowed_model_folder,
    dataset_refusal,
    model_refusal,
)


def admit(spec: JobSpec, *, settings: Settings, project_id: str, session: Session) -> None:
    """Raise InvalidRequest (422, naming the field) unless this service accepts `spec`."""
    _admit_model(spec.model, settings)
    _admit_dataset(spec, settings)
    admit_limits(spec, settings)
    _admit_devices(spec, settings)
    _admit_judges(spec)
    _admit_agent_endpoints(spec)
    _admit_integrations(spec, settings)
    _admit_init_from(getattr(spec, "init_from", None), project_id=project_id, session=session)


# ---- dataset folders -------------------------------------------------------------------------


def _admit_dataset(spec: JobSpec, settings: Settings) -> None:
    """A saved dataset only from under the operator's dataset roots (the rule of
    jobspec.paths; the worker applies it again); the refusal names no path."""
    dataset = getattr(spec, "dataset", None)
    source = getattr(dataset, "saved_dataset", None)
    if source is None:
        return
    if source.hub_id is not None:
        if not settings.allow_hub_datasets:
            raise InvalidRequest(
                "this service reads no datasets from the Hugging Face Hub; save it to a folder "
                "under its dataset roots, or upload it (POST /v1/files)",
                param="dataset.saved_dataset.hub_id",
            )
        return
    roots = settings.dataset_root_list
    forbidden = [settings.data_dir, settings.resolved_checkpoint_dir]
    if allowed_dataset_folder(source.path or "", roots, forbidden) is None:
        raise InvalidRequest(
            dataset_refusal(has_roots=bool(roots)), param="dataset.saved_dataset.path"
        )


# ---- judge, tool and environment endpoints ---------------------------------------------------


def _admit_judges(spec: JobSpec) -> None:
    for i, grader in enumerate(getattr(spec, "graders", ())):
        admit_judge(grader, path=f"graders[{i}]")


def admit_judge(grader: GraderSpecBase, *, path: str) -> None:
    """A score_model grader (or a multi's sub-grader) names an endpoint of the operator's
    (GRPO_JUDGE_ENDPOINTS, which the API and the workers share): an unknown name is refused
    now, a 422 naming `<path>.endpoint`, rather than failing every sample on a worker. Job
    submission and POST /v1/graders/validate and /run both apply it."""
    parts = [(path, grader)]
    parts += [(f"{path}.graders.{k}", g) for k, g in grader.sub_graders().items()]
    judges = [(f"{p}.endpoint", e) for p, g in parts if (e := g.judge_endpoint()) is not None]
    _admit_endpoints("judge", judges)


def _admit_agent_endpoints(spec: JobSpec) -> None:
    """An http tool or http environment names an endpoint of the operator's
    (GRPO_TOOL_ENDPOINTS, which the API and the workers share): an unknown name is a 422 naming
    the field now, rather than a job that fails on a worker."""
    _admit_endpoints("tool", getattr(spec, "agent_endpoints", ()))


def _admit_endpoints(kind: EndpointKind, named: Iterable[tuple[str, str]]) -> None:
    unknown = unknown_endpoint(kind, named)
    if unknown is not None:
        where, message = unknown
        raise InvalidRequest(message, param=where)


# ---- experiment trackers ---------------------------------------------------------------------


def _admit_integrations(spec: JobSpec, settings: Settings) -> None:
    """A tracker integration only to the operator's trackers: an MLflow tracking_uri from
    GRPO_MLFLOW_TRACKING_URIS, W&B only when GRPO_WANDB_MODE is not disabled (the rule of
    jobspec.integrations, which the worker applies again)."""
    for i, integration in enumerate(getattr(spec, "integrations", ())):
        refusal = settings.integration_refusal(integration)
        if refusal is not None:
            field, message = refusal
            raise InvalidRequest(message, param=f"integrations[{i}]{field}")


# ---- model ---------------------------------------------------------------------------------


def _admit_model(model: str, settings: Settings) -> None:
    if model in PACKAGED_MODELS:
        return
    if is_hub_repo_id(model):
        refusal = settings.hub_model_refusal(model)
        if refusal is not None:
            raise InvalidRequest(refusal, param="model")
        return
    roots = settings.model_root_list
    folder = allowed_model_folder(
        model,
        roots,
        # Checkpoints are model folders too, of every project: one is reachable through
        # `init_from` (by job and step, checked against the project), never by path. The data
        # folder (database, broker, key file) likewise; the worker forbids the same two.
        forbidden=[settings.data_dir.resolve(), settings.resolved_checkpoint_dir],
    )
    if folder is None:
        raise InvalidRequest(model_refusal(has_roots=bool(roots)), param="model")


# ---- operator limits on a job's size -------------------------------------------------------


def admit_limits(spec: JobSpec, settings: Settings) -> None:
    """The operator's limits on a job's size (completions and tokens per step, tokens in
    all): a 422 naming the first field past one, with every one in its details."""
    violations = spec_limits_violations(
        spec,
        max_completions_per_step=settings.max_completions_per_step,
        max_tokens_per_step=settings.max_tokens_per_step,
        max_total_tokens=settings.max_total_tokens,
    )
    if violations:
        details = [{"param": param, "message": message} for param, message in violations]
        param, message = violations[0]
        raise InvalidRequest(f"{param}: {message}", param=param, details=details)


def _admit_devices(spec: JobSpec, settings: Settings) -> None:
    """At most GRPO_MAX_DEVICES_PER_JOB devices (the largest worker the operator runs: a job
    waits for a worker of exactly its size), and no more than the project may ever hold at
    once (GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT: the quota's 429 would never clear)."""
    resources = getattr(spec, "resources", None)
    devices = resources.devices if resources is not None else 1
    bounds = (
        (settings.max_devices_per_job, "jobs of at most {n} devices (GRPO_MAX_DEVICES_PER_JOB)"),
        (
            settings.max_active_devices_per_project,
            "a project at most {n} devices in its queued and running jobs together "
            "(GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT)",
        ),
    )
    for bound, allows in bounds:
        if devices > bound:
            raise InvalidRequest(
                f"resources.devices: {devices} devices asked; this service allows "
                f"{allows.format(n=bound)}",
                param="resources.devices",
            )


# ---- init_from: start from a checkpoint of one of this project's jobs ------------------------


def _admit_init_from(init_from: Any, *, project_id: str, session: Session) -> None:
    """`init_from: {job_id, step}` names a checkpoint by job and step, never by path, so a job
    can only start from its own project's checkpoints. Another project's job and a missing one
    get the same answer."""
    if init_from is None:
        return
    job_id = str(getattr(init_from, "job_id", ""))
    step = getattr(init_from, "step", None)
    if not job_id or text_problem(job_id) is not None or len(job_id) > 64:
        raise InvalidRequest(
            "init_from.job_id: no such job in this project", param="init_from.job_id"
        )
    if not isinstance(step, int) or isinstance(step, bool):
        raise InvalidRequest("init_from.step: must be an integer step", param="init_from.step")
    found = checkpoints_repo.checkpoint_of_project_job(
        session, project_id=project_id, job_id=job_id, step=step
    )
    source = jobs_repo.get_for_project(session, project_id=project_id, job_id=job_id)
    if found is not None and source is not None and (source.spec or {}).get("lora"):
        # Its checkpoints hold adapters, not a model folder to start from.
        raise InvalidRequest(
            f"init_from.job_id: job {job_id} trained LoRA adapters; starting from a LoRA "
            "checkpoint is not supported yet (export it merged with `grpo export --merge`)",
            param="init_from.job_id",
        )
    if found is not None:
        return
    if source is None:
        raise InvalidRequest(
            "init_from.job_id: no such job in this project", param="init_from.job_id"
        )
    raise InvalidRequest(
        f"init_from.step: job {job_id} has no checkpoint at step {step} "
        f"(see GET /v1/jobs/{job_id}/checkpoints)",
        param="init_from.step",
    )
