"""Webhook endpoints of a project: creation (URL confined, secret shown once, count bounded),
reads, deletion, and the delivery log with redelivery."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.core import projects_repository as projects_repo
from app.core.clock import utcnow
from app.core.errors import InvalidRequest, NotFound
from app.core.ids import new_id
from app.core.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from app.core.settings import Settings
from app.webhooks import repository as webhooks_repo
from app.webhooks.protocol import new_secret
from app.webhooks.urls import UrlRefused, check


def create_endpoint(
    session: Session,
    *,
    settings: Settings,
    project_id: str,
    url: str,
    events: list[str],
    description: str | None,
) -> WebhookEndpoint:
    """A new endpoint with a fresh secret. The URL must be http(s) and, unless the operator
    allows private addresses, name a host whose every address is public (422 naming `url`)."""
    if not events:
        raise InvalidRequest("events must name at least one event type", param="events")
    try:
        check(url, allow_private=settings.webhook_allow_private)
    except UrlRefused as exc:
        raise InvalidRequest(f"url {exc}", param="url") from exc
    # Counted under the project's lock: concurrent creates cannot pass the limit together.
    projects_repo.lock(session, project_id=project_id)
    cap = settings.max_webhooks_per_project
    if webhooks_repo.count_endpoints(session, project_id=project_id) >= cap:
        raise InvalidRequest(
            f"a project may hold at most {cap} webhook endpoints; delete one first", param="url"
        )
    return webhooks_repo.add_endpoint(
        session,
        endpoint=WebhookEndpoint(
            id=new_id("wh"),
            project_id=project_id,
            url=url,
            description=description,
            events=list(events),
            secret=new_secret(),
            created_at=utcnow(),
        ),
    )


def get_endpoint(session: Session, *, project_id: str, endpoint_id: str) -> WebhookEndpoint:
    """The project's endpoint, or NotFound naming `webhook_id`."""
    row = webhooks_repo.get_endpoint(session, project_id=project_id, endpoint_id=endpoint_id)
    if row is None:
        raise NotFound(f"webhook endpoint {endpoint_id} not found", param="webhook_id")
    return row


def delete_endpoint(session: Session, *, endpoint: WebhookEndpoint) -> None:
    """The endpoint, its deliveries (pending ones are never sent) and their attempts."""
    webhooks_repo.delete_endpoint(session, endpoint_id=endpoint.id)


@dataclass(frozen=True)
class DeliveryPage:
    rows: list[WebhookDelivery]
    attempts: dict[str, list[WebhookAttempt]]
    has_more: bool


def list_deliveries(
    session: Session,
    *,
    endpoint: WebhookEndpoint,
    after: str | None,
    limit: int,
    job_id: str | None,
) -> DeliveryPage:
    rows, has_more = webhooks_repo.list_deliveries(
        session, endpoint_id=endpoint.id, after=after, limit=limit, job_id=job_id
    )
    attempts = webhooks_repo.attempts_of(session, delivery_ids=[r.id for r in rows])
    return DeliveryPage(rows, attempts, has_more)


def redeliver(session: Session, *, endpoint: WebhookEndpoint, delivery_id: str) -> DeliveryPage:
    """Queue the delivery again, due now, with the same `webhook-id` and a fresh retry window."""
    row = webhooks_repo.get_delivery(session, endpoint_id=endpoint.id, delivery_id=delivery_id)
    if row is None:
        raise NotFound(f"delivery {delivery_id} not found", param="delivery_id")
    row = webhooks_repo.requeue(session, delivery=row, now=utcnow())
    return DeliveryPage([row], webhooks_repo.attempts_of(session, delivery_ids=[row.id]), False)
