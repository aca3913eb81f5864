"""Idempotency records: claimed in their own transaction so a concurrent duplicate sees them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from app.models import IdempotencyRecord


def get(session: Session, project_id: str, key: str) -> IdempotencyRecord | None:
    return session.scalars(
        select(IdempotencyRecord).where(
            IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key
        )
    ).one_or_none()


def delete_older_than(session: Session, project_id: str, key: str, cutoff: datetime) -> None:
    session.execute(
        delete(IdempotencyRecord).where(
            IdempotencyRecord.project_id == project_id,
            IdempotencyRecord.key == key,
            IdempotencyRecord.created_at < cutoff,
        )
    )


def complete(
    session: Session, project_id: str, key: str, status: int, body: dict[str, Any]
) -> None:
    session.execute(
        update(IdempotencyRecord)
        .where(IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key)
        .values(state="completed", response_status=status, response_body=body)
        .execution_options(synchronize_session=False)
    )


def release(session: Session, project_id: str, key: str) -> None:
    session.execute(
        delete(IdempotencyRecord).where(
            IdempotencyRecord.project_id == project_id, IdempotencyRecord.key == key
        )
    )
