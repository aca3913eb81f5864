"""Webhook delivery against a real HTTP receiver on 127.0.0.1: Standard Webhooks signatures
(checked with the `standardwebhooks` package), retries with growing backoff, at-least-once
delivery across a worker that dies, a real `grpo worker` process delivering a committed outbox
row, and retention."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from app.core.clock import as_utc, utcnow
from app.core.db import session_scope
from app.core.settings import Settings
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from app.webhooks import repository as webhooks_repo
from tests.worker.conftest import WorkerProcess, wait_for
from tests.worker.webhooks.conftest import (
    attempts,
    deliveries,
    make_ctx,
    make_due,
    make_endpoint,
    make_job,
    make_project,
    verify,
)
from tests.worker.webhooks.receiver import Receiver
from trainer.run.callbacks import RunInfo
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.progress import DatabaseCallbacks
from worker.webhooks import deliver_due, deliver_one, make_client, prune, retry_delay


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


def test_finished_deliveries_are_pruned_after_the_retention_period(
    settings: Settings, receiver: Receiver, ctx: WorkerContext
) -> None:
    short = make_ctx(settings, webhook_retention_days=1e-9)  # everything queued is old
    project = make_project(short)
    make_endpoint(short, project, receiver.url(), ["job.running", "job.cancelled"])
    job_id = make_job(short, project)
    with session_scope(short.sessions) as session:
        transitions.claim(session, job_id, "w")
    with make_client(short) as client:
        assert deliver_one(short, client)  # job.running: delivered
    with session_scope(short.sessions) as session:
        transitions.transition(session, job_id, JobStatus.CANCELLED, attempt=1)
    [delivered, pending] = deliveries(short, job_id)
    assert (delivered.state, pending.state) == ("delivered", "pending")
    assert attempts(short, delivered.id)

    assert prune(short) == 1
    assert [d.id for d in deliveries(short, job_id)] == [pending.id]  # pending ones stay
    assert attempts(short, delivered.id) == []
    assert prune(make_ctx(settings)) == 0  # within the default 30 days: kept
