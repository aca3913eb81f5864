"""Project row locks: what makes per-project counts (active jobs, dispatched jobs) exact when
requests and workers of several processes change them at once."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.models import Project


def lock(session: Session, *, project_id: str) -> None:
    """Hold the project's row lock until this unit of work ends: one transaction at a time may
    count a project's jobs and then add or dispatch one.

    Postgres: `SELECT ... FOR UPDATE` on the project row. SQLite has no row locks: a no-op write
    takes the database's write lock now (before the count is read), which serialises the same
    way; SQLite allows one writer at a time anyway."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Project.id).where(Project.id == project_id).with_for_update())
    else:
        session.execute(
            update(Project)
            .where(Project.id == project_id)
            .values(name=Project.name)
            .execution_options(synchronize_session=False)
        )
