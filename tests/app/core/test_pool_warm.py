"""Warming the API's database pools at start (app.core.db.warm_pool, app.core.state.warm_pools): the first
burst of requests after a start finds its connections open, with the tables in each server
backend's catalog cache, instead of opening them inside requests."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, text

from app.core.db import make_engine, warm_pool
from app.core.models import Base
from app.core.state import build_state, warm_pools
from tests.conftest import settings_for

TABLES = [table.name for table in Base.metadata.sorted_tables]


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.dispose()


def _count_connects(engine: Engine) -> list[int]:
    opened: list[int] = []

    @event.listens_for(engine.pool, "connect")
    def _opened(_dbapi_conn: Any, _record: Any) -> None:
        opened.append(1)

    return opened


def _burst(engine: Engine, size: int) -> set[int]:
    """`size` requests at once, each holding its connection until all have one; the backend
    pids they got."""
    barrier = threading.Barrier(size, timeout=30)
    pids: set[int] = set()
    errors: list[BaseException] = []

    def request() -> None:
        try:
            with engine.connect() as conn:
                pids.add(int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one()))
                barrier.wait()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=request) for _ in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return pids


def test_a_warm_pool_serves_a_burst_without_opening_a_connection(
    pg_url: str, engines: list[Engine]
) -> None:
    engine = make_engine(pg_url, pool_size=4, max_overflow=4, ping_after_idle_s=3600)
    engines.append(engine)
    opened = _count_connects(engine)

    assert warm_pool(engine, TABLES) == 4
    assert len(opened) == 4
    assert engine.pool.checkedin() == 4  # type: ignore[attr-defined]

    pids = _burst(engine, 4)
    assert len(pids) == 4
    assert len(opened) == 4, "the burst opened connections of its own"


def test_the_warm_up_reads_every_table_and_no_row(pg_url: str, engines: list[Engine]) -> None:
    """What a new backend's first statements would otherwise do inside requests: open each
    table and its indexes (a statement planned over the table does), without reading rows."""
    engine = make_engine(pg_url, pool_size=1, max_overflow=0, ping_after_idle_s=3600)
    engines.append(engine)
    sent: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    assert warm_pool(engine, TABLES) == 1
    assert sent == [f"SELECT 1 FROM {name} LIMIT 0" for name in TABLES]


def test_an_unreachable_database_does_not_stop_the_start(engines: list[Engine]) -> None:
    with socket.socket() as probe:  # a free port: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = make_engine(
        f"postgresql+psycopg://postgres@127.0.0.1:{port}/nowhere?connect_timeout=2",
        pool_size=2,
        max_overflow=0,
        ping_after_idle_s=3600,
    )
    engines.append(engine)
    assert warm_pool(engine, TABLES) == 0


def test_sqlite_has_nothing_to_warm(tmp_path: Path, engines: list[Engine]) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    engines.append(engine)
    assert warm_pool(engine, TABLES) == 0


def test_the_api_process_warms_both_of_its_pools(
    pg_url: str, tmp_path: Path, queue_name: str
) -> None:
    state = build_state(settings_for("postgres", pg_url, tmp_path, queue_name))
    try:
        main_size = state.engine.pool.size()  # type: ignore[attr-defined]
        claims_engine = state.claims.kw["bind"]
        claims_size = claims_engine.pool.size()
        assert warm_pools(state) == main_size + claims_size
        assert state.engine.pool.checkedin() == main_size  # type: ignore[attr-defined]
        assert claims_engine.pool.checkedin() == claims_size
    finally:
        state.engine.dispose()
        state.claims.kw["bind"].dispose()
