"""Time in one place, timezone-aware UTC, so tests and SQLite/Postgres agree."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; treat them as the UTC they were written as."""
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def unix(moment: datetime | None) -> int | None:
    """Whole Unix seconds, as OpenAI's objects give times (`created_at`, `created`)."""
    at = as_utc(moment)
    return None if at is None else int(at.timestamp())
