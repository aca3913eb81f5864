"""Engine, session factory, and the unit of work that ends every transaction.

A transaction commits only at a boundary: the request (`app.core.deps.get_session`), a worker task or
a CLI command (`session_scope`). Code inside a unit of work only flushes. Work that must follow
the commit (sending a job to the broker) is registered with `after_commit`, work that must be
the last thing before the commit (a count under a row lock, held only until the commit) with
`before_commit`, and work that must undo a side effect taken outside the transaction (an
idempotency claim) with `after_rollback`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, CursorResult, Engine, Executable, create_engine, event
from sqlalchemy.exc import DBAPIError, InvalidatePoolError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

_BEFORE_COMMIT = "grpo_before_commit"
_AFTER_COMMIT = "grpo_after_commit"
_AFTER_ROLLBACK = "grpo_after_rollback"
_CHECKED_IN_AT = "grpo_checked_in_at"


def normalise_url(url: str) -> str:
    """`postgresql://` would pick psycopg2, which we do not ship; psycopg 3 is the driver."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(
    url: str,
    *,
    pool_size: int = 10,
    max_overflow: int = 10,
    ping_after_idle_s: float | None = None,
    autocommit: bool = False,
) -> Engine:
    """Create an engine tuned for the backend: short connect timeouts so a dead database
    turns into a quick 503, and WAL + busy timeout so API and worker share a SQLite file.

    Pooled connections are checked before use, so a database restart costs no request:
    by default every checkout pings (`pool_pre_ping`); with `ping_after_idle_s`, only a
    connection that sat idle that long (see `ping_idle_connections`). `autocommit`: every
    statement is its own transaction (no BEGIN/COMMIT round trips), for single-statement work."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    connect_args: dict[str, Any] = {}
    if url.startswith("postgresql"):
        # Short enough that a dead database is a quick 503, long enough for a loaded machine.
        connect_args = {"connect_timeout": 5}
    options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
    engine = create_engine(
        url,
        pool_pre_ping=ping_after_idle_s is None,
        # Most recently returned first: under load the same few connections stay busy (and
        # skip the idle ping), the rest age and are pinged, or closed by the server, unseen.
        pool_use_lifo=True,
        pool_size=pool_size,
        max_overflow=max_overflow,
        connect_args=connect_args,
        **options,
    )
    if ping_after_idle_s is not None:
        ping_idle_connections(engine, ping_after_idle_s)
    return engine


def ping_idle_connections(engine: Engine, idle_s: float) -> None:
    """Ping a pooled connection at checkout only when it sat in the pool `idle_s` or longer.

    `pool_pre_ping` costs a round trip per checkout: a create checks out two or three
    connections, so under load the pings were a sixth of its database round trips. A connection
    returned moments ago is alive unless the database restarted in those moments, and a
    restart is seen anyway: while the database is down, any statement that fails with a
    disconnect makes SQLAlchemy invalidate every pooled connection opened before it, so none
    of them is reused after the restart. What is left is a restart shorter than `idle_s` with
    no statement at all during it; the request that then meets the dead connection fails like
    the requests in flight at the restart, and invalidates the rest of the pool."""

    @event.listens_for(engine.pool, "checkin")
    def _stamp(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info[_CHECKED_IN_AT] = time.monotonic()

    @event.listens_for(engine.pool, "checkout")
    def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        returned = record.info.get(_CHECKED_IN_AT)
        if returned is None or time.monotonic() - returned < idle_s:
            return  # just connected, or used moments ago
        dialect = engine.dialect
        try:
            dialect.do_ping(dbapi_conn)  # what pool_pre_ping runs
        except dialect.loaded_dbapi.Error as exc:
            if not dialect.is_disconnect(exc, dbapi_conn, None):
                raise
            # As pool_pre_ping does: the pool drops every connection opened before now (the
            # database restarted: they are all dead) and checks out a fresh one.
            raise InvalidatePoolError(f"pooled connection is dead: {exc}") from exc


def warm_pool(engine: Engine, tables: Iterable[str]) -> int:
    """Open the pool's kept connections now, each with `tables` and their indexes in its server
    backend's catalog cache; returns how many. Run by an API process before it takes requests.

    A new Postgres backend reads a table's and its indexes' definitions from the catalogs the
    first time a statement touches them, and a pool opens connections only as concurrency
    grows. So the first burst after a start, or a rise from a low rate to a high one, made each
    process open connections and fill their caches inside requests: the first half second at
    200 creates/s after a warm-up at 20/s answered at p50 50-150 ms and p99 up to 330 ms, the
    steady state at 5 ms and 20 ms (BENCHMARKS.md, "API: job creation under load"). Planning
    `SELECT 1 FROM t LIMIT 0` loads t and its indexes and reads no row. SQLite has no backends
    (and a pool that keeps nothing): nothing to do.

    A database that cannot be reached now is not fatal (the process starts and its readiness
    check says so); the pool then fills as requests come, as it did before."""
    if engine.dialect.name != "postgresql":
        return 0
    size = int(getattr(engine.pool, "size", lambda: 0)())
    connections: list[Connection] = []
    try:
        for _ in range(size):
            connection = engine.connect()
            connections.append(connection)
            for table in tables:
                quoted = engine.dialect.identifier_preparer.quote(table)
                connection.exec_driver_sql(f"SELECT 1 FROM {quoted} LIMIT 0")
            connection.rollback()
    except DBAPIError as exc:
        log.warning("database pool not warmed (%s): it fills as requests come", type(exc).__name__)
    finally:
        for connection in connections:
            connection.close()  # back to the pool, which keeps `size` of them open
    return len(connections)


def execute_core(
    session: Session, statement: Executable, params: Mapping[str, Any] | None = None
) -> CursorResult[Any]:
    """Run a Core statement of the hot path on the session's connection, in its transaction.

    `session.execute` sends a Core statement that names ORM entities through the ORM's
    statement handling, which cost about as much CPU again as the statement itself (measured
    for a create's project lock, quota count and idempotency update: 130/210/200 us against
    100/165/100 us). The flush first keeps what `session.execute` guarantees: pending ORM
    changes are in the database before the statement reads it (a no-op when there are none)."""
    session.flush()
    return session.connection().execute(statement, params)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def before_commit(session: Session, callback: Callable[[Session], object]) -> None:
    """Run `callback(session)` at the boundary, as the last work of this unit of work before its
    commit (after the route or task returned). What it raises rolls the unit of work back.
    For a row lock that should be held as briefly as possible: taken here, it is released by
    the commit that follows at once, in the same thread."""
    session.info.setdefault(_BEFORE_COMMIT, []).append(callback)


def after_commit(session: Session, callback: Callable[[Session], object]) -> None:
    """Run `callback(session)` once the boundary has committed this unit of work, in a fresh
    transaction that the boundary commits too. Dropped if the unit of work rolls back."""
    session.info.setdefault(_AFTER_COMMIT, []).append(callback)


def after_rollback(session: Session, callback: Callable[[], object]) -> None:
    """Run `callback()` if this unit of work rolls back (after the rollback, so it never waits
    on locks this transaction held). Dropped once the unit of work commits."""
    session.info.setdefault(_AFTER_ROLLBACK, []).append(callback)


def commit(session: Session) -> None:
    """End a unit of work successfully: run its before-commit work, commit, then run its
    after-commit work (each piece of which commits the same way).

    The transaction is already durable when after-commit work runs, so a failure there is
    logged, not raised: the caller's request or task did succeed, and the periodic sweep repairs
    what the callback could not do (a job whose message was not sent is re-sent)."""
    _commit_now(session)
    session.info.pop(_AFTER_ROLLBACK, None)
    for callback in session.info.pop(_AFTER_COMMIT, []):
        try:
            callback(session)
            _commit_now(session)
        except Exception:
            log.exception("work after commit failed; the periodic sweep will repair it")
            session.rollback()
            session.info.pop(_BEFORE_COMMIT, None)


def _commit_now(session: Session) -> None:
    for callback in session.info.pop(_BEFORE_COMMIT, []):
        callback(session)
    session.commit()


def rollback(session: Session) -> None:
    """End a unit of work unsuccessfully: roll back, then undo outside side effects (even when
    the rollback itself fails: the database connection may be what broke)."""
    try:
        session.rollback()
    finally:
        session.info.pop(_BEFORE_COMMIT, None)
        session.info.pop(_AFTER_COMMIT, None)
        for callback in session.info.pop(_AFTER_ROLLBACK, []):
            try:
                callback()
            except Exception:
                log.exception("work after rollback failed")


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A unit of work: commit on success, roll back on error. The request, task and CLI
    boundaries use it; nothing inside a unit of work commits."""
    session = factory()
    try:
        yield session
        commit(session)
    except BaseException:
        rollback(session)
        raise
    finally:
        session.close()
