"""Engine, session factory, and the unit of work that ends every transaction.

A transaction commits only at a boundary: the request (`app.deps.get_session`), a worker task or
a CLI command (`session_scope`). Code inside a unit of work only flushes. Work that must follow
the commit (sending a job to the broker) is registered with `after_commit`, and work that must
undo a side effect taken outside the transaction (an idempotency claim) with `after_rollback`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

_AFTER_COMMIT = "grpo_after_commit"
_AFTER_ROLLBACK = "grpo_after_rollback"


def normalise_url(url: str) -> str:
    """`postgresql://` would pick psycopg2, which we do not ship; psycopg 3 is the driver."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 10) -> Engine:
    """Create an engine tuned for the backend: short connect timeouts so a dead database
    turns into a quick 503, and WAL + busy timeout so API and worker share a SQLite file."""
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
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=max_overflow,
        connect_args=connect_args,
    )


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def after_commit(session: Session, callback: Callable[[Session], object]) -> None:
    """Run `callback(session)` once the boundary has committed this unit of work, in a fresh
    transaction that the boundary commits too. Dropped if the unit of work rolls back."""
    session.info.setdefault(_AFTER_COMMIT, []).append(callback)


def after_rollback(session: Session, callback: Callable[[], object]) -> None:
    """Run `callback()` if this unit of work rolls back (after the rollback, so it never waits
    on locks this transaction held). Dropped once the unit of work commits."""
    session.info.setdefault(_AFTER_ROLLBACK, []).append(callback)


def commit(session: Session) -> None:
    """End a unit of work successfully: commit, then run its after-commit work.

    The transaction is already durable when after-commit work runs, so a failure there is
    logged, not raised: the caller's request or task did succeed, and the periodic sweep repairs
    what the callback could not do (a job whose message was not sent is re-sent)."""
    session.commit()
    session.info.pop(_AFTER_ROLLBACK, None)
    for callback in session.info.pop(_AFTER_COMMIT, []):
        try:
            callback(session)
            session.commit()
        except Exception:
            log.exception("work after commit failed; the periodic sweep will repair it")
            session.rollback()


def rollback(session: Session) -> None:
    """End a unit of work unsuccessfully: roll back, then undo outside side effects (even when
    the rollback itself fails: the database connection may be what broke)."""
    try:
        session.rollback()
    finally:
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
