"""A job's events and step metrics as one newest-first list with cursors (the OpenAI view's
fine_tuning.job.event objects). Cursor ids: `ftevent-e<event id>`, `ftevent-m<step>`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from app.core.errors import InvalidRequest
from app.core.ids import MAX_ID, MAX_STEP, parse_number
from app.core.models import JobEvent
from app.fine_tuning import timeline_repository as timeline_repo
from app.fine_tuning.timeline_repository import EVENT, METRICS, Point

PREFIX = "ftevent-"


@dataclass(frozen=True)
class MetricsEntry:
    step: int
    at: datetime
    values: dict[str, Any]


Entry = JobEvent | MetricsEntry


def _point(entry: Entry) -> tuple[datetime, int, int]:
    if isinstance(entry, MetricsEntry):
        return (entry.at, METRICS, entry.step)
    return (entry.created_at, EVENT, entry.id)


def _cursor(session: Session, job_id: str, after: str) -> Point:
    body = after.removeprefix(PREFIX)
    kind = body[:1]
    number = parse_number(body[1:], MAX_STEP if kind == "m" else MAX_ID)
    point = None
    if after.startswith(PREFIX) and number is not None:
        if kind == "e":
            point = timeline_repo.event_point(session, job_id=job_id, event_id=number)
        elif kind == "m":
            point = timeline_repo.metrics_point(session, job_id=job_id, step=number)
    if point is None:
        raise InvalidRequest(f"after {after!r:.80} is not an event of this job", param="after")
    return point


def page(
    session: Session, *, job_id: str, after: str | None, limit: int
) -> tuple[list[Entry], bool]:
    """Up to `limit` entries older than the entry `after` names (newest first), and whether
    there are more."""
    before = _cursor(session, job_id, after) if after else None
    events: list[Entry] = list(
        timeline_repo.events_before(session, job_id=job_id, before=before, limit=limit + 1)
    )
    metrics: list[Entry] = [
        MetricsEntry(step, at, values)
        for step, at, values in timeline_repo.metrics_before(
            session, job_id=job_id, before=before, limit=limit + 1
        )
    ]
    merged = sorted(events + metrics, key=_point, reverse=True)
    return merged[:limit], len(merged) > limit
