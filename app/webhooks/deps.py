"""The loader of the webhook endpoint named in the path: the caller's, or 404."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path

from app.core.deps import SessionDep
from app.core.models import WebhookEndpoint
from app.sessions.deps import PrincipalDep
from app.webhooks import service as webhooks_service

WebhookId = Annotated[str, Path(max_length=64, description="Webhook endpoint id.")]


def get_webhook(
    webhook_id: WebhookId, principal: PrincipalDep, session: SessionDep
) -> WebhookEndpoint:
    """The caller's webhook endpoint named in the path, or 404 (param `webhook_id`)."""
    return webhooks_service.get_endpoint(
        session, project_id=principal.project_id, endpoint_id=webhook_id
    )


WebhookDep = Annotated[WebhookEndpoint, Depends(get_webhook)]
