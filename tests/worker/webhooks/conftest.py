"""Fixtures and helpers of the webhook delivery tests: a worker context on a database with no
webhook endpoints, an HTTP client as the delivery thread builds it, a real receiver on
127.0.0.1, and shortcuts that make projects, endpoints and jobs in the database."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import select, update
from standardwebhooks.webhooks import Webhook

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.ids import new_id
from app.core.models import Job, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from app.core.settings import Settings
from app.jobs import transitions
from app.webhooks import repository as webhooks_repo
from app.webhooks import service as webhooks_service
from tests.conftest import RecordingDispatcher, new_project_key
from tests.worker.webhooks.receiver import Receiver
from worker.context import WorkerContext
from worker.settings import build_worker_settings
from worker.webhooks import make_client

ALL_EVENTS = ["job.running", "job.succeeded", "job.failed", "job.cancelled", "job.checkpoint"]


def make_ctx(settings: Settings, **extra: object) -> WorkerContext:
    options: dict[str, object] = {
        "webhook_allow_private": True,
        "webhook_timeout_seconds": 20,  # generous: a loaded CI machine answered late once
        "webhook_retry_base_seconds": 2,
        "webhook_retry_max_delay_seconds": 3600,
        **extra,
    }
    worker_settings = build_worker_settings(
        data_dir=settings.data_dir, database_url=settings.resolved_database_url, **options
    )
    sessions = make_session_factory(make_engine(worker_settings.resolved_database_url))
    return WorkerContext(worker_settings, sessions, RecordingDispatcher())


@pytest.fixture
def ctx(settings: Settings) -> Iterator[WorkerContext]:
    """A worker context on a database with no webhook endpoints: deliveries are claimed from
    the whole table, so rows other tests left pending must not be due in this one."""
    context = make_ctx(settings)
    forget_endpoints(context)
    yield context
    forget_endpoints(context)


def forget_endpoints(ctx: WorkerContext) -> None:
    with session_scope(ctx.sessions) as session:
        for endpoint_id in session.scalars(select(WebhookEndpoint.id)).all():
            webhooks_repo.delete_endpoint(session, endpoint_id=endpoint_id)


@pytest.fixture
def client(ctx: WorkerContext) -> Iterator[httpx.Client]:
    with make_client(ctx) as c:
        yield c


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def make_project(ctx: WorkerContext) -> str:
    return new_project_key(ctx.settings)[1]


def make_endpoint(
    ctx: WorkerContext, project_id: str, url: str, events: list[str] | None = None
) -> WebhookEndpoint:
    with session_scope(ctx.sessions) as session:
        return webhooks_service.create_endpoint(
            session,
            settings=ctx.settings.model_copy(update={"webhook_allow_private": True}),
            project_id=project_id,
            url=url,
            events=events or ALL_EVENTS,
            description=None,
        )


def make_job(ctx: WorkerContext, project_id: str) -> str:
    with session_scope(ctx.sessions) as session:
        job = Job(
            id=new_id("job"),
            project_id=project_id,
            spec={},
            created_at=utcnow(),
            updated_at=utcnow(),
            total_steps=4,
            max_attempts=2,
        )
        transitions.record_created(session, job)
        return job.id


def deliveries(ctx: WorkerContext, job_id: str) -> list[WebhookDelivery]:
    with session_scope(ctx.sessions) as session:
        query = select(WebhookDelivery).where(WebhookDelivery.job_id == job_id)
        return list(session.scalars(query.order_by(WebhookDelivery.id)))


def attempts(ctx: WorkerContext, delivery_id: str) -> list[WebhookAttempt]:
    with session_scope(ctx.sessions) as session:
        query = select(WebhookAttempt).where(WebhookAttempt.delivery_id == delivery_id)
        return list(session.scalars(query.order_by(WebhookAttempt.id)))


def make_due(ctx: WorkerContext, delivery_id: str) -> None:
    """Move a delivery's due time to now (what waiting out its backoff or lease would do)."""
    with session_scope(ctx.sessions) as session:
        session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id)
            .values(next_attempt_at=utcnow() - timedelta(seconds=1))
        )


def verify(secret: str, received: object) -> dict[str, object]:
    payload = Webhook(secret).verify(received.body, received.headers)  # type: ignore[attr-defined]
    assert isinstance(payload, dict)
    return payload
