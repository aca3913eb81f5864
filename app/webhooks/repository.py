"""Webhook queries: a project's endpoints, the delivery outbox, and the attempts log.

Reads made for a caller take the project (or its endpoint) id, so another project's endpoint is
simply not found. Deliveries are claimed by workers with a compare-and-set on `attempts` (and
`FOR UPDATE SKIP LOCKED` on Postgres, so concurrent workers pass over each other's rows)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from app.core.models import Job, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from app.core.new_rows_repository import insert_row

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"

# The job columns an event payload reads (app.webhooks.protocol.job_payload).
_JOB_COLUMNS = (
    Job.id,
    Job.name,
    Job.status,
    Job.attempt,
    Job.current_step,
    Job.total_steps,
    Job.error_code,
    Job.error_message,
)


# -- endpoints ---------------------------------------------------------------------------


def add_endpoint(session: Session, *, endpoint: WebhookEndpoint) -> WebhookEndpoint:
    session.add(endpoint)
    session.flush()
    return endpoint


def count_endpoints(session: Session, *, project_id: str) -> int:
    query = select(func.count()).where(WebhookEndpoint.project_id == project_id)
    return int(session.execute(query).scalar_one())


def get_endpoint(session: Session, *, project_id: str, endpoint_id: str) -> WebhookEndpoint | None:
    return session.scalars(
        select(WebhookEndpoint).where(
            WebhookEndpoint.id == endpoint_id, WebhookEndpoint.project_id == project_id
        )
    ).one_or_none()


def list_endpoints(
    session: Session, *, project_id: str, after: str | None, limit: int
) -> tuple[list[WebhookEndpoint], bool]:
    """Newest first; `after` is the last id of the previous page (ids are time-ordered)."""
    query = select(WebhookEndpoint).where(WebhookEndpoint.project_id == project_id)
    if after:
        query = query.where(WebhookEndpoint.id < after)
    rows = list(session.scalars(query.order_by(WebhookEndpoint.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_endpoint(session: Session, *, endpoint_id: str) -> None:
    """The endpoint and, by cascade, its deliveries and their attempts."""
    session.execute(
        delete(WebhookAttempt).where(
            WebhookAttempt.delivery_id.in_(
                select(WebhookDelivery.id).where(WebhookDelivery.endpoint_id == endpoint_id)
            )
        )
    )
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id))
    session.execute(delete(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id))


# -- the outbox --------------------------------------------------------------------------


def subscribers_of_job(session: Session, *, job_id: str) -> list[tuple[str, list[Any]]]:
    """(endpoint id, events) of every endpoint of the job's project: one indexed read."""
    query = (
        select(WebhookEndpoint.id, WebhookEndpoint.events)
        .join(Job, Job.project_id == WebhookEndpoint.project_id)
        .where(Job.id == job_id)
    )
    return [(row.id, list(row.events or [])) for row in session.execute(query)]


def job_snapshot(session: Session, *, job_id: str) -> dict[str, Any] | None:
    """The job's payload columns as this transaction sees them (after its own status change)."""
    row = session.execute(select(*_JOB_COLUMNS).where(Job.id == job_id)).one_or_none()
    return dict(row._mapping) if row is not None else None


def add_delivery(session: Session, *, delivery: WebhookDelivery) -> None:
    insert_row(session, delivery)


def list_deliveries(
    session: Session, *, endpoint_id: str, after: str | None, limit: int, job_id: str | None
) -> tuple[list[WebhookDelivery], bool]:
    """Newest first; `after` is the last id of the previous page."""
    query = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
    if job_id is not None:
        query = query.where(WebhookDelivery.job_id == job_id)
    if after:
        query = query.where(WebhookDelivery.id < after)
    rows = list(session.scalars(query.order_by(WebhookDelivery.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def get_delivery(session: Session, *, endpoint_id: str, delivery_id: str) -> WebhookDelivery | None:
    return session.scalars(
        select(WebhookDelivery).where(
            WebhookDelivery.id == delivery_id, WebhookDelivery.endpoint_id == endpoint_id
        )
    ).one_or_none()


def attempts_of(session: Session, *, delivery_ids: list[str]) -> dict[str, list[WebhookAttempt]]:
    """The attempts of these deliveries, oldest first, by delivery id."""
    found: dict[str, list[WebhookAttempt]] = {d: [] for d in delivery_ids}
    if delivery_ids:
        query = (
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(delivery_ids))
            .order_by(WebhookAttempt.id)
        )
        for attempt in session.scalars(query):
            found[attempt.delivery_id].append(attempt)
    return found


def requeue(session: Session, *, delivery: WebhookDelivery, now: datetime) -> WebhookDelivery:
    """Due now again, with a fresh retry window; the id (the `webhook-id`) stays."""
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery.id)
        .values(state=PENDING, next_attempt_at=now, queued_at=now)
        .execution_options(synchronize_session=False)
    )
    session.refresh(delivery)
    return delivery


