"""Idempotency records. The service claims a key in its own committed transaction so that a
concurrent duplicate sees the claim (see app.jobs.service)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, delete, select, text, update
from sqlalchemy.orm import Session

from app.core import db
from app.core.models import IdempotencyRecord

_TIMESTAMP = IdempotencyRecord.__table__.c.created_at.type

# One statement for Postgres and SQLite (3.35+) alike. Plain SQL because SQLAlchemy's
# dialect-specific INSERT ... ON CONFLICT is never cached: it was compiled again for every
# request, which cost more CPU than all the other statements of a create together.
_CLAIM = text(
    """
    INSERT INTO idempotency_records (project_id, "key", request_hash, state, created_at)
    VALUES (:project_id, :key, :request_hash, 'in_progress', :now)
    ON CONFLICT (project_id, "key") DO UPDATE SET
        request_hash = excluded.request_hash,
        state = 'in_progress',
        response_status = NULL,
        response_body = NULL,
        created_at = excluded.created_at
    WHERE idempotency_records.created_at < :expired_before
    RETURNING "key"
    """
).bindparams(
    # Bound as the column is, so SQLite stores and compares the same text format.
    bindparam("now", type_=_TIMESTAMP),
    bindparam("expired_before", type_=_TIMESTAMP),
)


def claim(
    session: Session,
    *,
    project_id: str,
    key: str,
    request_hash: str,
    now: datetime,
    expired_before: datetime,
) -> bool:
    """Claim the key in one statement: insert the `in_progress` record, or take over the record
    there when it was created before `expired_before` (its time to live is over). True when the
    caller now owns the key; False when a live record holds it (`get` reads it).

    One `INSERT ... ON CONFLICT DO UPDATE ... WHERE ... RETURNING` instead of a delete of the
    expired record and an insert: one round trip, and on an autocommit connection no BEGIN or
    COMMIT either. A concurrent claim of the same key waits on the unique index for this one,
    then finds a live record: only one of them owns the key."""
    params = {
        "project_id": project_id,
        "key": key,
        "request_hash": request_hash,
        "now": now,
        "expired_before": expired_before,
    }
    return db.execute_core(session, _CLAIM, params).first() is not None


def get(session: Session, *, project_id: str, key: str) -> IdempotencyRecord | None:
    return session.scalars(
        select(IdempotencyRecord).where(
            IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key
        )
    ).one_or_none()


# Built once (see app.jobs.repository): every job creation with a key runs it.
_COMPLETE = (
    update(IdempotencyRecord)
    .where(
        IdempotencyRecord.project_id == bindparam("record_project_id"),
        IdempotencyRecord.key == bindparam("record_key"),
    )
    .values(
        state="completed",
        response_status=bindparam("record_status"),
        response_body=bindparam("record_body"),
    )
    .execution_options(synchronize_session=False)
)


def complete(
    session: Session, *, project_id: str, key: str, status: int, body: dict[str, Any]
) -> None:
    db.execute_core(
        session,
        _COMPLETE,
        {
            "record_project_id": project_id,
            "record_key": key,
            "record_status": status,
            "record_body": body,
        },
    )


def release(
    session: Session, *, project_id: str, key: str, claimed_before: datetime | None = None
) -> None:
    """Delete the key's record; with `claimed_before`, only an in-progress claim older than that
    (a request that died), so a fresh claim made meanwhile is left alone."""
    statement = delete(IdempotencyRecord).where(
        IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key
    )
    if claimed_before is not None:
        statement = statement.where(
            IdempotencyRecord.state == "in_progress", IdempotencyRecord.created_at < claimed_before
        )
    session.execute(statement)
