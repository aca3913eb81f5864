"""A job's timeline, newest first: its events and its step metrics, merged by time (the OpenAI
view lists both as fine_tuning.job.event objects, metrics as `type: metrics`).

A point of the timeline is (created_at, kind, key): kind 0 is a metrics row (key: its step),
kind 1 an event (key: its id), so the order is total and a cursor is one point."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from app.core.models import JobEvent, JobMetric

METRICS, EVENT = 0, 1


@dataclass(frozen=True)
class Point:
    at: datetime
    kind: int
    key: int


def event_point(session: Session, *, job_id: str, event_id: int) -> Point | None:
    at = session.scalar(
        select(JobEvent.created_at).where(JobEvent.job_id == job_id, JobEvent.id == event_id)
    )
    return None if at is None else Point(at, EVENT, event_id)


def metrics_point(session: Session, *, job_id: str, step: int) -> Point | None:
    at = session.scalar(
        select(JobMetric.created_at).where(JobMetric.job_id == job_id, JobMetric.step == step)
    )
    return None if at is None else Point(at, METRICS, step)


def events_before(
    session: Session, *, job_id: str, before: Point | None, limit: int
) -> list[JobEvent]:
    """Up to `limit` events older than `before` (all, without it), newest first."""
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if before is not None:
        earlier = JobEvent.created_at < before.at
        if before.kind == EVENT:
            earlier = or_(earlier, and_(JobEvent.created_at == before.at, JobEvent.id < before.key))
        query = query.where(earlier)
    order = (JobEvent.created_at.desc(), JobEvent.id.desc())
    return list(session.scalars(query.order_by(*order).limit(limit)))


def metrics_before(
    session: Session, *, job_id: str, before: Point | None, limit: int
) -> list[tuple[int, datetime, dict[str, Any]]]:
    """Up to `limit` (step, created_at, values) rows older than `before`, newest first."""
    query = select(JobMetric.step, JobMetric.created_at, JobMetric.values).where(
        JobMetric.job_id == job_id
    )
    if before is not None:
        if before.kind == METRICS:
            query = query.where(
                or_(
                    JobMetric.created_at < before.at,
                    and_(JobMetric.created_at == before.at, JobMetric.step < before.key),
                )
            )
        else:
            query = query.where(JobMetric.created_at <= before.at)
    order = (JobMetric.created_at.desc(), JobMetric.step.desc())
    return [(int(s), at, v) for s, at, v in session.execute(query.order_by(*order).limit(limit))]
