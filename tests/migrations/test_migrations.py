"""Alembic migrations: up, down and up again on Postgres and SQLite; models match the schema."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from app.core.db import make_engine
from app.core.models import Base
from grpo_cli import db
from tests.conftest import create_pg_database, drop_pg_database

TABLES = {
    "projects",
    "api_keys",
    "files",
    "jobs",
    "job_events",
    "job_metrics",
    "job_samples",
    "checkpoints",
    "idempotency_records",
    "webhook_endpoints",
    "webhook_deliveries",
    "webhook_attempts",
}


def _round_trip(url: str) -> None:
    db.upgrade(url)
    engine = make_engine(url)
    try:
        assert set(inspect(engine).get_table_names()) >= TABLES
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
        db.downgrade(url, "base")
        assert not (TABLES & set(inspect(engine).get_table_names()))
        db.upgrade(url)
        assert set(inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()


def test_migrations_on_sqlite(tmp_path: Path) -> None:
    _round_trip(f"sqlite:///{tmp_path / 'm.db'}")


def test_migrations_on_postgres() -> None:
    name, url = create_pg_database("grpo_migrate")
    try:
        _round_trip(url)
    finally:
        drop_pg_database(name)
