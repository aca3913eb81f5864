"""/v1/jobs: create, validate, list, read, cancel, pause, resume, delete, events."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Body, Header, Query
from fastapi.responses import JSONResponse

from app.core.deps import SessionDep, StateDep
from app.core.errors import InvalidRequest
from app.core.responses import CONFLICT, ERRORS
from app.jobs import admission, capabilities, deletion, pausing
from app.jobs import events_repository as events_repo
from app.jobs import repository as jobs_repo
from app.jobs import service as jobs_service
from app.jobs.deps import JobCreationDep, JobDep
from app.jobs.presenters import event_out, job_out, job_summary
from app.jobs.schemas import (
    EventList,
    JobDeleted,
    JobList,
    JobOut,
    MemoryPlanOut,
    ResumeRequest,
    ValidationResult,
)
from app.jobs.service import Answer
from app.jobs.transitions import JobStatus
from app.sessions.deps import PrincipalDep
from jobspec import JobSpec, text_problem
from jobspec.memory_plan import refusal

# Set on the stored first answer of an idempotent retry (app.jobs.service.JobCreation).
REPLAYED_HEADER = "Idempotent-Replayed"


def created_response(answer: Answer) -> JSONResponse:
    """A create's answer as sent: the body already rendered (and stored for replays) is the
    response, so FastAPI does not validate and serialize the same model a second time; a
    replay carries the Idempotent-Replayed header."""
    headers = {REPLAYED_HEADER: "true"} if answer.replayed else None
    return JSONResponse(answer.body, status_code=answer.status_code, headers=headers)


router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERRORS)


def checked_idempotency_key(key: str | None) -> str | None:
    """The Idempotency-Key header as given, or a 4xx naming it when it cannot be stored."""
    if key is not None:
        problem = "must not be blank" if not key.strip() else None
        problem = problem or text_problem(key)
        if problem is not None:  # stored as text: Postgres refuses NUL
            raise InvalidRequest(f"Idempotency-Key {problem}", param="Idempotency-Key")
    return key


@router.post(
    "",
    status_code=201,
    response_model=JobOut,
    summary="Create a job",
    responses={409: CONFLICT | {"description": "Same Idempotency-Key still in flight."}},
)
def create_job(
    spec: JobSpec,
    principal: PrincipalDep,
    session: SessionDep,
    creation: JobCreationDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            max_length=255,
            description="Retries with the same key and body return the original job.",
        ),
    ] = None,
) -> JobOut | JSONResponse:
    checked_idempotency_key(idempotency_key)
    answer = creation.create(
        session,
        project_id=principal.project_id,
        spec=spec,
        idempotency_key=idempotency_key,
        render=lambda job: job_out(job).model_dump(mode="json"),
        status_code=201,
        warnings_field="warnings",
    )
    return created_response(answer)


@router.post(
    "/validate",
    response_model=ValidationResult,
    summary="Dry run: resolve and check a spec without creating a job",
    description="Also answers the job's memory plan per device (`plan`): creating a job whose "
    "plan does not fit the workers' devices is a 422 naming the numbers and what would fit.",
)
def validate_job(
    spec: JobSpec,
    principal: PrincipalDep,
    session: SessionDep,
    state: StateDep,
    creation: JobCreationDep,
) -> ValidationResult:
    rows = spec.dataset.known_row_count()
    if rows is None:  # an uploaded file: its row count was taken at upload
        file = jobs_service.dataset_file(session, project_id=principal.project_id, spec=spec)
        rows = file.row_count if file is not None else None
    jobs_service.check_validation_file(
        session, project_id=principal.project_id, spec=spec, train_rows=rows
    )
    # The same checks, in the same order, as creating the job.
    admission.admit(spec, settings=state.settings, project_id=principal.project_id, session=session)
    devices = spec.resources.devices
    waits = [
        creation.size_classes.warning(session, devices=devices),
        creation.size_classes.tinker_warning(session, devices=devices),
        capabilities.lora_rank_warning(session, spec),
    ]
    # Answered whether or not it fits: creating the job is what refuses one that does not.
    plan, unavailable = jobs_service.memory_plan(
        spec, state.settings, session, creation.size_classes
    )
    misfit = [refusal(plan)[0]] if plan is not None and not plan.fits else []
    return ValidationResult(
        spec=spec.model_dump(mode="json"),
        warnings=[*spec.warnings(), *[w for w in waits if w], *misfit],
        dataset_rows=rows,
        plan=MemoryPlanOut.model_validate(plan.as_dict()) if plan is not None else None,
        plan_unavailable=unavailable,
    )


@router.get(
    "",
    response_model=JobList,
    summary="List jobs, newest first",
    description="Job summaries: inline dataset rows are left out (`dataset.row_count` says how "
    "many); GET /v1/jobs/{id} has the full spec.",
)
def list_jobs(
    principal: PrincipalDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="Cursor: last id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: Annotated[list[JobStatus] | None, Query(description="Filter by status.")] = None,
) -> JobList:
    rows, has_more = jobs_repo.list_page(
        session,
        project_id=principal.project_id,
        after=after,
        limit=limit,
        statuses=[s.value for s in status] if status else None,
    )
    return JobList(
        data=[job_summary(j) for j in rows],
        has_more=has_more,
        next_after=rows[-1].id if rows and has_more else None,
    )


@router.get("/{job_id}", response_model=JobOut, summary="Get a job")
def get_job(job: JobDep) -> JobOut:
    return job_out(job)


@router.post(
    "/{job_id}/cancel",
    response_model=JobOut,
    summary="Cancel a job (idempotent)",
    responses={409: CONFLICT | {"description": "The job is changing state; retry."}},
)
def cancel_job(job: JobDep, session: SessionDep) -> JobOut:
    return job_out(jobs_service.cancel_job(session, job=job))


@router.post(
    "/{job_id}/pause",
    response_model=JobOut,
    summary="Pause a job (idempotent): it checkpoints and gives its worker back",
    responses={409: CONFLICT | {"description": "The job has ended or is being cancelled."}},
)
def pause_job(job: JobDep, session: SessionDep) -> JobOut:
    return job_out(pausing.pause_job(session, job=job))


@router.post(
    "/{job_id}/resume",
    response_model=JobOut,
    summary="Resume a paused or failed job from its last checkpoint (idempotent), optionally "
    "with changed settings",
    description="A failed job resumes with its error cleared and the operator's allowance of "
    'attempts given anew. With a body `{"set": {"grpo.learning_rate": 1e-5}}` the job '
    "resumes with those settings changed (the learning rate, steps, async staleness and the "
    "mismatch guard's bounds; anything else is a 422 naming the field).",
    responses={
        409: CONFLICT
        | {
            "description": "The job succeeded, was cancelled, is being cancelled, or (with "
            "changes) is neither paused nor failed."
        }
    },
)
def resume_job(
    job: JobDep,
    session: SessionDep,
    state: StateDep,
    changes: Annotated[ResumeRequest | None, Body()] = None,
) -> JobOut:
    if changes is not None and changes.set:
        resumed = pausing.resume_with_changes(
            session,
            job=job,
            changes=changes.set,
            dispatcher=state.dispatcher,
            settings=state.settings,
        )
        return job_out(resumed)
    resumed = pausing.resume_job(
        session,
        job=job,
        dispatcher=state.dispatcher,
        settings=state.settings,
    )
    return job_out(resumed)


@router.delete(
    "/{job_id}",
    response_model=JobDeleted,
    summary="Delete an ended job: hidden at once, its data purged after a grace period",
    responses={409: CONFLICT | {"description": "The job has not ended (cancel it first)."}},
)
def delete_job(job: JobDep, session: SessionDep, state: StateDep) -> JobDeleted:
    grace = timedelta(seconds=state.settings.delete_grace_seconds)
    purge_after = deletion.delete_job(session, job=job, grace=grace)
    return JobDeleted(id=job.id, purge_after=purge_after)


@router.get("/{job_id}/events", response_model=EventList, summary="A job's events, oldest first")
def list_events(
    job: JobDep,
    session: SessionDep,
    after: Annotated[int | None, Query(ge=0, le=2**62, description="Cursor: last id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventList:
    rows, has_more = events_repo.list_after(session, job_id=job.id, after=after, limit=limit)
    return EventList(
        data=[event_out(e) for e in rows],
        has_more=has_more,
        next_after=rows[-1].id if rows else after,
    )
