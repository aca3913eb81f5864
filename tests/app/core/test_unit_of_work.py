"""The request is the unit of work: it commits when the route returned and before the response
is sent; a new job is sent to the broker only after its row is committed; a failed request
leaves nothing behind (no job, no message, no idempotency claim)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Message, Receive, Scope, Send

from app.core import db
from app.core.clock import utcnow
from app.core.ids import new_id
from app.core.models import IdempotencyRecord, Job, Project
from app.core.settings import Settings
from app.main import create_app
from app.sessions import repository as keys_repo
from tests.conftest import new_project_key, tiny_spec


@dataclass
class CheckingDispatcher:
    """Records each send, and whether the job row was committed (readable from another
    connection) at that moment."""

    sessions: sessionmaker[Session]
    log: list[str]
    up: bool = True
    committed: dict[str, bool] = field(default_factory=dict)

    def send(self, job_id: str, queue: str | None = None) -> bool:
        with db.session_scope(self.sessions) as session:
            self.committed[job_id] = session.get(Job, job_id) is not None
        self.log.append(f"send {job_id}")
        return self.up


@dataclass
class Harness:
    client: TestClient
    headers: dict[str, str]
    dispatcher: CheckingDispatcher
    sessions: sessionmaker[Session]
    log: list[str]
    project_id: str

    def job(self, job_id: str) -> Job | None:
        with db.session_scope(self.sessions) as session:
            return session.get(Job, job_id)


@pytest.fixture
def harness(settings: Settings) -> Iterator[Harness]:
    sessions = db.make_session_factory(db.make_engine(settings.resolved_database_url))
    log: list[str] = []
    dispatcher = CheckingDispatcher(sessions, log)
    app = create_app(settings, dispatcher)

    async def spy(scope: Scope, receive: Receive, send: Send) -> None:
        """Log the moment the response starts, to order it against the broker send."""

        async def logging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                log.append("response")
            await send(message)

        await app(scope, receive, logging_send)

    key, project_id = new_project_key(settings)
    with TestClient(spy) as client:
        yield Harness(
            client, {"Authorization": f"Bearer {key}"}, dispatcher, sessions, log, project_id
        )


def test_job_is_committed_then_sent_then_answered(harness: Harness) -> None:
    harness.log.clear()
    response = harness.client.post("/v1/jobs", json=tiny_spec(), headers=harness.headers)
    assert response.status_code == 201
    job_id = response.json()["id"]
    assert harness.log == [f"send {job_id}", "response"]
    assert harness.dispatcher.committed[job_id] is True
    job = harness.job(job_id)
    assert job is not None and job.dispatched_at is not None


def test_a_refused_create_sends_nothing_and_frees_its_idempotency_key(harness: Harness) -> None:
    spec = tiny_spec() | {"dataset": {"file_id": "file_missing"}}
    headers = harness.headers | {"Idempotency-Key": secrets.token_hex(8)}
    harness.log.clear()
    first = harness.client.post("/v1/jobs", json=spec, headers=headers)
    assert first.status_code == 422 and first.json()["error"]["param"] == "dataset.file_id"
    assert harness.log == ["response"]  # nothing sent
    # The claim was given back when the request rolled back: the retry is answered on its own
    # merits (the same 422), not with a 409 "still in progress".
    again = harness.client.post("/v1/jobs", json=spec, headers=headers)
    assert again.status_code == 422
    listed = harness.client.get("/v1/jobs", headers=harness.headers).json()["data"]
    assert listed == []


def test_broker_down_still_creates_the_job_and_leaves_it_for_the_sweep(harness: Harness) -> None:
    harness.dispatcher.up = False
    response = harness.client.post("/v1/jobs", json=tiny_spec(), headers=harness.headers)
    assert response.status_code == 201
    job = harness.job(response.json()["id"])
    assert job is not None and job.status == "queued"
    assert job.dispatched_at is None  # so the sweep re-sends it


def test_replay_body_is_the_stored_first_response(harness: Harness) -> None:
    key = secrets.token_hex(8)
    headers = harness.headers | {"Idempotency-Key": key}
    first = harness.client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    again = harness.client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert again.json() == first.json()
    with db.session_scope(harness.sessions) as session:
        record = session.get(IdempotencyRecord, (harness.project_id, key))
        assert record is not None
        assert (record.state, record.response_status) == ("completed", 201)
        assert record.response_body == first.json()


def test_an_sse_stream_holds_no_connection_while_it_waits(settings: Settings) -> None:
    settings.sse_poll_seconds = 5
    settings.sse_heartbeat_seconds = 5
    app = create_app(
        settings,
        CheckingDispatcher(
            db.make_session_factory(db.make_engine(settings.resolved_database_url)), []
        ),
    )
    key, _ = new_project_key(settings)
    headers = {"Authorization": f"Bearer {key}"}
    with TestClient(app) as client:
        job_id = client.post("/v1/jobs", json=tiny_spec(), headers=headers).json()["id"]
        pool = app.state.grpo.engine.pool
        with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
            for line in response.iter_lines():
                if line.startswith("event: "):  # the `created` event: the first poll is done
                    break
            # The stream now waits for news; neither the request's session nor a poll holds
            # a connection meanwhile.
            assert pool.checkedout() == 0


# -- the unit of work itself (app.core.db) ------------------------------------------------------


def test_after_commit_work_runs_after_the_commit_and_is_committed(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    sessions = db.make_session_factory(db.make_engine(settings.resolved_database_url))
    order: list[str] = []
    with db.session_scope(sessions) as session:
        db.after_commit(session, lambda s: order.append("first"))
        db.after_commit(session, lambda s: 1 / 0)  # logged, never raised: the work committed
        db.after_commit(session, lambda s: order.append("third"))
        db.after_rollback(session, lambda: order.append("rollback"))
        order.append("body")
    assert order == ["body", "first", "third"]
    assert "work after commit failed" in caplog.text


def test_rollback_drops_after_commit_work_and_runs_after_rollback_work(settings: Settings) -> None:
    sessions = db.make_session_factory(db.make_engine(settings.resolved_database_url))
    order: list[str] = []
    with pytest.raises(RuntimeError), db.session_scope(sessions) as session:
        db.after_commit(session, lambda s: order.append("sent"))
        db.after_rollback(session, lambda: order.append("released"))
        raise RuntimeError("the route failed")
    assert order == ["released"]


def test_before_commit_work_runs_last_before_the_commit(settings: Settings) -> None:
    sessions = db.make_session_factory(db.make_engine(settings.resolved_database_url))
    order: list[str] = []
    with db.session_scope(sessions) as session:
        db.before_commit(session, lambda s: order.append("before"))
        db.after_commit(session, lambda s: order.append("after"))
        order.append("body")
    assert order == ["body", "before", "after"]


def test_before_commit_work_that_raises_rolls_the_unit_of_work_back(settings: Settings) -> None:
    # How a refusal counted at the commit (the per-project quota) undoes the request's writes.
    sessions = db.make_session_factory(db.make_engine(settings.resolved_database_url))
    order: list[str] = []
    with pytest.raises(RuntimeError), db.session_scope(sessions) as session:
        project = keys_repo.add_project(
            session, project=Project(id=new_id("proj"), name=new_id("p"), created_at=utcnow())
        )
        db.before_commit(session, lambda s: _refuse())
        db.after_commit(session, lambda s: order.append("sent"))
        db.after_rollback(session, lambda: order.append("released"))
    assert order == ["released"]
    with db.session_scope(sessions) as session:
        assert keys_repo.find_project_by_name(session, name=project.name) is None


def _refuse() -> None:
    raise RuntimeError("over the quota")
