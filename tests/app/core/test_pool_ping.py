"""Pooled connections and a database restart (app.core.db.ping_idle_connections): the API pings a
connection only when it sat idle, and a dead one never reaches a second request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from app.core.db import make_engine
from tests.conftest import PG_ADMIN, wait_until


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(*pids: int) -> None:
    """Kill these server backends, as a database restart does, and wait until they are gone."""
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

        def gone() -> bool:
            rows = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (list(pids),)
            ).fetchone()
            return rows is not None and rows[0] == 0

        wait_until(gone, 10, f"backends {pids} to exit")


@pytest.fixture
def engines(pg_url: str) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.dispose()


def _engine(engines: list[Engine], pg_url: str, idle_s: float, pool_size: int = 1) -> Engine:
    engine = make_engine(pg_url, pool_size=pool_size, max_overflow=0, ping_after_idle_s=idle_s)
    engines.append(engine)
    return engine


def _count_pings(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    pings: list[int] = []
    real = engine.dialect.do_ping

    def counting(dbapi_conn: Any) -> bool:
        pings.append(1)
        return bool(real(dbapi_conn))

    monkeypatch.setattr(engine.dialect, "do_ping", counting)
    return pings


def test_a_connection_used_moments_ago_is_not_pinged(
    pg_url: str, engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(engines, pg_url, idle_s=3600)
    pings = _count_pings(engine, monkeypatch)
    first = _backend_pid(engine)
    assert _backend_pid(engine) == first  # the same pooled connection, reused
    assert pings == []


def test_an_idle_connection_is_pinged_and_a_dead_one_replaced(
    pg_url: str, engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(engines, pg_url, idle_s=0)  # every reuse counts as idle
    pings = _count_pings(engine, monkeypatch)
    first = _backend_pid(engine)
    _terminate(first)
    second = _backend_pid(engine)  # the ping found it dead: a fresh connection, no error
    assert second != first
    assert pings == [1]


def test_a_dead_connection_met_by_a_statement_retires_the_whole_pool(
    pg_url: str, engines: list[Engine]
) -> None:
    # The case the idle ping leaves open (a restart between two uses close together): the
    # statement that meets the dead connection fails, and no other connection opened before
    # the restart is handed out again.
    engine = _engine(engines, pg_url, idle_s=3600, pool_size=2)
    with engine.connect() as a, engine.connect() as b:
        pids = [int(c.execute(text("SELECT pg_backend_pid()")).scalar_one()) for c in (a, b)]
    _terminate(*pids)
    with pytest.raises(DBAPIError) as failed, engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    assert failed.value.connection_invalidated
    with engine.connect() as a, engine.connect() as b:
        fresh = [int(c.execute(text("SELECT pg_backend_pid()")).scalar_one()) for c in (a, b)]
    assert not set(fresh) & set(pids)
