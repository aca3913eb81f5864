"""ORM rows -> API bodies."""

from __future__ import annotations

from app.clock import as_utc, utcnow
from app.models import Job, JobEvent
from app.schemas import EventOut, JobError, JobOut, JobProgress
from app.transitions import ACTIVE, JobStatus


def _eta(job: Job) -> float | None:
    """Seconds left from the mean step time of this attempt so far."""
    started = as_utc(job.step_started_at)
    done = job.current_step - job.run_started_step
    if job.status not in ACTIVE or started is None or done <= 0:
        return None
    per_step = (utcnow() - started).total_seconds() / done
    return round(per_step * max(0, job.total_steps - job.current_step), 1)


def job_out(job: Job) -> JobOut:
    heartbeat = as_utc(job.heartbeat_at)
    active = JobStatus(job.status) in ACTIVE
    return JobOut(
        id=job.id,
        name=job.name,
        status=job.status,
        model=str(job.spec.get("model", "")),
        created_at=as_utc(job.created_at) or utcnow(),
        updated_at=as_utc(job.updated_at) or utcnow(),
        started_at=as_utc(job.started_at),
        finished_at=as_utc(job.finished_at),
        attempt=job.attempt,
        max_attempts=job.max_attempts,
        error=JobError(code=job.error_code, message=job.error_message) if job.error_code else None,
        progress=JobProgress(
            step=job.current_step,
            total_steps=job.total_steps,
            last_metrics=job.last_metrics,
            heartbeat_age_s=round((utcnow() - heartbeat).total_seconds(), 3)
            if active and heartbeat
            else None,
            eta_s=_eta(job),
        ),
        metadata=dict(job.spec.get("metadata") or {}),
        spec=job.spec,
    )


def event_out(event: JobEvent) -> EventOut:
    return EventOut(
        id=event.id,
        job_id=event.job_id,
        attempt=event.attempt,
        type=event.type,
        level=event.level,
        message=event.message,
        data=event.data,
        created_at=as_utc(event.created_at) or utcnow(),
    )