# -- the worker's side -------------------------------------------------------------------


@dataclass(frozen=True)
class Claimed:
    """A delivery a worker holds until `lease_until`: what it needs to send it."""

    id: str
    attempt: int
    payload: dict[str, Any]
    queued_at: datetime
    url: str
    secret: str


def claim_due(session: Session, *, now: datetime, lease_until: datetime) -> Claimed | None:
    """Take the delivery due longest: attempts += 1 and due again only at `lease_until` (so a
    worker that dies while sending leaves it to be tried again), in one compare-and-set."""
    query = (
        select(
            WebhookDelivery.id,
            WebhookDelivery.attempts,
            WebhookDelivery.payload,
            WebhookDelivery.queued_at,
            WebhookEndpoint.url,
            WebhookEndpoint.secret,
        )
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.state == PENDING, WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(1)
        .with_for_update(of=WebhookDelivery, skip_locked=True)
    )
    row = session.execute(query).one_or_none()
    if row is None:
        return None
    matched = session.execute(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == row.id,
            WebhookDelivery.state == PENDING,
            WebhookDelivery.attempts == row.attempts,
        )
        .values(attempts=row.attempts + 1, next_attempt_at=lease_until)
        .execution_options(synchronize_session=False)
    )
    if matched.rowcount != 1:  # type: ignore[attr-defined]
        return None  # another worker took it first (SQLite has no row locks)
    return Claimed(
        id=row.id,
        attempt=row.attempts + 1,
        payload=row.payload,
        queued_at=row.queued_at,
        url=row.url,
        secret=row.secret,
    )


def record_attempt(
    session: Session,
    *,
    claimed: Claimed,
    started_at: datetime,
    duration_ms: int,
    status_code: int | None,
    error: str | None,
    state: str,
    next_attempt_at: datetime | None,
) -> bool:
    """Log one attempt and move the delivery on (delivered, failed, or due again); fenced by
    the attempt number, so a worker whose lease ran out (another took the delivery over)
    changes nothing. True when recorded."""
    values: dict[str, Any] = {
        "state": state,
        "last_status_code": status_code,
        "last_error": error,
    }
    if state == DELIVERED:
        values["delivered_at"] = started_at
    if next_attempt_at is not None:
        values["next_attempt_at"] = next_attempt_at
    matched = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == claimed.id, WebhookDelivery.attempts == claimed.attempt)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if matched.rowcount != 1:  # type: ignore[attr-defined]
        return False
    insert_row(
        session,
        WebhookAttempt(
            delivery_id=claimed.id,
            attempt=claimed.attempt,
            started_at=started_at,
            duration_ms=duration_ms,
            status_code=status_code,
            error=error,
            next_attempt_at=next_attempt_at,
        ),
    )
    return True


def prune_finished(session: Session, *, before: datetime, limit: int) -> int:
    """Delete up to `limit` delivered or failed deliveries queued before `before`, with their
    attempts; returns how many."""
    ids = list(
        session.scalars(
            select(WebhookDelivery.id)
            .where(
                WebhookDelivery.state.in_((DELIVERED, FAILED)),
                WebhookDelivery.queued_at < before,
            )
            .limit(limit)
        )
    )
    if ids:
        session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(ids)))
        session.execute(delete(WebhookDelivery).where(WebhookDelivery.id.in_(ids)))
    return len(ids)
