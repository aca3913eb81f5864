"""Fair use: a per-key request rate limit, a per-project limit on active jobs, and fair dispatch
(one project's backlog never holds every dispatch slot)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.errors import TooManyRequests
from app.core.ids import new_id
from app.core.leases import RedisStore
from app.core.models import Job
from app.core.ratelimit import RequestLimiter
from app.core.settings import Settings
from app.jobs import dispatch, transitions
from app.jobs import slots_repository as slots_repo
from app.jobs.transitions import JobStatus
from app.main import create_app
from tests.conftest import (
    RecordingDispatcher,
    free_port,
    new_project_key,
    settings_for,
    tiny_spec,
    wait_until,
)
from worker.context import WorkerContext
from worker.maintenance import redispatch_queued
from worker.settings import build_worker_settings


@dataclass
class Harness:
    client: TestClient
    settings: Settings
    dispatcher: RecordingDispatcher
    sessions: sessionmaker[Session]

    def headers(self) -> dict[str, str]:
        key, _ = new_project_key(self.settings)
        return {"Authorization": f"Bearer {key}"}

    def create(self, headers: dict[str, str], **extra: str) -> str:
        response = self.client.post("/v1/jobs", json=tiny_spec(), headers=headers | extra)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])


MakeHarness = Callable[..., Harness]


@pytest.fixture
def make_harness(
    backend: str, request: pytest.FixtureRequest, sqlite_dir: Path, queue_name: str
) -> Iterator[MakeHarness]:
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    clients: list[TestClient] = []

    def make(**limits: int) -> Harness:
        settings = settings_for(backend, url, sqlite_dir, queue_name, **limits)
        dispatcher = RecordingDispatcher()
        client = TestClient(create_app(settings, dispatcher))
        client.__enter__()
        clients.append(client)
        sessions = make_session_factory(make_engine(settings.resolved_database_url))
        dispatcher.sessions = sessions
        return Harness(client, settings, dispatcher, sessions)

    yield make
    for client in clients:
        client.__exit__(None, None, None)


# -- request rate ------------------------------------------------------------------------------


def test_rate_limit_answers_429_with_retry_after_then_recovers(make_harness: MakeHarness) -> None:
    h: Harness = make_harness(rate_limit_per_minute=60, rate_limit_burst=3)
    headers = h.headers()
    for _ in range(3):  # the burst
        assert h.client.get("/v1/jobs", headers=headers).status_code == 200
    limited = h.client.get("/v1/jobs", headers=headers)
    assert limited.status_code == 429
    retry_after = int(limited.headers["Retry-After"])
    assert 1 <= retry_after <= 60
    error = limited.json()["error"]
    assert error["type"] == "rate_limit_error" and error["param"] is None
    assert "60 requests per minute" in error["message"]
    # other keys have their own budget; health checks and the dashboard are not limited
    assert h.client.get("/v1/jobs", headers=h.headers()).status_code == 200
    for _ in range(5):
        assert h.client.get("/healthz").status_code == 200
        assert h.client.get("/").status_code in (200, 503)  # 503: dashboard files not installed
    # one token a second: the key is served again after the wait it was told
    wait_until(
        lambda: h.client.get("/v1/jobs", headers=headers).status_code == 200,
        retry_after + 5,
        "the rate-limited key to be served again",
    )


def test_api_processes_sharing_redis_share_one_budget_per_key(
    pg_url: str, sqlite_dir: Path, queue_name: str
) -> None:
    settings = settings_for(
        "postgres", pg_url, sqlite_dir, queue_name, rate_limit_per_minute=1, rate_limit_burst=2
    )
    key, _ = new_project_key(settings)
    headers = {"Authorization": f"Bearer {key}"}
    with (
        TestClient(create_app(settings, RecordingDispatcher())) as one,
        TestClient(create_app(settings, RecordingDispatcher())) as two,
    ):
        assert one.get("/v1/jobs", headers=headers).status_code == 200
        assert two.get("/v1/jobs", headers=headers).status_code == 200
        assert one.get("/v1/jobs", headers=headers).status_code == 429
        assert two.get("/v1/jobs", headers=headers).status_code == 429


def test_rate_limit_counts_in_memory_while_redis_is_away() -> None:
    """Redis down: the limit loosens to one budget per process; it never refuses everything."""
    limiter = RequestLimiter(60, 2, RedisStore(f"redis://127.0.0.1:{free_port()}/0"))
    limiter.check("key_a")
    limiter.check("key_a")
    with pytest.raises(TooManyRequests) as refused:
        limiter.check("key_a")
    assert refused.value.retry_after >= 1
    limiter.check("key_b")  # its own bucket


# -- active jobs per project ---------------------------------------------------------------------


def test_a_project_at_its_active_job_limit_gets_429_until_one_ends(
    make_harness: MakeHarness,
) -> None:
    h: Harness = make_harness(max_active_jobs_per_project=2)
    headers = h.headers()
    key = secrets.token_hex(8)
    first = h.create(headers, **{"Idempotency-Key": key})
    h.create(headers)
    refused = h.client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "quota_exceeded" and error["param"] is None
    assert "max_active_jobs_per_project=2" in error["message"]
    # a retry of a request that did create a job is still answered with that job
    replay = h.client.post("/v1/jobs", json=tiny_spec(), headers=headers | {"Idempotency-Key": key})
    assert replay.status_code == 201 and replay.json()["id"] == first
    # another project is not affected
    h.create(h.headers())
    # a cancelled job is no longer active: room for one more
    assert h.client.post(f"/v1/jobs/{first}/cancel", headers=headers).status_code == 200
    h.create(headers)


def test_concurrent_creates_never_exceed_the_active_job_limit(make_harness: MakeHarness) -> None:
    h: Harness = make_harness(max_active_jobs_per_project=3)
    key, project_id = new_project_key(h.settings)
    headers = {"Authorization": f"Bearer {key}"}

    def post(_: int) -> int:
        return h.client.post("/v1/jobs", json=tiny_spec(), headers=headers).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(post, range(8)))
    assert sorted(codes) == [201] * 3 + [429] * 5
    with session_scope(h.sessions) as session:
        assert slots_repo.count_active(session, project_id=project_id) == 3


# -- fair dispatch -------------------------------------------------------------------------------


def test_a_big_backlog_does_not_hold_back_another_project(make_harness: MakeHarness) -> None:
    h: Harness = make_harness(max_dispatched_per_project=2, max_active_jobs_per_project=50)
    a, b = h.headers(), h.headers()
    a_jobs = [h.create(a) for _ in range(10)]
    b_job = h.create(b)
    assert b_job in h.dispatcher.sent  # B's job is sent though A's backlog is larger
    assert [j for j in h.dispatcher.sent if j in a_jobs] == a_jobs[:2]  # A: its cap, oldest first
    assert max(h.dispatcher.held_at_send) < 2  # every send had a free slot of its project
    with session_scope(h.sessions) as session:
        assert slots_repo.count_dispatched(session, project_id=_project(h, a_jobs[0])) == 2
        waiting = session.get(Job, a_jobs[2])
        assert waiting is not None and waiting.dispatched_at is None  # waits in the database

    # A job of A ends (in a unit of work of the API process: fair dispatch installed there):
    # its slot goes to A's oldest waiting job.
    app_sessions = h.client.app.state.grpo.sessions  # type: ignore[attr-defined]
    with session_scope(app_sessions) as session:
        attempt = transitions.claim(session, a_jobs[0], "w")
    with session_scope(app_sessions) as session:
        transitions.transition(session, a_jobs[0], JobStatus.SUCCEEDED, attempt=attempt)
    assert h.dispatcher.sent[-1] == a_jobs[2]
    # a cancelled queued job frees its slot too
    assert h.client.post(f"/v1/jobs/{a_jobs[1]}/cancel", headers=a).status_code == 200
    assert h.dispatcher.sent[-1] == a_jobs[3]
    assert [j for j in h.dispatcher.sent if j in a_jobs] == a_jobs[:4]
    assert max(h.dispatcher.held_at_send) < 2


def _project(h: Harness, job_id: str) -> str:
    with session_scope(h.sessions) as session:
        row = slots_repo.dispatch_row(session, job_id=job_id)
        assert row is not None
        return str(row.project_id)


def test_the_sweep_fills_free_slots_round_robin_and_still_resends_lost_messages(
    settings: Settings,
) -> None:
    ws = build_worker_settings(
        data_dir=settings.data_dir,
        database_url=settings.resolved_database_url,
        redispatch_seconds=30,
        max_dispatched_per_project=2,
    )
    sessions = make_session_factory(make_engine(ws.resolved_database_url))
    dispatcher = RecordingDispatcher(sessions)
    ctx = WorkerContext(ws, sessions, dispatcher)
    dispatch.install(sessions, dispatcher, max_per_project=2)

    def waiting_jobs(count: int) -> list[str]:
        """Jobs committed but never sent (as after a failed send), oldest first."""
        _, project_id = new_project_key(ws)
        ids = []
        for _ in range(count):
            with session_scope(sessions) as session:
                job = Job(
                    id=new_id("job"),
                    project_id=project_id,
                    spec={},
                    created_at=utcnow(),
                    updated_at=utcnow(),
                    total_steps=1,
                )
                transitions.record_created(session, job)
                ids.append(job.id)
        return ids

    a, b, c = waiting_jobs(4), waiting_jobs(2), waiting_jobs(1)
    ours = set(a + b + c)
    redispatch_queued(ctx)
    # (the embedded database is shared with other tests: only our jobs are looked at)
    sent = [j for j in dispatcher.sent if j in ours]
    assert sent == [a[0], b[0], c[0], a[1], b[1]]  # one per project per round, oldest first
    # (other tests' projects may hold more: their lost messages are re-sent too)
    held = [h for j, h in zip(dispatcher.sent, dispatcher.held_at_send, strict=True) if j in ours]
    assert max(held) < 2
    dispatcher.sent.clear()
    redispatch_queued(ctx)
    assert not ours & set(dispatcher.sent)  # A and B are at their cap; C has nothing waiting

    # A's message for a[0] is lost (old and still queued): re-sent although A is at its cap.
    old = utcnow() - timedelta(hours=1)
    with session_scope(sessions) as session:
        session.execute(update(Job).where(Job.id == a[0]).values(dispatched_at=old, updated_at=old))
    dispatcher.sent.clear()
    redispatch_queued(ctx)
    assert [j for j in dispatcher.sent if j in ours] == [a[0]]

    # a[1] ends: the worker's unit of work refills A's slot with a[2] at once.
    with session_scope(sessions) as session:
        attempt = transitions.claim(session, a[1], "w")
    with session_scope(sessions) as session:
        transitions.transition(session, a[1], JobStatus.FAILED, attempt=attempt, error_code="x")
    assert dispatcher.sent[-1] == a[2]
