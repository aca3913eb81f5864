"""/v1/webhooks: a project's webhook endpoints and their delivery log (docs/webhooks.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from app.core.clock import as_utc, utcnow
from app.core.deps import SessionDep, StateDep
from app.core.models import WebhookEndpoint
from app.core.responses import ERRORS
from app.sessions.deps import PrincipalDep
from app.webhooks import repository as webhooks_repo
from app.webhooks import service as webhooks_service
from app.webhooks.deps import WebhookDep
from app.webhooks.schemas import (
    AttemptOut,
    DeliveryList,
    DeliveryOut,
    WebhookCreate,
    WebhookCreated,
    WebhookList,
    WebhookOut,
)

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=ERRORS)

DeliveryId = Annotated[str, Path(max_length=64, description="Delivery id (the webhook-id).")]


def _endpoint(row: WebhookEndpoint) -> WebhookOut:
    return WebhookOut(
        id=row.id,
        url=row.url,
        events=list(row.events),
        description=row.description,
        created_at=as_utc(row.created_at) or utcnow(),
    )


def _deliveries(page: webhooks_service.DeliveryPage) -> list[DeliveryOut]:
    return [
        DeliveryOut(
            id=d.id,
            endpoint_id=d.endpoint_id,
            job_id=d.job_id,
            event_type=d.event_type,
            state=d.state,  # type: ignore[arg-type]
            attempts=d.attempts,
            next_attempt_at=as_utc(d.next_attempt_at) if d.state == webhooks_repo.PENDING else None,
            delivered_at=as_utc(d.delivered_at),
            last_status_code=d.last_status_code,
            last_error=d.last_error,
            created_at=as_utc(d.created_at) or utcnow(),
            payload=d.payload,
            attempt_log=[
                AttemptOut(
                    attempt=a.attempt,
                    started_at=as_utc(a.started_at) or utcnow(),
                    duration_ms=a.duration_ms,
                    status_code=a.status_code,
                    error=a.error,
                    next_attempt_at=as_utc(a.next_attempt_at),
                )
                for a in page.attempts.get(d.id, [])
            ],
        )
        for d in page.rows
    ]


@router.post(
    "",
    status_code=201,
    response_model=WebhookCreated,
    summary="Create a webhook endpoint (its signing secret is shown only here)",
)
def create_webhook(
    body: WebhookCreate, principal: PrincipalDep, session: SessionDep, state: StateDep
) -> WebhookCreated:
    row = webhooks_service.create_endpoint(
        session,
        settings=state.settings,
        project_id=principal.project_id,
        url=body.url,
        events=list(body.events),
        description=body.description,
    )
    return WebhookCreated(**_endpoint(row).model_dump(exclude={"object"}), secret=row.secret)


@router.get("", response_model=WebhookList, summary="List webhook endpoints, newest first")
def list_webhooks(
    principal: PrincipalDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="Cursor: last id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> WebhookList:
    rows, has_more = webhooks_repo.list_endpoints(
        session, project_id=principal.project_id, after=after, limit=limit
    )
    return WebhookList(
        data=[_endpoint(r) for r in rows],
        has_more=has_more,
        next_after=rows[-1].id if rows and has_more else None,
    )


@router.get("/{webhook_id}", response_model=WebhookOut, summary="Get a webhook endpoint")
def get_webhook(webhook: WebhookDep) -> WebhookOut:
    return _endpoint(webhook)


@router.delete(
    "/{webhook_id}",
    status_code=204,
    summary="Delete a webhook endpoint and its deliveries (pending ones are never sent)",
)
def delete_webhook(webhook: WebhookDep, session: SessionDep) -> Response:
    webhooks_service.delete_endpoint(session, endpoint=webhook)
    return Response(status_code=204)


@router.get(
    "/{webhook_id}/deliveries",
    response_model=DeliveryList,
    summary="An endpoint's deliveries, newest first, each with its attempts",
)
def list_deliveries(
    webhook: WebhookDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="Cursor: last id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    job_id: Annotated[
        str | None, Query(max_length=64, description="Only the deliveries of this job.")
    ] = None,
) -> DeliveryList:
    page = webhooks_service.list_deliveries(
        session, endpoint=webhook, after=after, limit=limit, job_id=job_id
    )
    return DeliveryList(
        data=_deliveries(page),
        has_more=page.has_more,
        next_after=page.rows[-1].id if page.rows and page.has_more else None,
    )


@router.post(
    "/{webhook_id}/deliveries/{delivery_id}/redeliver",
    status_code=202,
    response_model=DeliveryOut,
    summary="Send a delivery again (same webhook-id), due now with a fresh retry window",
)
def redeliver(webhook: WebhookDep, delivery_id: DeliveryId, session: SessionDep) -> DeliveryOut:
    page = webhooks_service.redeliver(session, endpoint=webhook, delivery_id=delivery_id)
    return _deliveries(page)[0]
