"""Tokens served, per project, model name and UTC day (table ``inference_usage``): the gateway
adds each answered request's counts (one upsert), the daily quota sums a project's day, and
GET /v1/usage lists the rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.core.models import InferenceUsage

KEY = ("project_id", "model", "day")


def day_of(moment: datetime | date) -> str:
    """The ``day`` column's value: YYYY-MM-DD (the caller passes a UTC time)."""
    return moment.strftime("%Y-%m-%d")


def add(
    session: Session,
    *,
    project_id: str,
    model: str,
    day: str,
    requests: int,
    prompt_tokens: int,
    completion_tokens: int,
) -> None:
    """Add one answered request's counts to the (project, model, day) row, creating it: one
    INSERT ... ON CONFLICT DO UPDATE adding to the stored values, so concurrent requests of
    several API processes never lose a count."""
    row = {
        "project_id": project_id,
        "model": model,
        "day": day,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
    }
    dialect = session.get_bind().dialect.name
    if dialect not in ("postgresql", "sqlite"):  # pragma: no cover - not supported
        session.execute(insert(InferenceUsage).values(**row))
        return
    base: Any = (postgresql if dialect == "postgresql" else sqlite).insert(InferenceUsage)
    stmt = base.values(**row)
    table = InferenceUsage.__table__.c
    stmt = stmt.on_conflict_do_update(
        index_elements=list(KEY),
        set_={
            name: table[name] + stmt.excluded[name]
            for name in ("requests", "prompt_tokens", "completion_tokens")
        },
    )
    session.execute(stmt)


def tokens_on(session: Session, *, project_id: str, day: str) -> int:
    """Prompt plus completion tokens of the project on ``day``, every model together."""
    total = session.scalar(
        select(
            func.coalesce(
                func.sum(InferenceUsage.prompt_tokens + InferenceUsage.completion_tokens), 0
            )
        ).where(InferenceUsage.project_id == project_id, InferenceUsage.day == day)
    )
    return int(total or 0)


@dataclass(frozen=True)
class UsageRow:
    model: str
    day: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


def rows_since(
    session: Session, *, project_id: str, since_day: str, limit: int
) -> tuple[list[UsageRow], bool]:
    """The project's rows of ``since_day`` and later, newest day first, then the most tokens,
    at most ``limit``; and whether there are more."""
    found = session.execute(
        select(
            InferenceUsage.model,
            InferenceUsage.day,
            InferenceUsage.requests,
            InferenceUsage.prompt_tokens,
            InferenceUsage.completion_tokens,
        )
        .where(InferenceUsage.project_id == project_id, InferenceUsage.day >= since_day)
        .order_by(
            InferenceUsage.day.desc(),
            (InferenceUsage.prompt_tokens + InferenceUsage.completion_tokens).desc(),
            InferenceUsage.model,
        )
        .limit(limit + 1)
    ).all()
    rows = [UsageRow(r[0], r[1], int(r[2]), int(r[3]), int(r[4])) for r in found[:limit]]
    return rows, len(found) > limit
