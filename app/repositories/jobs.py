"""Job queries. Every read takes the project id, so another project's job is simply not found."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from app.clock import utcnow
from app.models import Job

RUNNING_STATES = ("running", "cancelling")


def get_for_project(session: Session, project_id: str, job_id: str) -> Job | None:
    return session.scalars(
        select(Job).where(Job.id == job_id, Job.project_id == project_id)
    ).one_or_none()


def list_page(
    session: Session,
    project_id: str,
    *,
    after: str | None,
    limit: int,
    statuses: list[str] | None,
) -> tuple[list[Job], bool]:
    """Newest first. `after` is the last id of the previous page; ids are time-ordered."""
    query = select(Job).where(Job.project_id == project_id)
    if statuses:
        query = query.where(Job.status.in_(statuses))
    if after:
        query = query.where(Job.id < after)
    rows = list(session.scalars(query.order_by(Job.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def mark_dispatched(session: Session, job_id: str) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(dispatched_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def heartbeat(session: Session, job_id: str, attempt: int) -> str | None:
    """Refresh the lease of `attempt`; return the job status, or None when the lease is lost."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(RUNNING_STATES))
        .values(heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return session.scalar(select(Job.status).where(Job.id == job_id))


def update_progress(session: Session, job_id: str, attempt: int, values: dict[str, Any]) -> bool:
    """Progress fields (step, last metrics) of the lease holder; False if the lease is lost."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(RUNNING_STATES))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def stale_running(session: Session, older_than: datetime) -> list[Job]:
    """Running jobs whose worker stopped heartbeating (or never did)."""
    return list(
        session.scalars(
            select(Job).where(
                Job.status.in_(RUNNING_STATES),
                or_(
                    Job.heartbeat_at < older_than,
                    and_(Job.heartbeat_at.is_(None), Job.updated_at < older_than),
                ),
            )
        )
    )


def undispatched_queued(session: Session, older_than: datetime) -> list[Job]:
    """Queued jobs whose message may have been lost by the broker."""
    return list(
        session.scalars(
            select(Job).where(
                Job.status == "queued",
                or_(Job.dispatched_at.is_(None), Job.dispatched_at < older_than),
                Job.updated_at < older_than,
            )
        )
    )
