"""Deleting a job: the mark its owner sets (`jobs.deleted_at`), and the purge of what it
produced once the grace period is over (`jobs.purged_at`).

The job row itself stays, marked: every project-scoped read leaves it out
(`app.jobs.repository`), its id is never reused, and a second purge finds nothing to do."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Row, delete, select, update
from sqlalchemy.orm import Session

from app.core.models import Checkpoint, Job, JobEvent, JobMetric, JobMetricRollup, JobSample

# What a job produced, purged with it; the job row stays.
_PRODUCED = (JobSample, JobMetric, JobMetricRollup, JobEvent, Checkpoint)


def mark_deleted(
    session: Session, *, job_id: str, project_id: str, ended: Sequence[str], now: datetime
) -> bool:
    """Mark the project's job deleted when it has ended (status in `ended`) and is not deleted
    yet: one conditional update, so a job that is still running is never marked. True when it
    matched."""
    result = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.project_id == project_id,
            Job.status.in_(list(ended)),
            Job.deleted_at.is_(None),
        )
        .values(deleted_at=now)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def purgeable(session: Session, *, deleted_before: datetime, limit: int) -> list[Row[tuple[str]]]:
    """(id,) of jobs deleted before `deleted_before` and not purged yet, oldest deletion first."""
    return list(
        session.execute(
            select(Job.id)
            .where(
                Job.deleted_at.is_not(None),
                Job.deleted_at <= deleted_before,
                Job.purged_at.is_(None),
            )
            .order_by(Job.deleted_at)
            .limit(limit)
        )
    )


def purge_rows(session: Session, *, job_id: str, now: datetime) -> None:
    """Delete the job's samples, metrics, rollups, events and checkpoint rows, and stamp it
    purged. Idempotent."""
    for model in _PRODUCED:
        session.execute(
            delete(model).where(model.job_id == job_id).execution_options(synchronize_session=False)
        )
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.purged_at.is_(None))
        .values(purged_at=now)
        .execution_options(synchronize_session=False)
    )
