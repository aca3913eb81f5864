"""Where webhooks may go, checked at delivery time: private addresses refused after a fresh
lookup (DNS rebinding), the connection pinned to the checked address, redirects never followed."""

from __future__ import annotations

import ipaddress

import httpx
import pytest

from app.core.db import session_scope
from app.core.settings import Settings
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from app.webhooks import urls as webhook_urls
from tests.worker.webhooks.conftest import (
    attempts,
    deliveries,
    make_ctx,
    make_endpoint,
    make_job,
    make_project,
    verify,
)
from tests.worker.webhooks.receiver import Receiver
from worker import webhooks as worker_webhooks
from worker.context import WorkerContext
from worker.webhooks import deliver_one, make_client


def test_private_addresses_are_refused_at_delivery(
    settings: Settings, receiver: Receiver, ctx: WorkerContext
) -> None:
    """An endpoint accepted while its name pointed elsewhere (DNS rebinding), or before the
    operator turned private addresses off, is refused when it resolves to one at delivery."""
    strict = make_ctx(settings, webhook_allow_private=False)
    project = make_project(strict)
    make_endpoint(strict, project, f"http://localhost:{receiver.port}/hook", ["job.cancelled"])
    job_id = make_job(strict, project)
    with session_scope(strict.sessions) as session:
        transitions.transition(session, job_id, JobStatus.CANCELLED)
    with make_client(strict) as client:
        assert deliver_one(strict, client)
    [row] = deliveries(strict, job_id)
    [attempt] = attempts(strict, row.id)
    assert row.state == "pending"  # retried later: DNS may change back
    assert attempt.status_code is None
    assert attempt.error is not None and "non-public address" in attempt.error
    assert "127.0.0.1" in attempt.error or "::1" in attempt.error
    assert receiver.drain() == []


def test_redirects_are_not_followed(ctx: WorkerContext, client: httpx.Client) -> None:
    target = Receiver()
    redirecting = Receiver(statuses=[307], location=target.url("/elsewhere"))
    try:
        project = make_project(ctx)
        make_endpoint(ctx, project, redirecting.url(), ["job.cancelled"])
        job_id = make_job(ctx, project)
        with session_scope(ctx.sessions) as session:
            transitions.transition(session, job_id, JobStatus.CANCELLED)
        assert deliver_one(ctx, client)
        assert redirecting.next().status == 307
        [row] = deliveries(ctx, job_id)
        assert (row.state, row.last_status_code, row.last_error) == ("pending", 307, "HTTP 307")
        assert target.drain() == []
    finally:
        target.close()
        redirecting.close()


def test_delivery_connects_to_the_address_it_checked(
    settings: Settings, receiver: Receiver, ctx: WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With private addresses off, the host is looked up once per attempt and the connection
    goes to the checked address, keeping the URL's host name in the Host header: a second
    lookup (which DNS rebinding would answer differently) never happens. Public DNS cannot run
    here, so the lookup is replaced: hooks.example "resolves" to the loopback receiver."""
    strict = make_ctx(settings, webhook_allow_private=False)
    project = make_project(strict)
    url = f"http://hooks.example:{receiver.port}/hook"
    endpoint = make_endpoint(strict, project, url, ["job.cancelled"])
    looked_up: list[str] = []

    def checked_address(target: webhook_urls.Target) -> object:
        looked_up.append(target.host)
        return ipaddress.ip_address("127.0.0.1")

    monkeypatch.setattr(worker_webhooks, "public_address", checked_address)
    job_id = make_job(strict, project)
    with session_scope(strict.sessions) as session:
        transitions.transition(session, job_id, JobStatus.CANCELLED)
    with make_client(strict) as client:
        assert deliver_one(strict, client)
    received = receiver.next()
    assert received.headers["host"] == f"hooks.example:{receiver.port}"
    assert looked_up == ["hooks.example"]
    verify(endpoint.secret, received)
    assert deliveries(strict, job_id)[0].state == "delivered"
