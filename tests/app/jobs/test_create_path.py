"""The job-creation path under concurrency: the per-project lock excludes only other lockers,
the quota counted at the commit stays exact and undoes everything when it refuses, and a create
costs a known number of statements (bench/load_create.py measures what each one costs)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy
from fastapi.testclient import TestClient
from sqlalchemy import event, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from app.core import db
from app.core import projects_repository as projects_repo
from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.ids import new_id
from app.core.models import Job
from app.core.settings import Settings
from app.jobs import events_repository as events_repo
from app.jobs import idempotency_repository as idem_repo
from app.jobs import repository as jobs_repo
from app.jobs import service as jobs_service
from app.jobs import size_classes, transitions
from app.jobs import slots_repository as slots_repo
from app.jobs.transitions import JobStatus
from app.main import create_app
from jobspec import JobSpec
from tests.conftest import (
    RecordingDispatcher,
    new_project_key,
    settings_for,
    tiny_spec,
    wait_until,
)


@pytest.fixture
def pg_settings(pg_url: str, sqlite_dir: object, queue_name: str) -> Settings:
    return settings_for("postgres", pg_url, sqlite_dir, queue_name)  # type: ignore[arg-type]


def _lock_wait_at_most(session: Session, timeout: str) -> None:
    """Fail this transaction's next lock wait after `timeout` instead of waiting on."""
    session.execute(text(f"SET LOCAL lock_timeout = '{timeout}'"))


def test_the_project_lock_lets_the_projects_inserts_through(pg_settings: Settings) -> None:
    # A new job, an idempotency claim, an upload: each checks its foreign key to the project,
    # which takes the project row's KEY SHARE lock. FOR UPDATE conflicts with that, so all of a
    # project's creates waited for whoever held its lock; FOR NO KEY UPDATE does not.
    _, project_id = new_project_key(pg_settings)
    sessions = make_session_factory(make_engine(pg_settings.resolved_database_url))
    with session_scope(sessions) as holder:
        projects_repo.lock(holder, project_id=project_id)
        with session_scope(sessions) as other:
            _lock_wait_at_most(other, "2s")
            now = utcnow()
            claimed = idem_repo.claim(
                other,
                project_id=project_id,
                key=secrets.token_hex(8),
                request_hash="h",
                now=now,
                expired_before=now,
            )
            job = Job(
                id=new_id("job"),
                project_id=project_id,
                spec={},
                created_at=now,
                updated_at=now,
                total_steps=1,
            )
            transitions.record_created(other, job)
    assert claimed


def test_the_project_lock_still_excludes_a_second_locker(pg_settings: Settings) -> None:
    _, project_id = new_project_key(pg_settings)
    sessions = make_session_factory(make_engine(pg_settings.resolved_database_url))
    with session_scope(sessions) as holder:
        projects_repo.lock(holder, project_id=project_id)
        with (
            pytest.raises(OperationalError, match="lock timeout"),
            session_scope(sessions) as other,
        ):
            _lock_wait_at_most(other, "200ms")
            projects_repo.lock(other, project_id=project_id)


@pytest.fixture
def quota_client(settings: Settings) -> Iterator[tuple[TestClient, RecordingDispatcher, Settings]]:
    settings.max_active_jobs_per_project = 1
    dispatcher = RecordingDispatcher()
    with TestClient(create_app(settings, dispatcher)) as client:
        yield client, dispatcher, settings


def test_a_create_refused_at_the_commit_leaves_nothing_and_frees_its_key(
    quota_client: tuple[TestClient, RecordingDispatcher, Settings],
) -> None:
    # The quota is counted as the last thing before the commit: its refusal must still be a
    # 429 with Retry-After, roll back the job, send nothing and give the key back.
    client, dispatcher, settings = quota_client
    key, project_id = new_project_key(settings)
    headers = {"Authorization": f"Bearer {key}"}
    first = client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert first.status_code == 201
    sent_before = list(dispatcher.sent)
    retried = headers | {"Idempotency-Key": secrets.token_hex(8)}
    refused = client.post("/v1/jobs", json=tiny_spec(), headers=retried)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    assert "has 1 queued or running jobs" in refused.json()["error"]["message"]
    assert dispatcher.sent == sent_before
    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    with session_scope(sessions) as session:
        assert slots_repo.count_active(session, project_id=project_id) == 1
    # Room again: the same key is served on its merits (not a 409, not a replayed 429).
    assert client.post(f"/v1/jobs/{first.json()['id']}/cancel", headers=headers).status_code == 200
    again = client.post("/v1/jobs", json=tiny_spec(), headers=retried)
    assert again.status_code == 201, again.text
    assert "Idempotent-Replayed" not in again.headers


