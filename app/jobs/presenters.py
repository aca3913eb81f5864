"""ORM rows -> API bodies: the HTTP representation of domain objects.

Here, beside the routes, and not in the services: services return ORM rows and dataclasses, and
only the HTTP layer decides what a response looks like (the JSON routes, the SSE stream, and the
body stored for an idempotent replay all come from these functions)."""

from __future__ import annotations

from typing import Any

from app.core.clock import as_utc, utcnow
from app.core.job_status import LEASE_HOLDING_STATES, JobStatus
from app.core.models import Job, JobEvent
from app.jobs.schemas import EventOut, JobError, JobOut, JobProgress, JobSummary


def _eta(job: Job) -> float | None:
    """Seconds left from the mean step time of this attempt so far."""
    started = as_utc(job.step_started_at)
    done = job.current_step - job.run_started_step
    if job.status not in LEASE_HOLDING_STATES or started is None or done <= 0:
        return None
    per_step = (utcnow() - started).total_seconds() / done
    return round(per_step * max(0, job.total_steps - job.current_step), 1)


def _job_fields(job: Job) -> dict[str, Any]:
    """Every JobOut field but the spec."""
    heartbeat = as_utc(job.heartbeat_at)
    active = JobStatus(job.status) in LEASE_HOLDING_STATES
    return {
        "id": job.id,
        "name": job.name,
        "status": job.status,
        "model": str(job.spec.get("model", "")),
        "devices": job.devices,
        "created_at": as_utc(job.created_at) or utcnow(),
        "updated_at": as_utc(job.updated_at) or utcnow(),
        "started_at": as_utc(job.started_at),
        "finished_at": as_utc(job.finished_at),
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "error": JobError(code=job.error_code, message=job.error_message)
        if job.error_code
        else None,
        "progress": JobProgress(
            step=job.current_step,
            total_steps=job.total_steps,
            last_metrics=job.last_metrics,
            heartbeat_age_s=round((utcnow() - heartbeat).total_seconds(), 3)
            if active and heartbeat
            else None,
            eta_s=_eta(job),
        ),
        "metadata": dict(job.spec.get("metadata") or {}),
    }


def job_out(job: Job) -> JobOut:
    return JobOut(**_job_fields(job), spec=job.spec)


def lean_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec without its inline dataset rows (a list shows many jobs; rows can be megabytes
    each), with their count in their place. Shallow copies: the stored spec is not touched."""
    dataset = spec.get("dataset")
    if not isinstance(dataset, dict) or dataset.get("rows") is None:
        return spec
    lean = {k: v for k, v in dataset.items() if k != "rows"}
    lean["row_count"] = len(dataset["rows"])
    return {**spec, "dataset": lean}


def job_summary(job: Job) -> JobSummary:
    """A job as GET /v1/jobs lists it: the JobOut fields with `lean_spec`."""
    return JobSummary(**_job_fields(job), spec=lean_spec(job.spec))


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
