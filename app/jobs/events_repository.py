"""Job event queries (the audit log of a job)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.models import JobEvent
from app.core.new_rows_repository import insert_row


def add(session: Session, *, event: JobEvent) -> JobEvent:
    session.add(event)
    session.flush()
    return event


def insert_new(session: Session, *, event: JobEvent) -> None:
    """`add` for an event whose id the caller does not need: one INSERT, no ORM unit of work
    (app.core.new_rows_repository)."""
    insert_row(session, event)


def list_after(
    session: Session, *, job_id: str, after: int | None, limit: int
) -> tuple[list[JobEvent], bool]:
    """Oldest first, strictly after the event id `after`."""
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if after is not None:
        query = query.where(JobEvent.id > after)
    rows = list(session.scalars(query.order_by(JobEvent.id).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def has_event(session: Session, *, job_id: str, event: str, attempt: int) -> bool:
    """Whether the job has an `event` event of `attempt`."""
    query = select(JobEvent.id).where(
        JobEvent.job_id == job_id, JobEvent.type == event, JobEvent.attempt == attempt
    )
    return session.scalar(query.limit(1)) is not None