def test_a_create_runs_six_statements_once_its_project_has_no_free_slot(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One claim; the job, its event and the stored response; the project's lock and one count
    # for its quota and its dispatch slots. Before the create path was trimmed it ran twelve
    # (and a ping per connection checked out). More statements are more round trips under load.
    # The workers' size classes are read once per REFRESH_S per process (app.jobs.size_classes),
    # by the first create here: however slow this machine, not again by the third.
    monkeypatch.setattr(size_classes, "REFRESH_S", 3600.0)
    pg_settings.max_dispatched_per_project = 1
    app = create_app(pg_settings, RecordingDispatcher())
    state = app.state.grpo
    statements: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(statement.split("\n")[0])

    for engine in (state.engine, state.claims.kw["bind"]):
        event.listen(engine, "before_cursor_execute", record)
    key, _ = new_project_key(pg_settings)
    headers = {"Authorization": f"Bearer {key}"}
    with TestClient(app) as client:
        for _ in range(2):  # the first takes the project's one slot (and a key lookup)
            response = client.post(
                "/v1/jobs", json=tiny_spec(), headers=headers | {"Idempotency-Key": new_id("k")}
            )
            assert response.status_code == 201
        statements.clear()
        response = client.post(
            "/v1/jobs", json=tiny_spec(), headers=headers | {"Idempotency-Key": new_id("k")}
        )
        assert response.status_code == 201
    assert len(statements) <= 6, "\n".join(statements)


def test_a_slot_freed_while_a_create_commits_goes_to_the_new_job(pg_settings: Settings) -> None:
    # A create that counts its project at the dispatch cap leaves its job waiting, with no look
    # after its commit. The job whose end frees a slot just after that count refills it through
    # fill_slots, which waits for the create's lock, so it sees the new job: nothing strands.
    pg_settings.max_dispatched_per_project = 1
    dispatcher = RecordingDispatcher()
    app = create_app(pg_settings, dispatcher)
    state = app.state.grpo
    key, project_id = new_project_key(pg_settings)
    with TestClient(app) as client:
        response = client.post(
            "/v1/jobs", json=tiny_spec(), headers={"Authorization": f"Bearer {key}"}
        )
        running = response.json()["id"]
        assert dispatcher.sent == [running]  # it holds the project's one slot
    with session_scope(state.sessions) as session:
        attempt = transitions.claim(session, running, "worker-1")
    assert attempt is not None

    ender_failed: list[BaseException] = []

    def end_the_running_job() -> None:
        try:
            with session_scope(state.sessions) as session:
                transitions.transition(session, running, JobStatus.SUCCEEDED, attempt=attempt)
        except BaseException as exc:  # reaches the test through `ender_failed`
            ender_failed.append(exc)

    ender = threading.Thread(target=end_the_running_job)

    def end_it_now(_session: Session) -> None:
        """Runs after the create's count, before its commit: the slot frees in between."""
        ender.start()
        # Autocommit: each poll its own transaction (a transaction reads pg_stat_activity once).
        admin = make_engine(pg_settings.resolved_database_url, autocommit=True)
        with admin.connect() as conn:
            wait_until(
                lambda: conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ).scalar_one(),
                10,
                "the refill after the job's end to wait for the create's lock",
            )
        admin.dispose()

    spec = JobSpec.model_validate(tiny_spec())
    with session_scope(state.sessions) as session:
        created = jobs_service.create_job(
            session,
            claims=state.claims,
            dispatcher=dispatcher,
            project_id=project_id,
            spec=spec,
            idempotency_key=None,
            idempotency_ttl=timedelta(hours=1),
            max_attempts=3,
            queue=pg_settings.queue_name,
            settings=pg_settings,
        )
        assert isinstance(created, Job)
        db.before_commit(session, end_it_now)
    ender.join(timeout=30)
    assert not ender.is_alive() and ender_failed == []
    assert dispatcher.sent == [running, created.id]


def test_a_created_job_holds_what_its_row_holds(settings: Settings) -> None:
    # record_created inserts without the ORM's unit of work: the object the API answers from
    # must still hold every stored value, the column defaults included.
    _, project_id = new_project_key(settings)
    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    now = utcnow()
    job = Job(
        id=new_id("job"), project_id=project_id, spec={"model": "m"}, created_at=now, updated_at=now
    )
    with session_scope(sessions) as session:
        transitions.record_created(session, job)
    columns = [attribute.key for attribute in sqlalchemy.inspect(Job).column_attrs]
    with session_scope(sessions) as session:
        stored = jobs_repo.get(session, job_id=job.id)
        assert stored is not None
        events = events_repo.list_after(session, job_id=job.id, after=None, limit=10)[0]
        assert {c: getattr(job, c) for c in columns if c not in ("created_at", "updated_at")} == {
            c: getattr(stored, c) for c in columns if c not in ("created_at", "updated_at")
        }
    assert (job.status, job.attempt, job.current_step, job.queue) == ("queued", 0, 0, "grpo-jobs")
    assert [(e.type, e.data) for e in events] == [("created", {"status": "queued"})]
