"""Idempotency records. The service claims a key in its own committed transaction so that a
concurrent duplicate sees the claim (see app.services.jobs)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from app.models import IdempotencyRecord


def claim(session: Session, *, project_id: str, key: str, request_hash: str, now: datetime) -> None:
    """Insert the `in_progress` record; IntegrityError when the key is already claimed."""
    session.add(
        IdempotencyRecord(
            project_id=project_id,
            key=key,
            request_hash=request_hash,
            state="in_progress",
            created_at=now,
        )
    )
    session.flush()


def get(session: Session, *, project_id: str, key: str) -> IdempotencyRecord | None:
    return session.scalars(
        select(IdempotencyRecord).where(
            IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key
        )
    ).one_or_none()


def delete_older_than(session: Session, *, project_id: str, key: str, cutoff: datetime) -> None:
    session.execute(
        delete(IdempotencyRecord).where(
            IdempotencyRecord.project_id == project_id,
            IdempotencyRecord.key == key,
            IdempotencyRecord.created_at < cutoff,
        )
    )


def complete(
    session: Session, *, project_id: str, key: str, status: int, body: dict[str, Any]
) -> None:
    session.execute(
        update(IdempotencyRecord)
        .where(IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key)
        .values(state="completed", response_status=status, response_body=body)
        .execution_options(synchronize_session=False)
    )


def release(session: Session, *, project_id: str, key: str) -> None:
    session.execute(
        delete(IdempotencyRecord).where(
            IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key
        )
    )
