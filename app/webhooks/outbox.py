"""The transactional outbox of webhooks: a job event becomes one delivery row per subscribed
endpoint of the job's project, inserted in the transaction that changed the job. Nothing is
sent here: the workers deliver committed rows (worker.webhooks), so an event is never lost to a
process that dies after the commit, and never sent for a change that rolled back.

Called by app.jobs.transitions (status changes) and worker.progress (checkpoints)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.ids import new_id
from app.core.models import WebhookDelivery
from app.webhooks import repository as webhooks_repo
from app.webhooks.protocol import job_payload

DELIVERY_ID_PREFIX = "msg"


def record_job_event(
    session: Session,
    job_id: str,
    event_type: str,
    *,
    previous_status: str | None = None,
    step: int | None = None,
) -> int:
    """Queue `event_type` of the job for every endpoint subscribed to it; returns how many.
    One read when the project has no endpoints (the common case)."""
    endpoints = [
        endpoint_id
        for endpoint_id, events in webhooks_repo.subscribers_of_job(session, job_id=job_id)
        if event_type in events
    ]
    if not endpoints:
        return 0
    job = webhooks_repo.job_snapshot(session, job_id=job_id)
    if job is None:
        return 0
    now = utcnow()
    payload = job_payload(event_type, at=now, job=job, previous_status=previous_status, step=step)
    for endpoint_id in endpoints:
        webhooks_repo.add_delivery(
            session,
            delivery=WebhookDelivery(
                id=new_id(DELIVERY_ID_PREFIX),
                endpoint_id=endpoint_id,
                job_id=job_id,
                event_type=event_type,
                payload=payload,
                state=webhooks_repo.PENDING,
                attempts=0,
                next_attempt_at=now,
                queued_at=now,
                created_at=now,
            ),
        )
    return len(endpoints)
