"""Project row locks: what makes per-project counts (active jobs, dispatched jobs) exact when
requests and workers of several processes change them at once."""

from __future__ import annotations

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from app.core import db
from app.core.models import Project

# Built once (see app.jobs.repository): every job creation runs it.
_LOCK = (
    select(Project.id).where(Project.id == bindparam("project_id")).with_for_update(key_share=True)
)


def lock(session: Session, *, project_id: str) -> None:
    """Hold the project's row lock until this unit of work ends: one transaction at a time may
    count a project's jobs and then add or dispatch one.

    Postgres: `SELECT ... FOR NO KEY UPDATE` on the project row. That mode excludes the other
    lockers here, and nothing else: the foreign-key checks of rows that point at the project
    (a new job, an idempotency claim, an upload) take the row's KEY SHARE lock, which FOR UPDATE
    would block, so every insert of the project waited for whoever held the lock; NO KEY UPDATE
    lets them run. SQLite has no row locks: a no-op write takes the database's write lock now
    (before the count is read), which serialises the same way; SQLite allows one writer at a
    time anyway."""
    if session.get_bind().dialect.name == "postgresql":
        db.execute_core(session, _LOCK, {"project_id": project_id})
    else:
        session.execute(
            update(Project)
            .where(Project.id == project_id)
            .values(name=Project.name)
            .execution_options(synchronize_session=False)
        )
