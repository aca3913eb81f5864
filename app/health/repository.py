"""The readiness probe's query."""

from __future__ import annotations

from sqlalchemy import Engine, text


def ping(engine: Engine) -> None:
    """Round-trip to the database on a fresh connection; raises when it is unreachable."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
