"""Webhook delivery against a real HTTP receiver on 127.0.0.1: Standard Webhooks signatures
(checked with the `standardwebhooks` package), retries with growing backoff, at-least-once
delivery across a worker that dies, DNS-rebinding refusal, and a real `grpo worker` process
delivering a committed outbox row."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select, update
from standardwebhooks.webhooks import Webhook

from app import transitions, webhook_urls
from app.clock import as_utc, utcnow
from app.db import make_engine, make_session_factory, session_scope
from app.ids import new_id
from app.models import Job, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from app.repositories import webhooks as webhooks_repo
from app.services import webhooks as webhooks_service
from app.settings import Settings
from app.transitions import JobStatus
from tests.conftest import RecordingDispatcher, new_project_key
from tests.worker.conftest import WorkerProcess, wait_for
from tests.worker.webhook_receiver import Receiver
from trainer.callbacks import RunInfo
from worker import webhooks as worker_webhooks
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.progress import DatabaseCallbacks
from worker.settings import build_worker_settings
from worker.webhooks import deliver_due, deliver_one, make_client, retry_delay

ALL_EVENTS = ["job.running", "job.succeeded", "job.failed", "job.cancelled", "job.checkpoint"]


def make_ctx(settings: Settings, **extra: object) -> WorkerContext:
    options: dict[str, object] = {
        "webhook_allow_private": True,
        "webhook_timeout_seconds": 5,
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


def test_status_changes_are_delivered_signed(
    ctx: WorkerContext, client: httpx.Client, receiver: Receiver
) -> None:
    project = make_project(ctx)
    endpoint = make_endpoint(ctx, project, receiver.url())
    other = make_endpoint(ctx, project, receiver.url("/only-failed"), ["job.failed"])
    job_id = make_job(ctx, project)
    with session_scope(ctx.sessions) as session:
        transitions.claim(session, job_id, "w")
    with session_scope(ctx.sessions) as session:
        transitions.transition(session, job_id, JobStatus.SUCCEEDED, attempt=1)

    assert deliver_due(ctx, client) == 2
    got = [receiver.next(), receiver.next()]
    assert {r.path for r in got} == {"/hook"}  # the job.failed-only endpoint got nothing
    payloads = [verify(endpoint.secret, r) for r in got]
    assert [p["type"] for p in payloads] == ["job.running", "job.succeeded"]
    succeeded = payloads[1]["data"]
    assert isinstance(succeeded, dict)
    assert succeeded["job_id"] == job_id
    assert succeeded["status"] == "succeeded"
    assert succeeded["previous_status"] == "running"
    rows = deliveries(ctx, job_id)
    assert [r.headers["webhook-id"] for r in got] == [d.id for d in rows]
    assert all(d.state == "delivered" and d.attempts == 1 for d in rows)
    assert {d.endpoint_id for d in rows} == {endpoint.id}
    # A signature made with another endpoint's secret does not verify.
    with pytest.raises(Exception, match="signature"):
        Webhook(other.secret).verify(got[0].body, got[0].headers)
    assert deliver_due(ctx, client) == 0  # nothing is sent twice


def test_checkpoint_recorded_by_the_worker_is_delivered(
    ctx: WorkerContext, client: httpx.Client, receiver: Receiver, tmp_path: Path
) -> None:
    project = make_project(ctx)
    endpoint = make_endpoint(ctx, project, receiver.url(), ["job.checkpoint"])
    job_id = make_job(ctx, project)
    with session_scope(ctx.sessions) as session:
        attempt = transitions.claim(session, job_id, "w")
    assert attempt is not None
    lease = LeaseKeeper(ctx.sessions, job_id, attempt, interval_s=60)
    callbacks = DatabaseCallbacks(ctx, job_id, attempt, lease)
    callbacks.on_start(RunInfo(4, 0, tmp_path, tmp_path, "cpu", "transformers"))
    callbacks.on_checkpoint(2, tmp_path / "checkpoint-000002")
    callbacks.on_checkpoint(2, tmp_path / "checkpoint-000002")  # a repeated step: no event
    assert deliver_due(ctx, client) == 1
    payload = verify(endpoint.secret, receiver.next())
    assert payload["type"] == "job.checkpoint"
    assert payload["data"]["step"] == 2  # type: ignore[index]
    assert payload["data"]["status"] == "running"  # type: ignore[index]


def test_retries_back_off_until_the_receiver_accepts(
    ctx: WorkerContext, client: httpx.Client
) -> None:
    receiver = Receiver(statuses=[500, 500, 500])
    try:
        project = make_project(ctx)
        endpoint = make_endpoint(ctx, project, receiver.url(), ["job.cancelled"])
        job_id = make_job(ctx, project)
        with session_scope(ctx.sessions) as session:
            transitions.transition(session, job_id, JobStatus.CANCELLED)
        [delivery] = deliveries(ctx, job_id)

        # The largest delay of each jitter window, so the schedule is exact.
        for _ in range(3):
            assert deliver_one(ctx, client, jitter=lambda ceiling: ceiling)
            assert deliver_one(ctx, client) is False  # not due before its backoff ends
            make_due(ctx, delivery.id)
        assert deliver_one(ctx, client, jitter=lambda ceiling: ceiling)

        got = [receiver.next() for _ in range(4)]
        assert [r.status for r in got] == [500, 500, 500, 200]
        assert {r.headers["webhook-id"] for r in got} == {delivery.id}
        for received in got:
            verify(endpoint.secret, received)
        log = attempts(ctx, delivery.id)
        assert [(a.attempt, a.status_code) for a in log] == [(1, 500), (2, 500), (3, 500), (4, 200)]
        delays = [
            (
                (as_utc(a.next_attempt_at) or utcnow()) - (as_utc(a.started_at) or utcnow())
            ).total_seconds()
            for a in log[:3]
        ]
        assert delays[0] < delays[1] < delays[2]
        assert delays == pytest.approx([2, 4, 8], abs=1.0)  # base 2 s, doubled per failure
        assert log[3].next_attempt_at is None
        assert all(a.duration_ms >= 0 for a in log)
        [done] = deliveries(ctx, job_id)
        assert (done.state, done.attempts, done.last_status_code) == ("delivered", 4, 200)
    finally:
        receiver.close()


def test_backoff_has_full_jitter_and_a_ceiling() -> None:
    assert retry_delay(1, base=5, cap=3600, jitter=lambda c: c) == 5
    assert retry_delay(4, base=5, cap=3600, jitter=lambda c: c) == 40
    assert retry_delay(40, base=5, cap=3600, jitter=lambda c: c) == 3600
    drawn = [retry_delay(3, base=5, cap=3600) for _ in range(200)]
    assert all(0 <= d <= 20 for d in drawn)
    assert min(drawn) < 10 < max(drawn)  # spread over the window, not a fixed delay


def test_a_delivery_past_its_retry_window_fails(
    settings: Settings, receiver: Receiver, ctx: WorkerContext
) -> None:
    brief = make_ctx(settings, webhook_retry_window_hours=0.0001)  # under a second
    receiver_500 = Receiver(statuses=[500])
    try:
        project = make_project(brief)
        make_endpoint(brief, project, receiver_500.url(), ["job.cancelled"])
        job_id = make_job(brief, project)
        with session_scope(brief.sessions) as session:
            transitions.transition(session, job_id, JobStatus.CANCELLED)
        with make_client(brief) as client:
            assert deliver_one(brief, client, jitter=lambda ceiling: ceiling)
        [row] = deliveries(brief, job_id)
        assert (row.state, row.last_status_code) == ("failed", 500)
    finally:
        receiver_500.close()


def test_a_worker_dying_after_the_commit_loses_nothing(
    ctx: WorkerContext, receiver: Receiver, settings: Settings
) -> None:
    project = make_project(ctx)
    endpoint = make_endpoint(ctx, project, receiver.url(), ["job.failed"])
    job_id = make_job(ctx, project)
    with session_scope(ctx.sessions) as session:
        transitions.claim(session, job_id, "w")
    with session_scope(ctx.sessions) as session:
        transitions.transition(
            session, job_id, JobStatus.FAILED, attempt=1, error_code="boom", message="it broke"
        )
    # The first worker claims the delivery and dies before sending it.
    with session_scope(ctx.sessions) as session:
        now = utcnow()
        dead = webhooks_repo.claim_due(session, now=now, lease_until=now + timedelta(minutes=1))
    assert dead is not None
    fresh = make_ctx(settings)  # a new process: its own engine and client
    with make_client(fresh) as client:
        assert deliver_due(fresh, client) == 0  # still leased to the dead worker
        make_due(fresh, dead.id)  # its lease runs out
        assert deliver_due(fresh, client) == 1
        assert deliver_due(fresh, client) == 0
    received = receiver.next()
    assert received.headers["webhook-id"] == dead.id
    payload = verify(endpoint.secret, received)
    assert payload["data"]["error"] == {"code": "boom", "message": "it broke"}  # type: ignore[index]
    assert receiver.drain() == []  # exactly once
    [row] = deliveries(ctx, job_id)
    assert (row.state, row.attempts) == ("delivered", 2)
    # The dead worker's late result, if it ever came, is fenced off.
    with session_scope(ctx.sessions) as session:
        assert not webhooks_repo.record_attempt(
            session,
            claimed=dead,
            started_at=utcnow(),
            duration_ms=1,
            status_code=500,
            error=None,
            state="pending",
            next_attempt_at=utcnow(),
        )


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


def test_a_worker_process_delivers_a_committed_event(
    settings: Settings,
    receiver: Receiver,
    ctx: WorkerContext,
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """The outbox row was committed while no worker ran (the one that changed the job died);
    a `grpo worker` process started afterwards (as `grpo serve` starts one) delivers it once."""
    project = make_project(ctx)
    endpoint = make_endpoint(ctx, project, receiver.url(), ["job.cancelled"])
    job_id = make_job(ctx, project)
    with session_scope(ctx.sessions) as session:
        transitions.transition(session, job_id, JobStatus.CANCELLED)
    [row] = deliveries(ctx, job_id)
    worker = start_worker(
        settings, GRPO_WEBHOOK_ALLOW_PRIVATE="true", GRPO_WEBHOOK_POLL_SECONDS="0.5"
    )
    try:
        received = receiver.next(timeout=60)
    except Exception:
        pytest.fail(f"no delivery; worker log:\n{worker.log_tail()}")
    assert received.headers["webhook-id"] == row.id
    assert verify(endpoint.secret, received)["type"] == "job.cancelled"
    wait_for(lambda: deliveries(ctx, job_id)[0].state == "delivered", 30, "the delivery recorded")
    assert receiver.drain() == []
    assert json.loads(received.body)["data"]["job_id"] == job_id


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
