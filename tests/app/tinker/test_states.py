"""A Tinker model's and call's states, as their one writer (app.tinker.status_repository)
moves them: each state moves exactly where its meaning allows, through the real database,
whoever asks; a move the table rules out is refused before it reaches the database."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel, TinkerRequest, TinkerSession
from app.tinker.states import MODEL_MOVES, REQUEST_MOVES, ModelStatus, RequestStatus
from app.tinker.status_repository import finish_requests, move_model
from tests.conftest import new_project_key

S, R, RL = ModelStatus.STARTING, ModelStatus.READY, ModelStatus.RELEASED
C, F = ModelStatus.CLOSED, ModelStatus.FAILED
# What each state means (docs/tinker.md), written out rather than read from the table:
# - starting: queued for a worker; a worker loads it (ready), or it fails (unclaimed, a load
#   error), or its session closes first.
# - ready: resident on a worker; idle it is released, its session's end closes it, a lost
#   worker or an error fails it. It never goes back to the queue while a worker holds it.
# - released: on disk, no worker; its next call queues it (starting), its session's end
#   closes it. Nothing fails it: no worker holds it to lose.
# - closed, failed: ended, nothing leaves them.
EXPECTED = {S: {R, C, F}, R: {RL, C, F}, RL: {S, C}, C: set(), F: set()}


@pytest.fixture
def sessions(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.resolved_database_url)
    factory = make_session_factory(engine)
    yield factory
    # The database is shared with other tests, whose upkeep passes would find these rows
    # (released models of sessions that go silent): gone with this test.
    with session_scope(factory) as db:
        for table in (TinkerRequest, TinkerModel, TinkerSession):
            db.query(table).filter(table.project_id.in_(CREATED)).delete(synchronize_session=False)
    CREATED.clear()
    engine.dispose()


CREATED: set[str] = set()  # the projects this module's tests made


def model_in(sessions: sessionmaker[Session], settings: Settings, status: ModelStatus) -> str:
    _, project_id = new_project_key(settings)
    CREATED.add(project_id)
    session_id = f"sess-{secrets.token_hex(4)}"
    with session_scope(sessions) as db:
        db.add(TinkerSession(id=session_id, project_id=project_id))
        db.flush()
        db.add(
            TinkerModel(
                id=f"{session_id}:train:0",
                session_id=session_id,
                project_id=project_id,
                base_model="tiny-random-llama",
                lora_rank=4,
                status=status.value,
            )
        )
    return f"{session_id}:train:0"


def status_of(sessions: sessionmaker[Session], model_id: str) -> str:
    with session_scope(sessions) as db:
        row = db.get(TinkerModel, model_id)
        assert row is not None
        return row.status


@pytest.mark.parametrize("source", list(ModelStatus), ids=str)
def test_each_model_state_moves_exactly_where_its_meaning_allows(
    sessions: sessionmaker[Session], settings: Settings, source: ModelStatus
) -> None:
    assert MODEL_MOVES[source] == EXPECTED[source]
    for target in ModelStatus:
        model_id = model_in(sessions, settings, source)
        with session_scope(sessions) as db:
            moved = move_model(db, model_id=model_id, to=target)
        assert moved == (target in EXPECTED[source]), (source, target)
        assert status_of(sessions, model_id) == (target if moved else source)


def test_a_move_the_table_rules_out_is_refused_before_the_database() -> None:
    with pytest.raises(ValueError, match="cannot move"):
        move_model(None, model_id="m", to=ModelStatus.READY, from_=[RL])  # type: ignore[arg-type]


def test_a_call_ends_once(sessions: sessionmaker[Session], settings: Settings) -> None:
    assert REQUEST_MOVES[RequestStatus.QUEUED] == {RequestStatus.DONE, RequestStatus.FAILED}
    model_id = model_in(sessions, settings, R)
    with session_scope(sessions) as db:
        model = db.get(TinkerModel, model_id)
        assert model is not None
        db.add(
            TinkerRequest(
                request_id=f"tr-{secrets.token_hex(4)}",
                project_id=model.project_id,
                model_id=model_id,
                seq_key="0",
                kind="optim_step",
                body=b"{}",
                status=RequestStatus.QUEUED.value,
            )
        )
    where = [TinkerRequest.model_id == model_id]
    with session_scope(sessions) as db:
        assert finish_requests(db, to=RequestStatus.DONE, where=where, values={}) == 1
    with session_scope(sessions) as db:  # done is final: neither failed nor done again
        assert finish_requests(db, to=RequestStatus.FAILED, where=where, values={}) == 0
        assert finish_requests(db, to=RequestStatus.DONE, where=where, values={}) == 0
