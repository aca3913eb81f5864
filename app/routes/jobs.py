"""/v1/jobs: create, validate, list, read, cancel, events."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query
from fastapi.responses import JSONResponse

from app.deps import PrincipalDep, SessionDep, StateDep
from app.errors import InvalidRequest
from app.repositories import events as events_repo
from app.repositories import jobs as jobs_repo
from app.routes.common import CONFLICT, ERRORS
from app.schemas import EventList, JobList, JobOut, ValidationResult
from app.services import jobs as jobs_service
from app.services.presenters import event_out, job_out
from app.transitions import JobStatus
from trainer.config import JobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERRORS)

JobId = Annotated[str, Path(max_length=64, description="Job id.")]


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
    state: StateDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            max_length=255,
            description="Retries with the same key and body return the original job.",
        ),
    ] = None,
) -> JSONResponse:
    if idempotency_key is not None and not idempotency_key.strip():
        raise InvalidRequest("Idempotency-Key must not be blank", param="Idempotency-Key")
    outcome = jobs_service.create_job(
        state.sessions,
        state.dispatcher,
        project_id=principal.project_id,
        spec=spec,
        raw_body=spec.model_dump(mode="json"),
        idempotency_key=idempotency_key,
        idempotency_ttl=timedelta(hours=state.settings.idempotency_ttl_hours),
        max_attempts=state.settings.max_attempts,
        queue=state.settings.queue_name,
    )
    headers = {"Idempotent-Replayed": "true"} if outcome.replayed else {}
    return JSONResponse(outcome.body, status_code=outcome.status_code, headers=headers)


@router.post(
    "/validate",
    response_model=ValidationResult,
    summary="Dry run: resolve and check a spec without creating a job",
)
def validate_job(spec: JobSpec, principal: PrincipalDep, session: SessionDep) -> ValidationResult:
    rows: int | None = None
    if spec.dataset.rows is not None:
        rows = len(spec.dataset.rows)
    elif spec.dataset.generator is not None:
        rows = spec.dataset.generator.count
    elif (file := jobs_service.dataset_file(session, principal.project_id, spec)) is not None:
        rows = file.row_count
    return ValidationResult(
        spec=spec.model_dump(mode="json"), warnings=spec.warnings(), dataset_rows=rows
    )


@router.get("", response_model=JobList, summary="List jobs, newest first")
def list_jobs(
    principal: PrincipalDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="Cursor: last id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: Annotated[list[JobStatus] | None, Query(description="Filter by status.")] = None,
) -> JobList:
    rows, has_more = jobs_repo.list_page(
        session,
        principal.project_id,
        after=after,
        limit=limit,
        statuses=[s.value for s in status] if status else None,
    )
    return JobList(
        data=[job_out(j) for j in rows],
        has_more=has_more,
        next_after=rows[-1].id if rows and has_more else None,
    )


@router.get("/{job_id}", response_model=JobOut, summary="Get a job")
def get_job(job_id: JobId, principal: PrincipalDep, session: SessionDep) -> JobOut:
    return job_out(jobs_service.get_job(session, principal.project_id, job_id))


@router.post(
    "/{job_id}/cancel",
    response_model=JobOut,
    summary="Cancel a job (idempotent)",
    responses={409: CONFLICT | {"description": "The job is changing state; retry."}},
)
def cancel_job(job_id: JobId, principal: PrincipalDep, session: SessionDep) -> JobOut:
    return job_out(jobs_service.cancel_job(session, principal.project_id, job_id))


@router.get("/{job_id}/events", response_model=EventList, summary="A job's events, oldest first")
def list_events(
    job_id: JobId,
    principal: PrincipalDep,
    session: SessionDep,
    after: Annotated[int | None, Query(ge=0, le=2**62, description="Cursor: last id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventList:
    jobs_service.get_job(session, principal.project_id, job_id)
    rows, has_more = events_repo.list_after(session, job_id, after=after, limit=limit)
    return EventList(
        data=[event_out(e) for e in rows],
        has_more=has_more,
        next_after=rows[-1].id if rows else after,
    )
