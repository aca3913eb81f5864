"""What a job produces while it runs: metrics, samples, checkpoints, and the live stream."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query
from fastapi.responses import StreamingResponse

from app.deps import PrincipalDep, SessionDep, StateDep
from app.errors import InvalidRequest
from app.repositories import progress as progress_repo
from app.routes.common import ERRORS
from app.schemas import CheckpointList, CheckpointOut, MetricSeries, SampleList, StepSamples
from app.services import jobs as jobs_service
from app.services import metrics as metrics_service
from app.services.stream import Cursor, job_events

router = APIRouter(prefix="/v1/jobs", tags=["progress"], responses=ERRORS)

JobId = Annotated[str, Path(max_length=64, description="Job id.")]
Step = Annotated[int | None, Query(ge=0, le=10**9)]


@router.get("/{job_id}/metrics", response_model=MetricSeries, summary="Per-step metric series")
def get_metrics(
    job_id: JobId,
    principal: PrincipalDep,
    session: SessionDep,
    names: Annotated[
        list[str] | None, Query(max_length=64, description="Metric names; default all.")
    ] = None,
    step_from: Step = None,
    step_to: Step = None,
    max_points: Annotated[
        int | None,
        Query(ge=1, le=10_000, description="Downsample to at most this many points per series."),
    ] = None,
) -> MetricSeries:
    jobs_service.get_job(session, principal.project_id, job_id)
    if step_from is not None and step_to is not None and step_from > step_to:
        raise InvalidRequest("step_from must be <= step_to", param="step_from")
    rows = progress_repo.metric_rows(session, job_id, step_from=step_from, step_to=step_to)
    series, available = metrics_service.series(rows, names, max_points)
    return MetricSeries.model_validate(
        {"job_id": job_id, "steps": len(rows), "available": available, "series": series}
    )


@router.get("/{job_id}/samples", response_model=SampleList, summary="Sampled rollouts per step")
def get_samples(
    job_id: JobId,
    principal: PrincipalDep,
    session: SessionDep,
    step: Step = None,
    after: Step = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> SampleList:
    jobs_service.get_job(session, principal.project_id, job_id)
    rows, has_more = progress_repo.samples_page(
        session, job_id, after_step=after, step=step, limit=limit
    )
    data = [
        StepSamples.model_validate({"step": r.step, "attempt": r.attempt, "groups": r.data})
        for r in rows
    ]
    return SampleList(data=data, has_more=has_more, next_after=rows[-1].step if rows else after)


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, summary="Saved checkpoints")
def get_checkpoints(job_id: JobId, principal: PrincipalDep, session: SessionDep) -> CheckpointList:
    jobs_service.get_job(session, principal.project_id, job_id)
    return CheckpointList(
        data=[
            CheckpointOut.model_validate(row, from_attributes=True)
            for row in progress_repo.checkpoints(session, job_id)
        ]
    )


@router.get(
    "/{job_id}/stream",
    summary="Server-sent events: status, events and metrics as they happen",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "An SSE stream."}},
)
def stream(
    job_id: JobId,
    principal: PrincipalDep,
    session: SessionDep,
    state: StateDep,
    last_event_id: Annotated[str | None, Header(max_length=64)] = None,
    after: Annotated[
        str | None,
        Query(
            max_length=64, description="Same as Last-Event-ID, for clients that cannot set headers."
        ),
    ] = None,
) -> StreamingResponse:
    jobs_service.get_job(session, principal.project_id, job_id)
    cursor = Cursor.parse(last_event_id or after)
    settings = state.settings
    body = job_events(
        state.sessions,
        job_id,
        cursor,
        redis_url=settings.resolved_redis_url,
        heartbeat_s=settings.sse_heartbeat_seconds,
        poll_s=settings.sse_poll_seconds,
    )
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
