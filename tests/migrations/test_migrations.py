"""Alembic migrations: up, down and up again on Postgres and SQLite; models match the schema; data
stored before a revision is carried into what it adds."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

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


def _devices_after_upgrade(url: str) -> dict[str, int]:
    """Jobs stored at revision 0005 (one whose spec asks for 3 devices, one without resources,
    each with an event), then upgraded: each job's `devices` column. The jobs' rows in the
    tables that reference them survive the upgrade and the downgrade (a migration that
    recreates `jobs` on SQLite would drop them by cascade)."""
    db.upgrade(url, "0005")
    engine = make_engine(url)
    now = datetime(2026, 11, 26, tzinfo=UTC)
    try:
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO projects (id, name, created_at) VALUES ('p', 'p', :t)"),
                {"t": now},
            )
            for job_id, spec in (("three", {"resources": {"devices": 3}}), ("plain", {})):
                conn.execute(
                    text(
                        "INSERT INTO jobs (id, project_id, spec, status, queue, attempt, "
                        "max_attempts, created_at, updated_at, current_step, total_steps, "
                        "run_started_step) VALUES (:id, 'p', :spec, 'queued', 'q', 0, 3, :t, :t, "
                        "0, 1, 0)"
                    ),
                    {"id": job_id, "spec": json.dumps({"model": "m", **spec}), "t": now},
                )
                conn.execute(
                    text(
                        "INSERT INTO job_events (job_id, attempt, type, level, message, "
                        "created_at) VALUES (:id, 0, 'created', 'info', 'job created', :t)"
                    ),
                    {"id": job_id, "t": now},
                )

        def events() -> int:
            with engine.connect() as conn:
                return int(conn.execute(text("SELECT count(*) FROM job_events")).scalar_one())

        db.upgrade(url)
        assert events() == 2
        with engine.connect() as conn:
            devices = {row[0]: row[1] for row in conn.execute(text("SELECT id, devices FROM jobs"))}
        db.downgrade(url, "0005")
        assert events() == 2
        return devices
    finally:
        engine.dispose()


def test_job_devices_are_taken_from_stored_specs_on_sqlite(tmp_path: Path) -> None:
    assert _devices_after_upgrade(f"sqlite:///{tmp_path / 'd.db'}") == {"three": 3, "plain": 1}


def test_job_devices_are_taken_from_stored_specs_on_postgres() -> None:
    name, url = create_pg_database("grpo_devices")
    try:
        assert _devices_after_upgrade(url) == {"three": 3, "plain": 1}
    finally:
        drop_pg_database(name)
