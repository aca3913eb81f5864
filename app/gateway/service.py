"""The model catalogue and the resolution of a model name to what would serve it.

Names (docs/openai-compat.md, "Models"):
- a packaged base model (`jobspec.PACKAGED_MODELS`), or a base model an inference process
  serves by name (its GRPO_INFERENCE_BASES: a Hub id, a folder under GRPO_MODEL_ROOTS), owned
  by "system";
- `ft:<model>:<suffix>:<job id>` (app.fine_tuning.names): the job's final weights, its newest
  kept checkpoint; only once the job has succeeded;
- `ft:<model>:<suffix>:<job id>:ckpt-step-<N>`: the kept checkpoint of step N, usable while the
  job still runs (and after it failed or was cancelled);
- the native job id, `job_...` (its final weights, as the `ft:` name) or `job_...@N` (the
  checkpoint of step N);
- `ft:<model>:<save name>:<Tinker model id>` (app.tinker.names), or the save's own
  `tinker://<model id>/sampler_weights/<name>` path: a Tinker training client's sampler weights
  save (LoRA adapters over its base model), until the save expires.

An `ft:` name must be exactly the job's own (the model and suffix parts included). Everything
else is one 404, `model_not_found` (param `model`): an unknown name, another project's job, a
deleted job, a job that has not succeeded (for its final weights), a checkpoint its retention
pruned. The same answer whether or not the name exists elsewhere, so no name is an oracle.

The catalogue lists the base models (the packaged ones, then the served ones) and the project's
newest `SAMPLER_SAVES_LISTED` Tinker sampler saves, then the project's jobs holding kept
checkpoints, newest first, `limit` jobs a page (cursor `after`, a job id): each job's `ft:`
name once it succeeded, then its newest `CHECKPOINTS_PER_JOB` checkpoints. Older checkpoints
are not listed but still resolve (GET /v1/fine_tuning/jobs/{id}/checkpoints pages through all
of them)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from app.core.clock import as_utc, unix, utcnow
from app.core.errors import ModelNotFound
from app.core.ids import MAX_STEP, parse_number
from app.core.job_status import JobStatus
from app.core.models import Checkpoint, Job
from app.core.tinker_tables import TinkerCheckpoint, TinkerModel
from app.fine_tuning.names import (
    FINE_TUNED_PREFIX,
    NamedWeights,
    base_model,
    checkpoint_model_name,
    fine_tuned_model_name,
    read_fine_tuned_name,
)
from app.gateway import servers_repository as servers_repo
from app.gateway.chat_as_trained import TrainedPrompt
from app.gateway.engine_identity import DEFAULT_DTYPE, EngineDtype
from app.gateway.protocol import SamplerWeightsRef
from app.gateway.schemas import ModelInfo, ModelOut
from app.gateway.served_kinds import BASE, FULL, LORA, ModelKind
from app.jobs import checkpoints_repository as checkpoints_repo
from app.jobs import repository as jobs_repo
from app.progress import repository as progress_repo
from app.sessions import repository as projects_repo
from app.tinker import repository as tinker_repo
from app.tinker.names import (
    SAMPLER_KIND,
    SamplerModelName,
    read_sampler_model_name,
    sampler_model_name,
    tinker_path,
)
from jobspec import PACKAGED_MODELS
from jobspec.checkpoint_files import folder_name

SYSTEM_OWNER = "system"
NATIVE_PREFIX = "job_"
STEP_SEPARATOR = "@"
# How many checkpoints of each job the catalogue lists (the newest); the rest still resolve.
CHECKPOINTS_PER_JOB = 10
# How many of the project's Tinker sampler saves the catalogue lists (the newest); the rest
# still resolve by name.
SAMPLER_SAVES_LISTED = 20


@dataclass(frozen=True)
class ResolvedModel:
    """What a server needs to serve a name, and what the catalogue shows of it. Nothing here
    is a server path: `checkpoint_folder` is the folder's name in the checkpoint store
    (`checkpoint-000012`), which the server finds under its own checkpoint directory."""

    name: str  # the name as the client gave it
    kind: ModelKind
    base_model: str  # what a server loads (as base, or under LoRA adapters): the spec's model
    owned_by: str  # "system", or the project id
    created: datetime | None
    parent: str | None = None  # the base model as the job named it (app.fine_tuning.names)
    job_id: str | None = None
    step: int | None = None
    checkpoint_folder: str | None = None
    # A LoRA job started from a full checkpoint (`init_from`): its adapters sit on those
    # weights, not on `base_model`'s.
    base_checkpoint: NamedWeights | None = None
    # How the job's rollouts read the model, which its engine must repeat: the base model's
    # Hub revision (the spec's model_revision) and the rollout dtype.
    revision: str | None = None
    dtype: EngineDtype = DEFAULT_DTYPE
    # What the job's rollouts put around a conversation (app.gateway.chat_as_trained).
    prompt: TrainedPrompt | None = None
    # A Tinker sampler save's adapters (then job_id is None), and its tinker:// path.
    sampler: SamplerWeightsRef | None = None
    tinker_path: str | None = None


def not_found(name: str) -> ModelNotFound:
    return ModelNotFound(
        f"The model {name[:200]!r} does not exist or you do not have access to it.",
        param="model",
    )


def resolve_model(session: Session, *, project_id: str, name: str) -> ResolvedModel:
    """The model `name` names for `project_id`, or ModelNotFound (404 `model_not_found`)."""
    if name in PACKAGED_MODELS:
        return _base(session, project_id=project_id, name=name)
    saved = read_sampler_model_name(name)
    if saved is not None:
        return _sampler_save(session, project_id=project_id, name=name, saved=saved)
    named = read_fine_tuned_name(name) or _read_native_name(name)
    job = None
    if named is not None:
        job = jobs_repo.get_for_project(session, project_id=project_id, job_id=named.job_id)
    if named is None or job is None:
        if name in servers_repo.served_base_names(session):
            return _base(session, project_id=project_id, name=name)
        raise not_found(name)
    if named.step is None:
        own = fine_tuned_model_name(job)
        checkpoint = _final_checkpoint(session, job)
    else:
        own = checkpoint_model_name(job, named.step)
        checkpoint = checkpoints_repo.checkpoint_of_project_job(
            session, project_id=project_id, job_id=job.id, step=named.step
        )
    if checkpoint is None or (name.startswith(FINE_TUNED_PREFIX) and name != own):
        raise not_found(name)
    return _fine_tuned(job, checkpoint, name=name, final=named.step is None)


def _read_native_name(name: str) -> NamedWeights | None:
    """`job_...` (the final weights) or `job_...@N` (the checkpoint of step N)."""
    job_id, separator, step_text = name.partition(STEP_SEPARATOR)
    if not job_id.startswith(NATIVE_PREFIX):
        return None
    if not separator:
        return NamedWeights(job_id, None)
    step = parse_number(step_text, MAX_STEP)
    return None if step is None else NamedWeights(job_id, step)


def _final_checkpoint(session: Session, job: Job) -> Checkpoint | None:
    """A succeeded job's final weights: its newest kept checkpoint (the run saves one at its
    last step, and retention always keeps the newest)."""
    if job.status != JobStatus.SUCCEEDED:
        return None
    newest, _ = progress_repo.checkpoints_before(session, job_id=job.id, before_step=None, limit=1)
    return newest[0] if newest else None


def _base(session: Session, *, project_id: str, name: str) -> ResolvedModel:
    project = projects_repo.get_project(session, project_id=project_id)
    return ResolvedModel(
        name=name,
        kind=BASE.name,
        base_model=name,
        owned_by=SYSTEM_OWNER,
        created=project.created_at if project is not None else None,
    )


def _fine_tuned(job: Job, checkpoint: Checkpoint, *, name: str, final: bool) -> ResolvedModel:
    spec = job.spec or {}
    lora = bool(spec.get("lora"))
    init_from = spec.get("init_from") or None
    rollout = spec.get("rollout") or {}
    return ResolvedModel(
        name=name,
        kind=(LORA if lora else FULL).name,
        base_model=str(spec.get("model", "")),
        owned_by=job.project_id,
        created=job.finished_at if final else checkpoint.created_at,
        parent=base_model(job),
        job_id=job.id,
        step=checkpoint.step,
        checkpoint_folder=folder_name(checkpoint.path),
        base_checkpoint=NamedWeights(str(init_from["job_id"]), int(init_from["step"]))
        if lora and init_from
        else None,
        revision=spec.get("model_revision") or None,
        dtype=rollout.get("dtype") or DEFAULT_DTYPE,
        prompt=TrainedPrompt.of_spec(spec),
    )


def _sampler_save(
    session: Session, *, project_id: str, name: str, saved: SamplerModelName
) -> ResolvedModel:
    """A Tinker sampler save of the project, not expired, named with its client's base model
    (an `ft:` name) or by its path."""
    model = tinker_repo.get_model(session, project_id=project_id, model_id=saved.model_id)
    row = tinker_repo.live_checkpoint(
        session,
        project_id=project_id,
        model_id=saved.model_id,
        kind=SAMPLER_KIND,
        name=saved.name,
        now=utcnow(),
    )
    if model is None or row is None:
        raise not_found(name)
    if saved.base_model is not None and saved.base_model != model.base_model:
        raise not_found(name)
    return _sampler_model(row, model, name=name)


def _sampler_model(row: TinkerCheckpoint, model: TinkerModel, *, name: str) -> ResolvedModel:
    """A sampler save served: the adapters over the model its client trained (an alias's
    packaged model), named after the base model as the client named it."""
    created = as_utc(row.created_at)
    assert created is not None
    return ResolvedModel(
        name=name,
        kind=LORA.name,
        base_model=model.model_trained,
        owned_by=row.project_id,
        created=created,
        parent=model.base_model,
        sampler=SamplerWeightsRef(
            project_id=row.project_id,
            model_id=row.model_id,
            name=row.name,
            # An overwritten save is another version: engines load it anew.
            version=int(created.timestamp() * 1_000_000),
        ),
        tinker_path=tinker_path(row.model_id, SAMPLER_KIND, row.name),
    )


@dataclass(frozen=True)
class CataloguePage:
    models: list[ResolvedModel]
    has_more: bool
    next_after: str | None  # the last job id of this page, when there is more


def catalogue(session: Session, *, project_id: str, after: str | None, limit: int) -> CataloguePage:
    """The base models (on the first page: the packaged ones, then those the inference
    processes serve by name), then `limit` of the project's jobs holding kept checkpoints,
    newest first: each one's `ft:` name once it succeeded, then its newest
    `CHECKPOINTS_PER_JOB` checkpoints, newest first."""
    models = []
    if after is None:
        served = [b for b in servers_repo.served_base_names(session) if b not in PACKAGED_MODELS]
        bases = [*PACKAGED_MODELS, *served]
        models = [_base(session, project_id=project_id, name=name) for name in bases]
        saves = tinker_repo.newest_saves(
            session,
            project_id=project_id,
            kind=SAMPLER_KIND,
            now=utcnow(),
            limit=SAMPLER_SAVES_LISTED,
        )
        models.extend(
            _sampler_model(row, m, name=sampler_model_name(m.base_model, row.model_id, row.name))
            for row, m in saves
        )
    jobs, has_more = jobs_repo.list_page(
        session,
        project_id=project_id,
        after=after,
        limit=limit,
        statuses=None,
        with_kept_checkpoints=True,
    )
    kept = checkpoints_repo.newest_kept(
        session, job_ids=[j.id for j in jobs], per_job=CHECKPOINTS_PER_JOB
    )
    for job in jobs:
        checkpoints = kept.get(job.id, [])
        if checkpoints and job.status == JobStatus.SUCCEEDED:
            models.append(
                _fine_tuned(job, checkpoints[0], name=fine_tuned_model_name(job), final=True)
            )
        models.extend(
            _fine_tuned(job, c, name=checkpoint_model_name(job, c.step), final=False)
            for c in checkpoints
        )
    return CataloguePage(models, has_more, jobs[-1].id if jobs and has_more else None)


def model_object(model: ResolvedModel) -> ModelOut:
    """The model as OpenAI's model object (what a name resolves to stays in the gateway)."""
    return ModelOut(
        id=model.name,
        created=unix(model.created) or 0,
        owned_by=model.owned_by,
        parent=model.parent,
        grpo_service=ModelInfo(
            kind=model.kind, job_id=model.job_id, step=model.step, tinker_path=model.tinker_path
        ),
    )
