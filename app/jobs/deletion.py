"""Deleting a job (`DELETE /v1/jobs/{id}`).

Only an ended job (succeeded, failed, cancelled) can be deleted: a running one must be
cancelled first, so no worker is still writing what the purge removes. Deletion is not a status
change (the job's outcome stays as it was, and app.jobs.transitions is not involved): it sets
`jobs.deleted_at`, from which on every read of a project leaves the job out (404). After the
operator's grace period (`delete_grace_seconds`) the workers' maintenance pass purges its
checkpoints from disk and its samples, metrics, rollups, events and checkpoint rows
(`worker.maintenance.purge_deleted_jobs`)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.errors import IllegalTransition, NotFound
from app.core.models import Job
from app.jobs import deletion_repository as deletion_repo
from app.jobs import repository as jobs_repo
from app.jobs.transitions import TERMINAL, add_event

ENDED = tuple(sorted(status.value for status in TERMINAL))


def delete_job(session: Session, *, job: Job, grace: timedelta) -> datetime:
    """Mark the caller's ended `job` deleted; returns when its purge may start. 409
    (`invalid_state`, param `job_id`) when it has not ended."""
    now = utcnow()
    if deletion_repo.mark_deleted(
        session, job_id=job.id, project_id=job.project_id, ended=ENDED, now=now
    ):
        add_event(
            session,
            job.id,
            "deleted",
            "job deleted by its owner",
            data={"grace_s": grace.total_seconds()},
        )
        return now + grace
    current = jobs_repo.get_for_project(session, project_id=job.project_id, job_id=job.id)
    if current is None:  # deleted by a concurrent request
        raise NotFound(f"job {job.id} not found", param="job_id")
    status = jobs_repo.status_and_attempt(session, job_id=job.id)
    state = status[0] if status is not None else job.status
    raise IllegalTransition(
        f"job {job.id} is {state}: only an ended job (succeeded, failed or cancelled) can be "
        "deleted; cancel it first",
        param="job_id",
    )
