"""What a job produces while it runs: metrics, samples, checkpoints, and the live stream."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query
from fastapi.responses import StreamingResponse

from app.core.deps import SessionDep, StateDep
from app.core.errors import InvalidRequest
from app.core.responses import ERRORS, SSE_RESPONSES, ErrorResponse
from app.jobs.deps import JobDep
from app.progress import checkpoint_download
from app.progress import metrics as metrics_service
from app.progress import repository as progress_repo
from app.progress.schemas import (
    CheckpointList,
    CheckpointOut,
    MetricSeries,
    SampleList,
    StepSamples,
)
from app.progress.stream import Cursor, EventStreamResponse, job_events
from app.sessions.deps import PrincipalDep

router = APIRouter(prefix="/v1/jobs", tags=["progress"], responses=ERRORS)

Step = Annotated[int | None, Query(ge=0, le=10**9)]


@router.get("/{job_id}/metrics", response_model=MetricSeries, summary="Per-step metric series")
def get_metrics(
    job: JobDep,
    session: SessionDep,
    names: Annotated[
        list[str] | None, Query(max_length=64, description="Metric names; default all.")
    ] = None,
    step_from: Step = None,
    step_to: Step = None,
    max_points: Annotated[
        int | None,
        Query(
            ge=1,
            le=10_000,
            description="Downsample to at most this many points per series (bucket mean, min, "
            "max, count over `bucket_steps` steps each). Without it: one point per step, paged "
            "by `limit`.",
        ),
    ] = None,
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=10_000,
            description="Without `max_points`: steps per page; follow `next_step_from`.",
        ),
    ] = 1000,
) -> MetricSeries:
    if step_from is not None and step_to is not None and step_from > step_to:
        raise InvalidRequest("step_from must be <= step_to", param="step_from")
    found = metrics_service.read(
        session,
        job_id=job.id,
        names=names,
        step_from=step_from,
        step_to=step_to,
        max_points=max_points,
        limit=limit,
    )
    return MetricSeries.model_validate(
        {
            "job_id": job.id,
            "steps": found.steps,
            "available": found.available,
            "series": found.series,
            "bucket_steps": found.bucket_steps,
            "next_step_from": found.next_step_from,
        }
    )


@router.get("/{job_id}/samples", response_model=SampleList, summary="Sampled rollouts per step")
def get_samples(
    job: JobDep,
    session: SessionDep,
    step: Step = None,
    after: Step = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> SampleList:
    rows, has_more = progress_repo.samples_page(
        session, job_id=job.id, after_step=after, step=step, limit=limit
    )
    data = [
        StepSamples.model_validate({"step": r.step, "attempt": r.attempt, "groups": r.data})
        for r in rows
    ]
    return SampleList(data=data, has_more=has_more, next_after=rows[-1].step if rows else after)


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, summary="Saved checkpoints")
def get_checkpoints(job: JobDep, session: SessionDep) -> CheckpointList:
    return CheckpointList(
        data=[
            CheckpointOut.model_validate(row, from_attributes=True)
            for row in progress_repo.checkpoints(session, job_id=job.id)
        ]
    )


@router.get(
    "/{job_id}/checkpoints/{step}/download",
    summary="Download a checkpoint's model as a tar archive",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-tar": {}},
            "description": "A tar archive with one folder `<job_id>-step<step>/`: the model "
            "(Hugging Face folder, or LoRA adapters) and tokenizer, without the trainer's "
            "resume state (optimizer, RNG states, manifest).",
        },
        410: {"model": ErrorResponse, "description": "The checkpoint's files were deleted."},
    },
)
def download_checkpoint(
    job: JobDep,
    session: SessionDep,
    state: StateDep,
    step: Annotated[int, Path(ge=0, le=10**9, description="The checkpoint's step.")],
) -> StreamingResponse:
    archive = checkpoint_download.locate(
        session,
        checkpoint_dir=state.settings.resolved_checkpoint_dir,
        job_id=job.id,
        step=step,
    )
    # The session closes when this function returns (SessionDep has scope="function"); the
    # archive is then read from disk in the threadpool, a chunk at a time.
    return StreamingResponse(
        archive.chunks(),
        media_type="application/x-tar",
        headers={
            "Content-Length": str(archive.size),
            "Content-Disposition": f'attachment; filename="{archive.filename}"',
        },
    )


@router.get(
    "/{job_id}/stream",
    summary="Server-sent events: status, events and metrics as they happen",
    response_class=StreamingResponse,
    responses={
        **SSE_RESPONSES,
        400: {
            "model": ErrorResponse,
            "description": "Last-Event-ID (or `after`) is not a cursor this stream sent.",
        },
    },
)
def stream(
    job: JobDep,
    principal: PrincipalDep,
    state: StateDep,
    last_event_id: Annotated[str | None, Header(max_length=64)] = None,
    after: Annotated[
        str | None,
        Query(
            max_length=64, description="Same as Last-Event-ID, for clients that cannot set headers."
        ),
    ] = None,
) -> StreamingResponse:
    cursor = Cursor.parse(last_event_id or after)
    settings = state.settings
    # Ownership was checked by JobDep in the request's unit of work, which is committed and
    # closed when this function returns, before the first byte is streamed (SessionDep has
    # scope="function"). The stream then reads in its own short transactions, one per poll
    # (app.progress.stream), so an open stream holds no connection while it waits.
    body = job_events(
        state.sessions,
        job.id,
        cursor,
        redis_url=settings.resolved_redis_url,
        heartbeat_s=settings.sse_heartbeat_seconds,
        poll_s=settings.sse_poll_seconds,
    )
    return EventStreamResponse(body, slots=state.limits.streams, key_id=principal.key_id)
