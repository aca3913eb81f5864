"""/v1/fine_tuning: OpenAI's fine-tuning API over native jobs, so the `openai` SDK works
against this service unchanged (docs/openai-compat.md). Errors here are 400 where the native
API answers 422 (app.core.error_handlers), as the SDK expects."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.core.deps import SessionDep, StateDep
from app.core.errors import ApiError, InvalidRequest
from app.core.ids import parse_number
from app.core.models import Job
from app.core.responses import CONFLICT, OPENAI_ERRORS
from app.fine_tuning import service as fine_tuning
from app.fine_tuning import timeline
from app.fine_tuning.presenters import (
    CHECKPOINT_PREFIX,
    event_from_metrics,
    event_from_row,
    openai_checkpoint,
    openai_job,
)
from app.fine_tuning.schemas import (
    FineTuningCheckpointList,
    FineTuningEventList,
    FineTuningJobCreate,
    FineTuningJobList,
    FineTuningJobOut,
)
from app.graders import routes as graders_routes
from app.graders.schemas import GraderRunOut, GraderValidateOut
from app.jobs import pausing
from app.jobs import repository as jobs_repo
from app.jobs import service as jobs_service
from app.jobs.deps import JobCreationDep, JobDep
from app.jobs.idempotency import spec_fingerprint
from app.jobs.routes import checked_idempotency_key, created_response
from app.progress import metrics_repository as metrics_repo
from app.progress import repository as progress_repo
from app.sessions.deps import PrincipalDep

router = APIRouter(prefix="/v1/fine_tuning", tags=["fine-tuning (OpenAI)"], responses=OPENAI_ERRORS)

TOKENS = "tokens/trained"
_METADATA_KEY = re.compile(r"^metadata\[(.{1,64})\]$")
MAX_METADATA_FILTERS = 16


def _one(session: Session, job: Job) -> FineTuningJobOut:
    tokens = metrics_repo.totals(session, job_ids=[job.id], name=TOKENS)
    return openai_job(job, trained_tokens=tokens.get(job.id))


@router.post("/jobs", response_model=FineTuningJobOut, summary="Create a fine-tuning job")
def create_job(
    body: FineTuningJobCreate,
    principal: PrincipalDep,
    session: SessionDep,
    state: StateDep,
    creation: JobCreationDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JSONResponse:
    key = checked_idempotency_key(idempotency_key)
    fine_tuning.refuse_methods(body)
    rows = fine_tuning.training_rows(
        session, project_id=principal.project_id, file_id=body.training_file
    )
    translation = fine_tuning.translate(body, train_rows=rows, models=state.settings.openai_models)
    try:
        answer = creation.create(
            session,
            project_id=principal.project_id,
            spec=translation.spec,
            idempotency_key=key,
            render=lambda job: openai_job(job, trained_tokens=None).model_dump(mode="json"),
            status_code=200,
            openai=translation.openai,
            fingerprint=spec_fingerprint({"openai": body.model_dump(mode="json")}),
        )
    except ApiError as exc:
        raise fine_tuning.in_request_terms(exc, translation) from None
    return created_response(answer)


def _metadata_filters(request: Request) -> dict[str, str]:
    filters: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        match = _METADATA_KEY.match(name)
        if match is None:
            continue
        if len(value) > 512 or len(filters) >= MAX_METADATA_FILTERS:
            raise InvalidRequest(
                "at most 16 metadata filters, values up to 512 characters", param=name
            )
        filters[match.group(1)] = value
    return filters


@router.get("/jobs", response_model=FineTuningJobList, summary="List fine-tuning jobs")
def list_jobs(
    request: Request,
    principal: PrincipalDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="Last job id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> FineTuningJobList:
    rows, has_more = jobs_repo.list_page(
        session,
        project_id=principal.project_id,
        after=after,
        limit=limit,
        statuses=None,
        metadata=_metadata_filters(request),
    )
    tokens = metrics_repo.totals(session, job_ids=[j.id for j in rows], name=TOKENS)
    return FineTuningJobList(
        data=[openai_job(j, trained_tokens=tokens.get(j.id)) for j in rows], has_more=has_more
    )


@router.get("/jobs/{job_id}", response_model=FineTuningJobOut, summary="Retrieve a job")
def retrieve_job(job: JobDep, session: SessionDep) -> FineTuningJobOut:
    return _one(session, job)


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=FineTuningJobOut,
    summary="Cancel a job",
    responses={409: CONFLICT},
)
def cancel_job(job: JobDep, session: SessionDep) -> FineTuningJobOut:
    return _one(session, jobs_service.cancel_job(session, job=job))


@router.post(
    "/jobs/{job_id}/pause",
    response_model=FineTuningJobOut,
    summary="Pause a job: it checkpoints and gives its worker back",
    responses={409: CONFLICT},
)
def pause_job(job: JobDep, session: SessionDep) -> FineTuningJobOut:
    return _one(session, pausing.pause_job(session, job=job))


@router.post(
    "/jobs/{job_id}/resume",
    response_model=FineTuningJobOut,
    summary="Resume a paused job from its last checkpoint",
    responses={409: CONFLICT},
)
def resume_job(job: JobDep, session: SessionDep, state: StateDep) -> FineTuningJobOut:
    resumed = pausing.resume_job(
        session,
        job=job,
        dispatcher=state.dispatcher,
        settings=state.settings,
    )
    return _one(session, resumed)


@router.get(
    "/jobs/{job_id}/events",
    response_model=FineTuningEventList,
    summary="A job's events and per-step metrics (type: metrics), newest first",
)
def list_events(
    job: JobDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="Last event id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> FineTuningEventList:
    entries, has_more = timeline.page(session, job_id=job.id, after=after, limit=limit)
    data = [
        event_from_metrics(e.step, e.at, e.values, job.total_steps)
        if isinstance(e, timeline.MetricsEntry)
        else event_from_row(e)
        for e in entries
    ]
    return FineTuningEventList(data=data, has_more=has_more)


@router.get(
    "/jobs/{job_id}/checkpoints",
    response_model=FineTuningCheckpointList,
    summary="A job's checkpoints, newest first",
)
def list_checkpoints(
    job: JobDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="Last checkpoint id.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> FineTuningCheckpointList:
    before_step = None
    if after is not None:
        number = parse_number(after.removeprefix(CHECKPOINT_PREFIX))
        seen = (
            progress_repo.checkpoint_by_id(session, job_id=job.id, checkpoint_id=number)
            if after.startswith(CHECKPOINT_PREFIX) and number is not None
            else None
        )
        if seen is None:
            raise InvalidRequest(
                f"after {after!r:.80} is not a checkpoint of this job", param="after"
            )
        before_step = seen.step
    rows, has_more = progress_repo.checkpoints_before(
        session, job_id=job.id, before_step=before_step, limit=limit
    )
    values = progress_repo.metric_values_at(session, job_id=job.id, steps=[c.step for c in rows])
    data = [openai_checkpoint(job, c, values.get(c.step)) for c in rows]
    return FineTuningCheckpointList(
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


# OpenAI's grader endpoints: the same engine and bodies as /v1/graders.
router.add_api_route(
    "/alpha/graders/run",
    graders_routes.run_grader,
    methods=["POST"],
    response_model=GraderRunOut,
    summary="Run a grader on one sample (OpenAI's path)",
)
router.add_api_route(
    "/alpha/graders/validate",
    graders_routes.validate_grader,
    methods=["POST"],
    response_model=GraderValidateOut,
    summary="Check a grader without running it (OpenAI's path)",
)
